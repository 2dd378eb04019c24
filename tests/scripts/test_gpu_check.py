"""`python -m scripts.gpu_check` in its reduced CPU form, so the GPU check cannot rot where no GPU
is: every check it runs passes, and its summary counts them."""

from __future__ import annotations

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
    assert lines[-1] == "5 passed, 0 failed"
    assert any(line.startswith("lean step fp32 cpu, static buffers ") for line in lines)
    assert any(line.startswith("chat fp32 lookup ") and "same tokens as Off" in line
               for line in lines)
