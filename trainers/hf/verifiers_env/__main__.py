"""Build the verifiers environment: ``python -m trainers.hf.verifiers_env [DIR]``
(default ``.venv-verifiers``) — a virtual environment with requirements.txt installed
under constraints.txt. Nothing to do when DIR was built from the same files (a stamp
of their digest), so a test fixture or a recipe can call it every time.

Standard library only: it runs under any Python ≥ 3.11 and never imports corun.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).parent
FILES = (HERE / "requirements.txt", HERE / "constraints.txt")
STAMP = ".corun-verifiers-stamp"


def digest() -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in FILES)).hexdigest()


def python_of(directory: Path) -> Path:
    return directory / "bin" / "python"


def build(directory: Path) -> Path:
    """DIR's interpreter, with the pinned verifiers installed (built when missing or
    stale)."""
    stamp = directory / STAMP
    if stamp.exists() and stamp.read_text() == digest() and python_of(directory).exists():
        return python_of(directory)
    start = time.monotonic()
    venv.EnvBuilder(clear=True, with_pip=True).create(directory)
    requirements, constraints = FILES
    pip = [str(python_of(directory)), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(requirements), "-c", str(constraints)], check=True)
    stamp.write_text(digest())
    print(f"built {directory} in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return python_of(directory)


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv-verifiers")))
