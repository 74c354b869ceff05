#!/usr/bin/env python3
"""Developer commands that set themselves up: ``python3 dev.py demo|test|bench``.

Each command creates a virtual environment (``.venv``, or ``.venv-X.Y`` for
``--python``), installs the package and what the command needs into it when
``pyproject.toml`` changed since the last install, then runs. Standard
library only, so it runs on a fresh machine with nothing but Python 3.10+.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
EXTRAS = {"demo": "", "test": "[dev]", "bench": "[dev,bench]"}


def _version_of(python: str) -> tuple[int, int]:
    out = subprocess.run(
        [python, "-c", "import sys; print(*sys.version_info[:2])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


def ensure_venv(python: str, extras: str, *, dedicated: bool) -> Path:
    """Return the venv's interpreter, with inturn{extras} installed and current."""
    major, minor = _version_of(python)
    if (major, minor) < (3, 10):
        sys.exit(f"dev.py: inturn needs Python 3.10 or newer; {python} is {major}.{minor}")
    venv = ROOT / (f".venv-{major}.{minor}" if dedicated else ".venv")
    interpreter = _venv_python(venv)
    if not interpreter.exists():
        print(f"dev.py: creating {venv.name} with Python {major}.{minor}", flush=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    stamp = venv / ".inturn-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + extras.encode()).hexdigest()
    if not stamp.exists() or digest not in stamp.read_text().split():
        print(f"dev.py: installing inturn{extras} into {venv.name}", flush=True)
        pip = [str(interpreter), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", "--quiet", "-e", f".{extras}"], check=True, cwd=ROOT)
        previous = stamp.read_text() if stamp.exists() else ""
        stamp.write_text(f"{previous}{digest}\n")
    return interpreter


def run(*command: str | Path) -> None:
    print("$", " ".join(map(str, command)), flush=True)
    result = subprocess.run([str(part) for part in command], cwd=ROOT)
    if result.returncode:
        sys.exit(result.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=sorted(EXTRAS))
    parser.add_argument(
        "--python",
        help="the interpreter to build the environment from (default: the one running dev.py); "
        "each interpreter version gets its own .venv-X.Y",
    )
    options, rest = parser.parse_known_args()  # the rest goes to the command (pytest, ...)
    python = options.python or sys.executable
    venv_python = ensure_venv(python, EXTRAS[options.command], dedicated=bool(options.python))
    if options.command == "demo":
        run(venv_python, "-m", "inturn", "demo", *rest)
    elif options.command == "bench":
        run(venv_python, "-m", "bench", *rest)
    else:
        run(venv_python, "-m", "ruff", "check", ".")
        run(venv_python, "-m", "ruff", "format", "--check", ".")
        run(venv_python, "-m", "mypy")
        run(venv_python, "-m", "pytest", *rest)


if __name__ == "__main__":
    main()
