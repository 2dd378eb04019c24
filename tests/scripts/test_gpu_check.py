"""`python -m scripts.gpu_check` in its reduced CPU form, so the GPU check cannot rot where no GPU
is: every row it runs passes, and its one table counts them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.paths import ROOT


@pytest.mark.slow
def test_the_gpu_check_runs_reduced_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--reduced",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    # device, 4 loads, 2 exactness rows, sampled acceptance, the bench and its 3 methods
    assert lines[-1] == "12 passed, 0 failed", done.stdout
    rows = {line.strip().split("  ")[0]: line for line in lines[2:-1]}
    assert "no NVIDIA GPU found" in rows["device and install"]  # the launcher's own detection
    for row in ("load bundled fp32", "load bundled bf16", "load 1B stand-in bf16"):
        assert "estimate" in rows[row] and re.search(r"; [1-9]\d* tokens", rows[row])
    assert "eager (cpu): lookup" in done.stdout and "same tokens" in rows["eager (cpu): lookup"]
    assert "tokens/step" in rows["eager (cpu): vanilla"]
    assert "sampled acceptance on the device cpu" in rows
