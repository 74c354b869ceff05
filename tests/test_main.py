"""python -m inturn: the demo, and inspect for the Redis and the file backends (PostgreSQL:
test_postgres_lines.py)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import inturn
from inturn import KeyedQueue
from inturn.__main__ import format_lines, main, show_key
from inturn.backends import HolderInfo, LineInfo, WaiterInfo
from inturn.backends.file import FileBackend

from support.file_checks import spec
from support.helpers import PATIENCE, holding
from support.processes import Worker, until
from support.servers import free_port


def test_demo_loses_updates_without_inturn_and_none_with_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "inturn", "demo", "--tasks", "300", "--keys", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lost = dict(re.findall(r"(without|with) inturn\s*:.*?(\d+) updates lost", result.stdout))
    assert int(lost["without"]) > 0
    assert int(lost["with"]) == 0
    assert re.search(r"in\s+[\d.]+ ms", result.stdout)


def test_demo_rejects_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--tasks", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"inturn {inturn.__version__}"
    assert inturn.__version__ != "0+unknown"  # (installed: its metadata says which)


def test_demo_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tasks", "50", "--keys", "1"]) == 0
    assert "0 updates lost" in capsys.readouterr().out


# -- inspect -------------------------------------------------------------------------------


async def test_inspect_shows_a_redis_key_as_the_user_gave_it(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from inturn.backends.redis import RedisBackend

    namespace = f"t-{uuid.uuid4().hex[:12]}"
    backend = RedisBackend.from_url(redis_url, namespace=namespace)
    try:
        async with KeyedQueue(backend=backend).keyed("hot"):
            await asyncio.get_running_loop().run_in_executor(
                None, main, ["inspect", "--redis", redis_url, "--namespace", namespace]
            )
    finally:
        await backend.aclose()
    out = capsys.readouterr().out
    assert "\n  'hot'\n" in out
    assert "s:hot" not in out


async def test_inspect_shows_redis_keys_of_every_kind(redis_url: str) -> None:
    from inturn.backends.redis import RedisBackend

    backend = RedisBackend.from_url(redis_url, namespace=f"t-{uuid.uuid4().hex[:12]}")
    try:
        async with KeyedQueue(backend=backend).keyed("1", b"1", 1, b"\xff\xfe"):
            lines = await backend.lines()
    finally:
        await backend.aclose()
    # every kind, and bytes that are not UTF-8, come back as they were given
    assert {line.key for line in lines} == {"1", b"1", 1, b"\xff\xfe"}
    assert len(lines) == 4


async def test_inspect_shows_a_directorys_lines_to_another_process(
    directory: Path, workers: list[Worker]
) -> None:
    backend = FileBackend(directory)
    holder = await Worker.start(spec(directory), "hold", "order-17", name="holder")
    workers.append(holder)
    await holder.expect("holding")
    waiters: list[Worker] = []
    for name in ("w0", "w1"):
        waiters.append(await Worker.start(spec(directory), "hold", "order-17", name=name))
        workers.append(waiters[-1])
        queued = len(waiters) + 1
        await until(lambda n=queued: len(backend.line("order-17")) == n, f"{name} queued")
    out = inspect(["--dir", str(directory)])
    assert out.startswith(f"directory {str(directory)!r}: 1 active line\n  'order-17'\n")
    assert re.search(rf"\n    held by pid {holder.pid} for \d+\.\d s\n", out)
    assert re.search(rf"\n    1\. pid {waiters[0].pid} waiting \d+\.\d s\n", out)
    assert re.search(rf"\n    2\. pid {waiters[1].pid} waiting \d+\.\d s\n", out)
    await holder.release()
    for worker in waiters:
        await worker.expect("holding")
        await worker.release()
    assert inspect(["--dir", str(directory)]) == f"directory {str(directory)!r}: no active lines\n"


def inspect(arguments: list[str]) -> str:
    """What ``python -m inturn inspect ARGUMENTS`` prints, run in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-m", "inturn", "inspect", *arguments],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_inspect_watch_refreshes_until_interrupted(directory: Path) -> None:
    backend = FileBackend(directory)
    async with KeyedQueue(backend=backend).keyed(b"hot"):
        command = ["-m", "inturn", "inspect", "--dir", str(directory), "--watch", "0.01"]
        watcher = await asyncio.create_subprocess_exec(
            sys.executable,
            *command,
            stdout=asyncio.subprocess.PIPE,
            # as a terminal's ^C does, whatever this test's own process ignores
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert watcher.stdout is not None
        seen = 0
        while seen < 3:  # three reports: it refreshes
            line = await asyncio.wait_for(watcher.stdout.readline(), PATIENCE)
            assert line, "inspect --watch ended by itself"
            seen += line.decode().strip() == "b'hot'"
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watcher.wait(), PATIENCE) == 0


async def test_lines_show_every_key_as_the_user_gave_it(directory: Path) -> None:
    backend = FileBackend(directory)
    keys = ("1", b"1", 1, 10**5000, -7, "é\0/\n", b"\xff" * 200)
    async with KeyedQueue(backend=backend).keyed(*keys):
        lines = await backend.lines()
    assert [line.key for line in lines] == list(backend.order(keys))
    for line in lines:
        assert line.holder is not None
        assert (line.holder.host, line.holder.pid) == (None, os.getpid())
        assert (line.holder.token, line.holder.lease_left) == (None, None)
        assert line.waiters == ()
    shown = format_lines(lines, "here").split("\n")
    assert shown[0] == "here: 7 active lines"
    keys_shown = [text[2:] for text in shown if text.startswith("  ") and text[2] != " "]
    # in the order of their portable names: bytes, then int, then str
    assert keys_shown[0] == "b'1'"
    assert keys_shown[1].startswith("b'\\xff\\xff")
    assert keys_shown[1].endswith("…")
    assert keys_shown[2:4] == ["-7", "1"]
    assert keys_shown[4].startswith("0x31e2")
    assert keys_shown[4].endswith("…")
    assert keys_shown[5:] == ["'1'", "'é\\x00/\\n'"]
    assert all(len(text) <= 120 for text in keys_shown)
    assert await backend.lines() == []


def test_format_lines_shows_what_each_backend_knows() -> None:
    lines = [
        LineInfo("a", HolderInfo("web-1", 10, 1.25, 77, 9.5), (WaiterInfo("web-2", 11, 0.5, 8.0),)),
        LineInfo(b"b", None, (WaiterInfo(None, 12, 2.0),)),
        # PostgreSQL: the server's pid too, and a client it could not record
        LineInfo(
            7, HolderInfo(None, 0, 3.0, server_pid=812), (WaiterInfo("db", 13, 1.0, None, 9),)
        ),
    ]
    assert format_lines(lines, "namespace 'ns'") == (
        "namespace 'ns': 3 active lines\n"
        "  'a'\n"
        "    held by web-1 pid 10 for 1.2 s, token 77, lease 9.5 s left\n"
        "    1. web-2 pid 11 waiting 0.5 s, lease 8.0 s left\n"
        "  b'b'\n"
        "    held by nobody (being handed over)\n"
        "    1. pid 12 waiting 2.0 s\n"
        "  7\n"
        "    held by pid ? (server pid 812) for 3.0 s\n"
        "    1. db pid 13 (server pid 9) waiting 1.0 s"
    )
    assert format_lines([], "directory '/x'") == "directory '/x': no active lines"
    assert show_key("1") == "'1'"
    assert show_key(b"1") == "b'1'"
    assert show_key(1) == "1"
    assert show_key(-(10**5000)).startswith("-0x")


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        ([], "one of the arguments --redis --postgres --dir is required"),
        (["--redis", "redis://x", "--dir", "/x"], "not allowed with argument"),
        (["--dir", "/x", "--namespace", "n"], "--namespace goes with --redis or --postgres"),
    ],
)
def test_inspect_takes_one_place(
    arguments: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", *arguments])
    assert complaint in capsys.readouterr().err


def test_inspect_of_a_missing_directory_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--dir", str(tmp_path / "nowhere")])
    assert exit.value.code == 1
    assert "there is no directory" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


def test_inspect_of_a_url_without_a_scheme_says_how_to_write_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--redis", "localhost:6379"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert "redis://localhost:6379" in err
    assert "Traceback" not in err


def test_inspect_of_a_url_with_another_scheme_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--redis", "http://localhost:6379/0"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("inturn: 'http' is not a Redis URL's scheme")
    assert "redis://host:6379/0" in err
    assert err.count("\n") == 1


class _LingeringHTTP(http.server.BaseHTTPRequestHandler):
    """Answers as an HTTP/1.x server does (a status line), and reads all the client
    sends before it closes (nginx's lingering close), so that the answer arrives."""

    default_request_version = "HTTP/1.1"

    def finish(self) -> None:
        super().finish()
        self.request.settimeout(PATIENCE)
        with contextlib.suppress(OSError):
            while self.request.recv(65536):
                pass

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    """The port of an HTTP server, on this host."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LingeringHTTP)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        serving.join(PATIENCE)


def test_inspect_of_a_port_that_answers_http_says_it_is_not_redis(
    http_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--redis", f"redis://127.0.0.1:{http_port}/0"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("inturn: what answered is not a Redis server"), err
    assert "HTTP/1.0 400" in err  # (what it answered)
    assert "check the URL's host and port" in err
    assert "redis://host:6379/0" in err
    assert err.count("\n") == 1


def test_inspect_of_a_port_nobody_listens_on_says_redis_could_not_be_reached(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()  # (nobody listens on it)
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--redis", f"redis://127.0.0.1:{port}/0"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("inturn: Redis could not be reached ("), err
    assert f"127.0.0.1:{port}" in err
    assert err.count("\n") == 1


def test_inspect_without_redis_py_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [name for name in sys.modules if name == "redis" or name.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "inturn.backends.redis", raising=False)
    monkeypatch.setitem(sys.modules, "redis", None)  # (as if it were not installed)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--redis", "redis://localhost:6379"])
    assert exit.value.code == 1
    assert "pip install 'inturn[redis]'" in capsys.readouterr().err


def test_inspect_json_lists_each_line_for_scripts(
    directory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = KeyedQueue(backend=FileBackend(directory))
    with holding(queue, "k"):
        assert main(["inspect", "--dir", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["where"].startswith("directory ")
    [line] = report["lines"]
    assert line["key"] == "'k'"
    assert line["holder"]["pid"] == os.getpid()
    assert line["waiters"] == []


def test_inspect_of_an_empty_namespace_names_those_with_lines(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from inturn.backends.redis import RedisBackend

    namespace = f"shop-{uuid.uuid4().hex[:8]}"
    queue = KeyedQueue(backend=RedisBackend.from_url(redis_url, namespace=namespace))
    try:
        with holding(queue, "k"):
            assert main(["inspect", "--redis", redis_url, "--namespace", "shpo"]) == 0
            text = capsys.readouterr().out
            assert main(["inspect", "--redis", redis_url, "--namespace", "shpo", "--json"]) == 0
            report = json.loads(capsys.readouterr().out)
    finally:
        asyncio.run(queue.backend.aclose())  # type: ignore[union-attr]
    assert text.startswith("namespace 'shpo': no active lines; namespaces with lines: ")
    assert repr(namespace) in text
    assert namespace in report["namespaces_with_lines"]
    assert report["lines"] == []


def test_the_operations_page_has_a_row_for_every_inspect_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out)) - {"--help"}
    assert {"--redis", "--postgres", "--dir", "--namespace"} <= options  # (read as meant)
    page = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(--[a-z-]+)", page, re.MULTILINE))
    assert rows == options


async def test_inspect_shows_when_the_latest_work_waiting_was_called(directory: Path) -> None:
    """A process's latest work waiting in a line shared across processes is shown as such."""
    holder = KeyedQueue(backend=FileBackend(directory))
    latest = KeyedQueue(backend=FileBackend(directory), pending="latest", across="processes")
    held, go_on = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        held.set()
        await go_on.wait()

    holding = asyncio.create_task(holder.run("order-17", hold))
    await held.wait()
    waiting = asyncio.create_task(latest.run("order-17", asyncio.sleep, 0, "synced"))
    await until(lambda: len(FileBackend(directory).line("order-17")) == 2, "the latest waits")
    out = await asyncio.to_thread(inspect, ["--dir", str(directory)])
    assert re.search(rf"\n    held by pid {os.getpid()} for \d+\.\d s\n", out)  # (not latest)
    assert re.search(
        rf"\n    1\. pid {os.getpid()} waiting \d+\.\d s, latest work called \d+\.\d s ago\n", out
    )
    go_on.set()
    assert await waiting == "synced"
    await holding
