"""scripts/lock.py's Windows CUDA lock, from a made-up index page (no network)."""

from __future__ import annotations

import io

import pytest

from scripts import lock

CPU = """accelerate==1.15.0 \\
    --hash=sha256:aa
torch==2.13.0+cpu \\
    --hash=sha256:bb
tqdm==4.0.0 \\
    --hash=sha256:cc
"""
H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64
PAGE = f"""<a href="/whl/cu128/torch-2.13.0%2Bcu128-cp311-cp311-win_amd64.whl#sha256={H1}">x</a>
<a href="/whl/cu128/torch-2.13.0%2Bcu128-cp311-cp311-manylinux_2_28_x86_64.whl#sha256={H2}">
<a href="/whl/cu128/torch-2.13.0%2Bcu128-cp312-cp312-win_amd64.whl#sha256={H3}">x</a>
<a href="/whl/cu128/torch-2.12.0%2Bcu128-cp311-cp311-win_amd64.whl#sha256={H2}">x</a>"""


def test_the_windows_lock_takes_torch_from_the_cuda_index_and_every_other_pin_as_is(
        monkeypatch):
    monkeypatch.setattr(lock.urllib.request, "urlopen",
                        lambda url, timeout: io.BytesIO(PAGE.encode()))
    found = lock.index_hashes("https://x/whl/cu128", "torch", "2.13.0",
                              lambda f: f.endswith("win_amd64.whl"))
    assert found == [("2.13.0+cu128", f"--hash=sha256:{H1}"),
                     ("2.13.0+cu128", f"--hash=sha256:{H3}")]
    text = lock.windows_cuda_lock(CPU, "https://x/whl/cu128", found)
    assert text.splitlines()[0] == "--extra-index-url https://x/whl/cu128"
    assert f"torch==2.13.0+cu128 \\\n    --hash=sha256:{H1} \\\n    --hash=sha256:{H3}\n" in text
    assert "sha256:bb" not in text  # the CPU wheel is not admitted
    assert "accelerate==1.15.0 \\\n    --hash=sha256:aa\n" in text and "tqdm==4.0.0" in text
    with pytest.raises(SystemExit, match="none"):
        lock.windows_cuda_lock(CPU, "https://x/whl/cu128", [])
