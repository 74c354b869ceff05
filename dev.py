#!/usr/bin/env python3
"""Developer commands that set themselves up: ``python3 dev.py demo|test|bench|redis-tests|docs``.

Each command creates a virtual environment (``.venv``, or ``.venv-X.Y`` for
``--python``), installs the package and what the command needs into it when
``pyproject.toml`` changed since the last install, then runs. Standard
library only, so it runs on a fresh machine with nothing but Python 3.10+.

``redis-tests`` runs only the Redis backend's tests, with ``--redis-py
VERSION`` (or ``oldest``: the lowest ``pyproject.toml`` allows), and with
``--hiredis`` hiredis too (redis-py's C parser then), in a virtual
environment of its own; set ``INTURN_REDIS_WIRE=public`` to run them
through redis-py's public API instead of the connection takeover.

``docs`` builds the documentation site into ``site/`` with ``mkdocs build
--strict`` (a broken link or API reference fails it); other arguments go to
mkdocs, and ``docs --serve`` serves it with live reload instead. ``docs
--screenshots [DIR]`` then photographs pages of the built site with headless
Chromium into DIR (default ``screenshots/``) and checks each picture: there,
the size asked for, and not blank.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
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
#: cluster's need redis-py 8.0, so they run with the newest only. (.ci/run names
#: them too: the older Pythons' full runs leave them to these runs.)
REDIS_TESTS = (
    "tests/test_redis_backend.py",
    "tests/test_redis_faults.py",
    "tests/test_redis_threads.py",
    "tests/test_redis_acl.py",
)
CONFORMANCE = "tests/test_backend_conformance.py"
#: What ``docs --screenshots`` takes: file name, page under site/, window size.
SCREENSHOTS = (
    ("home", "", (1280, 900)),
    ("home-mobile", "", (390, 844)),
    ("getting-started", "getting-started/", (1280, 900)),
    ("api", "reference/inturn/", (1280, 900)),
    ("operations", "operations/", (1280, 900)),
    ("backends", "backends/", (1280, 900)),
    ("performance", "performance/", (1280, 900)),
)
#: Headless Chromium under the names Debian and others give it, the lightest first.
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


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
    python: str,
    groups: tuple[str, ...],
    *,
    dedicated: bool,
    redis_py: str = "",
    hiredis: bool = False,
) -> Path:
    """Return the venv's interpreter, with inturn, its groups (and redis==redis_py, and
    hiredis) installed."""
    major, minor = _version_of(python)
    if (major, minor) < (3, 10):
        sys.exit(f"dev.py: inturn needs Python 3.10 or newer; {python} is {major}.{minor}")
    name = f".venv-{major}.{minor}" if dedicated else ".venv"
    pins = []
    if redis_py:
        name += f"-redis-{redis_py}"
        pins.append(f"redis=={redis_py}")
    if hiredis:
        name += "-hiredis"
        pins.append("hiredis")
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


def png_rows(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB or RGBA PNG (what Chromium writes): width, height, pixel rows."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    header, idat, pos = b"", [], 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length  # length, kind, body, CRC
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"not 8-bit RGB(A) without interlace: depth {depth}, colour {colour}")
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), 1 + width * bpp
    if len(raw) != height * stride:
        raise ValueError(f"{len(raw)} bytes of pixels for {width}x{height}")
    rows, above = [], bytes(width * bpp)
    for y in range(height):
        # each row is filtered against its left pixel and the row above (PNG spec, 9.2)
        kind, line = raw[y * stride], bytearray(raw[y * stride + 1 : (y + 1) * stride])
        if kind == 1:  # Sub
            for i in range(bpp, len(line)):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind == 2:  # Up
            line = bytearray((a + b) & 255 for a, b in zip(line, above, strict=True))
        elif kind == 3:  # Average
            for i in range(len(line)):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + above[i]) >> 1)) & 255
        elif kind == 4:  # Paeth
            for i in range(len(line)):
                a = line[i - bpp] if i >= bpp else 0
                b, c = above[i], above[i - bpp] if i >= bpp else 0
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        above = bytes(line)
        rows.append(above)
    return width, height, rows


def screenshot_problem(png: Path, size: tuple[int, int]) -> str:
    """What is wrong with a page's screenshot ('' when nothing): missing, wrong size, blank."""
    if not png.exists():
        return "no file written"
    try:
        width, height, rows = png_rows(png.read_bytes())
    except (ValueError, struct.error, zlib.error) as error:
        return f"unreadable: {error}"
    if (width, height) != size:
        return f"{width}x{height}, not {size[0]}x{size[1]}"
    # Text has hundreds of colours (antialiasing), an empty page one. The lower
    # half, below the header bar, where every page taken still has text.
    bpp = len(rows[0]) // width
    lower = rows[height // 2 :: 5]
    colours = {row[i : i + bpp] for row in lower for i in range(0, len(row), bpp)}
    return "" if len(colours) >= 32 else f"blank: {len(colours)} colours in its lower half"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def take_screenshots(site: Path, out: Path) -> None:
    """Photograph SCREENSHOTS of the built site into out with headless Chromium, and check them."""
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None:
        message = f"no headless Chromium ({' or '.join(BROWSERS[:2])}) for the screenshots"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            sys.exit(f"dev.py: {message}")
        print(f"dev.py: {message}; skipped (on Debian: apt-get install {BROWSERS[0]})")
        return
    pages = dict.fromkeys(f"{page}index.html" for _, page, _ in SCREENSHOTS)
    missing = [page for page in pages if not (site / page).exists()]
    if missing:
        sys.exit(f"dev.py: no {', '.join(missing)} in {site} to take a screenshot of")
    out.mkdir(parents=True, exist_ok=True)

    # served over HTTP: from file:// the search script fails to load, and hides the search box
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started, problems = time.monotonic(), []
    try:
        with tempfile.TemporaryDirectory(prefix="dev-chromium-") as profile:
            for name, page, (width, height) in SCREENSHOTS:
                png = out / f"{name}.png"
                png.unlink(missing_ok=True)  # never check an old picture
                command = [
                    browser,
                    "--headless",
                    # our own pages only; root (CI) and containers cannot run the sandbox
                    "--no-sandbox",
                    "--hide-scrollbars",
                    f"--user-data-dir={profile}",
                    # no network but this server: the same picture on- and offline, no
                    # waiting on Google Fonts (the system's fonts stand in for Roboto)
                    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                    f"--window-size={width},{height}",
                    f"--screenshot={png}",
                    f"http://127.0.0.1:{server.server_port}/{page}",
                ]
                try:
                    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
                    output = result.stdout + result.stderr
                except subprocess.TimeoutExpired:
                    output = f"{browser} took over 60 s"
                problem = screenshot_problem(png, (width, height))
                if problem:
                    problems.append(f"{png}: {problem}")
                    print(output, file=sys.stderr)
    finally:
        server.shutdown()
        server.server_close()
    if problems:
        sys.exit("dev.py: screenshots failed:\n  " + "\n  ".join(problems))
    seconds = time.monotonic() - started
    print(f"dev.py: {len(SCREENSHOTS)} screenshots checked, in {out} ({seconds:.1f} s)")


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
    parser.add_argument(
        "--hiredis",
        action="store_true",
        help="redis-tests: with hiredis installed (redis-py's C parser)",
    )
    parser.add_argument(
        "--screenshots",
        nargs="?",
        const=str(ROOT / "screenshots"),
        metavar="DIR",
        help="docs: then take screenshots of pages of the site with headless Chromium into DIR "
        "(default: screenshots/) and check they are there, of the size asked for and not blank",
    )
    options, rest = parser.parse_known_args()  # the rest goes to the command (pytest, ...)
    python = options.python or sys.executable
    redis_py = oldest_redis_py() if options.redis_py == "oldest" else options.redis_py
    venv_python = ensure_venv(
        python,
        GROUPS[options.command],
        dedicated=bool(options.python),
        redis_py=redis_py,
        hiredis=options.hiredis,
    )
    if options.command == "redis-tests":
        run(
            venv_python,
            "-c",
            "import redis, redis.utils as u; print('redis-py', redis.__version__, "
            "'with hiredis' if u.HIREDIS_AVAILABLE else 'without hiredis')",
        )
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
            if options.screenshots:
                parser.error("--screenshots takes a built site: not with --serve")
            rest.remove("--serve")
            run(venv_python, "-m", "mkdocs", "serve", "--strict", *rest)
        else:
            run(venv_python, "-m", "mkdocs", "build", "--strict", *rest)
            if options.screenshots:
                take_screenshots(ROOT / "site", Path(options.screenshots).resolve())
    else:
        run(venv_python, "-m", "ruff", "check", ".")
        run(venv_python, "-m", "ruff", "format", "--check", ".")
        run(venv_python, "-m", "mypy")
        run(venv_python, "-m", "pytest", *rest)


if __name__ == "__main__":
    main()
