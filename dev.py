#!/usr/bin/env python3
"""Developer commands that set themselves up: ``python3 dev.py demo|test|bench|redis-tests|docs``.

Each command creates a virtual environment (``.venv``, or ``.venv-X.Y`` for
``--python``), installs the package and what the command needs into it when
``pyproject.toml`` changed since the last install, then runs. Standard
library only, so it runs on a fresh machine with nothing but Python 3.10+.

``redis-tests`` runs only the Redis backend's tests, with ``--redis-py
VERSION`` (or ``oldest``: the lowest ``pyproject.toml`` allows) in a
virtual environment of its own; set ``INTURN_REDIS_WIRE=public`` to run
them through redis-py's public API instead of the connection takeover.

``docs`` builds the documentation site into ``site/`` with ``mkdocs build
--strict`` (a broken link or API reference fails it); other arguments go to
mkdocs, and ``docs --serve`` serves it with live reload instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
#: What each command installs beside the package: dependency groups of pyproject.toml.
GROUPS = {
    "demo": (),
    "test": ("dev",),
    "bench": ("dev", "bench"),
    "redis-tests": ("dev",),
    "docs": ("docs",),
}
#: The Redis backend's tests (and the conformance suite's Redis servers); the
#: cluster's need redis-py 8.0, so they run with the newest only.
REDIS_TESTS = (
    "tests/test_redis_backend.py",
    "tests/test_redis_faults.py",
    "tests/test_redis_threads.py",
    "tests/test_redis_acl.py",
)
CONFORMANCE = "tests/test_backend_conformance.py"


def oldest_redis_py() -> str:
    """The lowest redis-py version the ``redis`` extra of pyproject.toml allows."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^redis = \["redis>=([0-9.]+)"\]', text, re.MULTILINE)
    if match is None:
        sys.exit("dev.py: no 'redis = [\"redis>=X\"]' extra in pyproject.toml")
    return match.group(1)


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


def ensure_venv(
    python: str, groups: tuple[str, ...], *, dedicated: bool, redis_py: str = ""
) -> Path:
    """Return the venv's interpreter, with inturn, its groups (and redis==redis_py) installed."""
    major, minor = _version_of(python)
    if (major, minor) < (3, 10):
        sys.exit(f"dev.py: inturn needs Python 3.10 or newer; {python} is {major}.{minor}")
    name = f".venv-{major}.{minor}" if dedicated else ".venv"
    pins = []
    if redis_py:
        name += f"-redis-{redis_py}"
        pins.append(f"redis=={redis_py}")
    venv = ROOT / name
    interpreter = _venv_python(venv)
    if not interpreter.exists():
        print(f"dev.py: creating {venv.name} with Python {major}.{minor}", flush=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    stamp = venv / ".inturn-installed"
    wanted = " ".join([*groups, *pins]).encode()
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + wanted).hexdigest()
    if not stamp.exists() or digest not in stamp.read_text().split():
        what = "inturn" + (f" and the {'/'.join(groups)} tools" if groups else "")
        print(
            f"dev.py: installing {what} into {venv.name}: done once "
            "(again only when pyproject.toml changes); the first time takes a minute or so",
            flush=True,
        )
        pip = [str(interpreter), "-m", "pip", "--disable-pip-version-check"]
        # pip 25.1 or newer installs PEP 735 dependency groups (--group)
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip>=25.1"], check=True)
        chosen = [option for group in groups for option in ("--group", group)]
        subprocess.run(
            [*pip, "install", "--quiet", "-e", ".", *chosen, *pins], check=True, cwd=ROOT
        )
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
    parser.add_argument("command", choices=sorted(GROUPS))
    parser.add_argument(
        "--python",
        help="the interpreter to build the environment from (default: the one running dev.py); "
        "each interpreter version gets its own .venv-X.Y",
    )
    parser.add_argument(
        "--redis-py",
        default="",
        metavar="VERSION",
        help="redis-tests: with this redis-py ('oldest': the lowest pyproject.toml allows)",
    )
    options, rest = parser.parse_known_args()  # the rest goes to the command (pytest, ...)
    python = options.python or sys.executable
    redis_py = oldest_redis_py() if options.redis_py == "oldest" else options.redis_py
    venv_python = ensure_venv(
        python, GROUPS[options.command], dedicated=bool(options.python), redis_py=redis_py
    )
    if options.command == "redis-tests":
        run(venv_python, "-c", "import redis; print('redis-py', redis.__version__)")
        run(venv_python, "-m", "pytest", *REDIS_TESTS, *rest)
        # the cluster's tests need redis-py 8.0: with an older one, the others only
        old = redis_py and int(redis_py.split(".")[0]) < 8
        servers = "(redis or valkey) and not cluster" if old else "redis or valkey"
        run(venv_python, "-m", "pytest", CONFORMANCE, "-k", servers, *rest)
    elif options.command == "demo":
        run(venv_python, "-m", "inturn", "demo", *rest)
    elif options.command == "bench":
        run(venv_python, "-m", "bench", *rest)
    elif options.command == "docs":
        os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material's banner, every build
        if "--serve" in rest:
            rest.remove("--serve")
            run(venv_python, "-m", "mkdocs", "serve", "--strict", *rest)
        else:
            run(venv_python, "-m", "mkdocs", "build", "--strict", *rest)
    else:
        run(venv_python, "-m", "ruff", "check", ".")
        run(venv_python, "-m", "ruff", "format", "--check", ".")
        run(venv_python, "-m", "mypy")
        run(venv_python, "-m", "pytest", *rest)


if __name__ == "__main__":
    main()
