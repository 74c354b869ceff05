"""Real deployments: gunicorn serving Flask and Django apps with inturn, no mocks.

Each test starts gunicorn (``python -m gunicorn``) on a free loopback port
with an app from ``tests/deploy/``, whose views add one to a SQLite row's
counter by a read-modify-write that SQLite does not serialize (see
``deploy/counters.py``). It then fires REQUESTS requests from CLIENTS
threads at once, spread over ROWS rows, and reads the counters back.

- With a shared backend (file, Redis), every row's counter must equal the
  requests made for it: no update lost, whether the workers are processes
  (sync), processes of threads (gthread), forked from a master that made
  the queue (``--preload``), and whichever way a view takes its turn
  (decorator, ``keyed()``, ``run_sync``, ``asyncio.run(q.run(...))``).
- Without inturn, or with the in-process queue alone, updates across
  workers must get lost: the race these tests guard against is real.

The ``deploy`` marker selects them (``-m deploy``, or ``-m "not deploy"``).
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import inturn

from support.helpers import PATIENCE
from support.servers import free_port

DEPLOY = Path(__file__).with_name("deploy")
FLASK = "flask_app:app"
DJANGO = "django_app:application"
ROWS = 4
REQUESTS = 400
CLIENTS = 32
#: Rounds a baseline fires at most to see an update lost
#: (see test_updates_get_lost_without_a_shared_backend).
BASELINE_ROUNDS = 3
#: Seconds gunicorn has to stop after SIGTERM before it (and its workers) get SIGKILL.
STOP_PATIENCE = 10.0

SYNC = ("--worker-class", "sync", "--workers", "4")
GTHREAD = ("--worker-class", "gthread", "--workers", "4", "--threads", "4")
PRELOAD = (*GTHREAD, "--preload")
#: The ways a Flask view takes its row's turn (flask_app.py): every row gets
#: each in turn, so they share its line. "async" runs an event loop per
#: request (asyncio.run), several at once in the threads of a gthread worker.
WAYS = ("decorated", "keyed", "run_sync", "async")

_missing = [name for name in ("gunicorn", "flask") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.deploy,
    pytest.mark.skipif(bool(_missing), reason=f"not installed: {', '.join(_missing)}"),
]


class Gunicorn:
    """One gunicorn master and its workers, serving an app of tests/deploy on a loopback port."""

    def __init__(
        self, directory: Path, app: str, options: Sequence[str], env: dict[str, str]
    ) -> None:
        self.directory = directory
        self.app = app
        self.options = tuple(options)
        self.workers = int(options[options.index("--workers") + 1])
        self.ready = directory / "ready"  # a file per worker that has loaded the app
        self.env = {
            **os.environ,
            # the inturn under test, whether installed or on PYTHONPATH
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(inturn.__file__).parents[1]), os.environ.get("PYTHONPATH")])
            ),
            "INTURN_DEPLOY_READY": str(self.ready),
            **env,
        }
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "gunicorn.log"

    def start(self) -> Gunicorn:
        """Start gunicorn; return once every worker has loaded the app and it answers."""
        for _ in range(3):
            if self._launch():
                return self
            if "Address already in use" not in self.log():
                break
            self.stop()  # the port was taken meanwhile: another one
        raise AssertionError(f"gunicorn did not start:\n{self.log()}")

    def _launch(self) -> bool:
        self.stop()
        self.ready.mkdir(parents=True, exist_ok=True)
        for stale in self.ready.iterdir():
            stale.unlink()
        self.port = free_port()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gunicorn",
                    "--config",
                    str(DEPLOY / "gunicorn_conf.py"),
                    "--pythonpath",
                    str(DEPLOY),
                    "--bind",
                    f"127.0.0.1:{self.port}",
                    *self.options,
                    self.app,
                ],
                cwd=self.directory,  # for whatever gunicorn may leave behind
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # its own process group: see stop()
            )
        deadline = time.monotonic() + PATIENCE
        # The workers' start-up, not an ordering: each reports once it has loaded the app.
        while len(list(self.ready.iterdir())) < self.workers or not self._answers():
            if self.process.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise AssertionError(f"gunicorn did not come up in {PATIENCE} s:\n{self.log()}")
            time.sleep(0.02)
        return True

    def _answers(self) -> bool:
        try:
            return self.get("/health") == b"ok"
        except OSError:
            return False

    def get(self, path: str) -> bytes:
        """GET path on a connection of its own; the body (AssertionError unless 200)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=PATIENCE)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        if response.status != 200:
            raise AssertionError(f"GET {path}: {response.status} {body[:2000]!r}")
        return body

    def fire(self, paths: Sequence[str]) -> list[dict[str, Any]]:
        """GET every path, CLIENTS at a time; the JSON answers, in the order of paths."""
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                return [json.loads(body) for body in pool.map(self.get, paths)]
        except (OSError, AssertionError) as error:
            raise AssertionError(f"{error}\ngunicorn's log:\n{self.log()}") from error

    def log(self) -> str:
        """What gunicorn and its workers wrote (stdout and stderr), the last 20,000 characters."""
        try:
            return self.log_path.read_text(errors="replace")[-20_000:]
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """SIGTERM (a graceful stop); SIGKILL to the whole process group after STOP_PATIENCE."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_PATIENCE)
            except subprocess.TimeoutExpired:
                pass
        try:
            # the master's group is its workers' too (start_new_session): none outlives it
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(PATIENCE)


Serve = Callable[..., Gunicorn]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Start gunicorn: ``serve(app, options, **env)``; every server is stopped at the end."""
    started: list[Gunicorn] = []

    def start(app: str, options: Sequence[str], **env: str) -> Gunicorn:
        server = Gunicorn(tmp_path / f"gunicorn-{len(started)}", app, options, env)
        server.directory.mkdir()
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def database(tmp_path: Path) -> Path:
    """A SQLite database in WAL mode with ROWS counters at 0 (ids 1 to ROWS)."""
    path = tmp_path / "counters.db"
    with _connect(path) as db:
        db.execute("PRAGMA journal_mode = WAL")  # kept by the file: every connection uses it
        db.execute("CREATE TABLE counters (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
        db.executemany("INSERT INTO counters VALUES (?, 0)", [(i,) for i in range(1, ROWS + 1)])
    return path


class _connect:
    """A connection in autocommit mode, closed on exit (sqlite3's own only ends a transaction)."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, timeout=PATIENCE, isolation_level=None)

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, *exc: object) -> None:
        self.db.close()


def counters(database: Path) -> dict[int, int]:
    with _connect(database) as db:
        return dict(db.execute("SELECT id, n FROM counters ORDER BY id").fetchall())


def reset(database: Path) -> None:
    with _connect(database) as db:
        db.execute("UPDATE counters SET n = 0")


def rows_of(n: int) -> list[int]:
    """The row of each of n requests: round robin over the rows."""
    return [1 + i % ROWS for i in range(n)]


def paths_for(app: str) -> list[str]:
    """REQUESTS paths over the rows; with Flask, every row gets each of WAYS in turn."""
    rows = rows_of(REQUESTS)
    if app == DJANGO:
        return [f"/bump/{row}" for row in rows]
    return [f"/bump/{WAYS[(i // ROWS) % len(WAYS)]}/{row}" for i, row in enumerate(rows)]


def needs_django(app: str) -> None:
    if app == DJANGO and importlib.util.find_spec("django") is None:
        pytest.skip("not installed: django")


def expected_counts() -> dict[int, int]:
    """Each row's count once every request was served: the requests made for it."""
    rows = rows_of(REQUESTS)
    return {row: rows.count(row) for row in range(1, ROWS + 1)}


def check_none_lost(server: Gunicorn, database: Path, answers: list[dict[str, Any]]) -> None:
    """Each row counted every request made for it, and each request read a different value."""
    got, expected = counters(database), expected_counts()
    assert got == expected, (
        f"lost updates: counters {got}, requests {expected}\ngunicorn's log:\n{server.log()}"
    )
    for row, mine in by_row(answers).items():
        reads = sorted(answer["read"] for answer in mine)
        assert reads == list(range(expected[row])), f"row {row}: reads {reads}"


def check_fenced(answers: list[dict[str, Any]]) -> None:
    """Each row's turns carry fencing tokens that grow in the order the turns were taken."""
    for row, mine in by_row(answers).items():
        tokens = [answer["token"] for answer in sorted(mine, key=lambda answer: answer["read"])]
        assert None not in tokens, f"row {row}: a turn on a shared backend with no token"
        assert tokens == sorted(set(tokens)), f"row {row}: tokens in turn order {tokens}"


def by_row(answers: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """The answers to the requests for each row."""
    mine: dict[int, list[dict[str, Any]]] = {}
    for answer, row in zip(answers, rows_of(REQUESTS), strict=True):
        mine.setdefault(row, []).append(answer)
    return mine


def check_raced(answers: list[dict[str, Any]], by: str) -> None:
    """More than one worker process ("pid") or thread ("thread") served the requests."""
    servers = {answer[by] for answer in answers}
    assert len(servers) > 1, f"one {by} served every request ({servers}): nothing raced"


def check_made_in(server: Gunicorn, answers: list[dict[str, Any]]) -> None:
    """Under --preload the queue was made in the master, else in each worker."""
    assert server.process is not None
    for answer in answers:
        if "--preload" in server.options:
            assert answer["made_in"] == server.process.pid != answer["pid"]
        else:
            assert answer["made_in"] == answer["pid"]


CONFIGURATIONS = {"sync": SYNC, "gthread": GTHREAD, "gthread-preload": PRELOAD}


@pytest.fixture(params=["file", "redis"])
def backend_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The app's environment for a queue on a shared backend: a directory, or Redis."""
    if request.param == "file":
        return {"INTURN_DEPLOY_BACKEND": "file", "INTURN_DEPLOY_DIRECTORY": str(tmp_path / "lines")}
    return {
        "INTURN_DEPLOY_BACKEND": "redis",
        "INTURN_DEPLOY_REDIS_URL": request.getfixturevalue("redis_url"),
        "INTURN_DEPLOY_NAMESPACE": request.getfixturevalue("namespace"),
    }


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
def test_no_update_lost_on_a_shared_backend(
    serve: Serve, database: Path, backend_env: dict[str, str], configuration: str
) -> None:
    server = serve(
        FLASK,
        CONFIGURATIONS[configuration],
        INTURN_DEPLOY_DB=str(database),
        **backend_env,
    )
    answers = server.fire(paths_for(FLASK))
    check_none_lost(server, database, answers)
    check_fenced(answers)
    check_raced(answers, "pid")
    check_made_in(server, answers)


def test_the_in_process_queue_guards_the_threads_of_one_worker(
    serve: Serve, database: Path
) -> None:
    """One gthread worker of 16 threads: inturn.default_queue alone loses nothing."""
    options = ("--worker-class", "gthread", "--workers", "1", "--threads", "16")
    server = serve(FLASK, options, INTURN_DEPLOY_DB=str(database), INTURN_DEPLOY_BACKEND="local")
    answers = server.fire(paths_for(FLASK))
    check_none_lost(server, database, answers)
    check_raced(answers, "thread")


@pytest.mark.parametrize(
    ("app", "backend"),
    [(FLASK, "none"), (FLASK, "local"), (DJANGO, "none")],
    ids=["flask-none", "flask-local", "django-none"],
)
def test_updates_get_lost_without_a_shared_backend(
    serve: Serve, database: Path, app: str, backend: str
) -> None:
    """The baseline: without inturn (none), or with a queue per worker (local), updates get lost.

    It shows the race is real, so that the tests above can fail. A lost
    update needs two requests for one row to interleave their read and
    write in different workers, which the kernel's scheduler decides, not
    the test: a round could (rarely) happen to lose none. So the test fires
    up to BASELINE_ROUNDS rounds and stops at the first that loses an
    update; it fails only if none does, which means the setup serializes
    the requests (one worker, a lock in SQLite), not bad luck. (Here, a
    round of REQUESTS typically loses half of them.)
    """
    needs_django(app)
    server = serve(app, GTHREAD, INTURN_DEPLOY_DB=str(database), INTURN_DEPLOY_BACKEND=backend)
    seen: list[int] = []  # updates lost in each round
    for _ in range(BASELINE_ROUNDS):
        reset(database)
        server.fire(paths_for(app))
        lost = REQUESTS - sum(counters(database).values())
        seen.append(lost)
        if lost:
            break
    assert seen[-1] > 0, f"no update lost in {len(seen)} rounds\ngunicorn's log:\n{server.log()}"


def test_django_view_loses_no_update_on_the_file_backend(
    serve: Serve, database: Path, tmp_path: Path
) -> None:
    needs_django(DJANGO)
    server = serve(
        DJANGO,
        GTHREAD,
        INTURN_DEPLOY_DB=str(database),
        INTURN_DEPLOY_BACKEND="file",
        INTURN_DEPLOY_DIRECTORY=str(tmp_path / "lines"),
    )
    answers = server.fire(paths_for(DJANGO))
    check_none_lost(server, database, answers)
    check_fenced(answers)
    check_raced(answers, "pid")
    check_made_in(server, answers)


# gunicorn's worker timeout: an arbiter that finds a worker silent for --timeout
# seconds sends it SIGABRT, and the worker raises SystemExit wherever it is.
TIMEOUT = ("--worker-class", "sync", "--workers", "2", "--timeout", "2")


def _queue_of(backend_env: dict[str, str]) -> inturn.KeyedQueue:
    """A queue of the test process itself on the app's backend: another member of its lines."""
    if backend_env["INTURN_DEPLOY_BACKEND"] == "file":
        from inturn.backends.file import FileBackend

        return inturn.KeyedQueue(backend=FileBackend(backend_env["INTURN_DEPLOY_DIRECTORY"]))
    from inturn.backends.redis import RedisBackend

    backend = RedisBackend.from_url(
        backend_env["INTURN_DEPLOY_REDIS_URL"], namespace=backend_env["INTURN_DEPLOY_NAMESPACE"]
    )
    return inturn.KeyedQueue(backend=backend)


def _aborted(server: Gunicorn, path: str) -> None:
    """GET path, which must fail: gunicorn aborts the worker serving it.

    (The worker answers 500 on its way out: gunicorn handles the SystemExit
    as a request's error, then exits; or the connection just closes.)
    """
    with pytest.raises((OSError, http.client.HTTPException, AssertionError)) as failed:
        server.get(path)
    if isinstance(failed.value, AssertionError):  # (not served: answered 500)
        assert f"GET {path}: 500" in str(failed.value)


def test_a_waiting_worker_that_gunicorn_aborts_never_runs_its_work(
    serve: Serve, database: Path, backend_env: dict[str, str]
) -> None:
    server = serve(
        FLASK, TIMEOUT, INTURN_DEPLOY_DB=str(database), INTURN_DEPLOY_LEASE="1", **backend_env
    )
    queue = _queue_of(backend_env)
    try:
        with queue.keyed("row-1"):  # this process holds the row past the worker's timeout
            _aborted(server, "/bump/keyed/1")
        # The aborted worker's place is gone (its process is), and its work never ran.
        answer = json.loads(server.get("/bump/keyed/1"))
        assert answer["read"] == 0
        assert counters(database)[1] == 1
    finally:
        asyncio.run(queue.backend.aclose())  # type: ignore[union-attr]
    assert "WORKER TIMEOUT" in server.log()


def test_a_holding_worker_that_gunicorn_aborts_frees_its_turn(
    serve: Serve, database: Path, backend_env: dict[str, str], tmp_path: Path
) -> None:
    held = tmp_path / "held"
    server = serve(
        FLASK,
        TIMEOUT,
        INTURN_DEPLOY_DB=str(database),
        INTURN_DEPLOY_LEASE="1",
        INTURN_DEPLOY_HELD=str(held),
        **backend_env,
    )
    queue = _queue_of(backend_env)
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(_aborted, server, "/hold/1")
            deadline = time.monotonic() + PATIENCE
            while not held.exists():  # the worker's turn began (it touched the file in it)
                assert time.monotonic() < deadline, f"never held:\n{server.log()}"
                time.sleep(0.01)
            # Its SystemExit ends the block (file: the kernel closes its ticket besides;
            # Redis: its release, or its lease running out once its process is gone).
            assert queue.run_sync("row-1", lambda: "after") == "after"
            stuck.result(PATIENCE)
    finally:
        asyncio.run(queue.backend.aclose())  # type: ignore[union-attr]
    assert "WORKER TIMEOUT" in server.log()
