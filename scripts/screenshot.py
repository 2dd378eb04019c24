"""Take the README's screenshot from the app as it is: the browser test that chats with Lookup
and runs Compare (tests/app/ui/test_ui_browser.py) saves the page it ends on.

    python -m scripts.screenshot [--out docs/screenshot.png]

The app runs on the bundled model with fresh data and cache folders (nothing of the user's
is read or written), in Debian's Chromium at 1400 px. Run it with the CPU lock held, as every
browser command here: flock -s /tmp/qd-cpu.lock python -m scripts.screenshot
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/app/ui/test_ui_browser.py::test_acceleration_switch_and_compare"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshot.png",
                        help="where the PNG goes (default: docs/screenshot.png)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "QUICKDRAFT_SCREENSHOT": str(args.out.resolve()),
               "QUICKDRAFT_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               TEST], cwd=ROOT, env=env, check=False)
    if done.returncode == 0:
        print(f"saved {args.out}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
