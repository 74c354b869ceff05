"""A worker process for the multi-process tests.

``python tests/support/worker.py BACKEND COMMAND ...``

BACKEND is ``file:DIRECTORY``, ``redis:URL#NAMESPACE#LEASE`` or
``postgres:URL#NAMESPACE``. It reports on stdout, one line per event, and
waits for a line on stdin where a command says so, so the test drives it
step by step:

- ``hold KEY``: take KEY; print ``holding TOKEN``; wait for a stdin line;
  print ``lease-lost`` if the turn lost its lease meanwhile; release;
  print ``released``, or ``raised LeaseLost`` if the release raised it.
- ``increment KEY COUNTER N``: N read-modify-write increments of the
  integer in the file COUNTER, each under KEY; print ``done``.
- ``increment-redis KEY COUNTER N``: the same on the Redis key COUNTER, read
  and written with GET and SET by a client of its own.
- ``fork-hold KEY``: take KEY, fork a child that keeps every inherited file
  open and waits; print ``forked PID``; wait for a stdin line; release;
  print ``released``; wait for a stdin line; end the child.
- ``try KEY SECONDS``: take KEY with ``timeout=SECONDS``; print ``holding``
  and release at once, or print ``timeout``; then exit.
- ``try-cancel KEY``: start taking KEY in a task, cancel it after one pass
  of the event loop; print ``cancelled`` (or ``holding`` if it got the key
  that fast); then exit.
- ``latest-burst KEY LOG N``: N calls of KEY on a ``pending="latest"`` queue,
  each appending ``PID start I`` and ``PID end I`` to the file LOG; print
  ``queued`` once all wait, then ``answered`` and every call's answer.
- ``freeze-in-tidy KEY`` (file backend): take KEY and release it; the release
  tidies the line file, and this process stops itself (SIGSTOP) right after
  it takes the line file's exclusive lock; print ``released`` once it goes on.

Six commands run without an event loop of their own. One is a storm of signals:

- ``storm KEY TURNS SECONDS SPREAD``: the main thread takes TURNS sync turns
  on KEY (``with queue.keyed(KEY)``, no timeout) while another thread sends
  it SIGINT every 0 to SPREAD ms; the handler raises KeyboardInterrupt while a
  turn is being taken, once per turn, wherever it lands. It stops after
  SECONDS, done or not; print ``stormed TAKEN INTERRUPTED LONGEST`` (the
  turns taken, those interrupted, and the longest in seconds), then wait
  for a stdin line before exiting.

Two take turns from
threads with the file backend's blocking calls (acquire_sync, release_sync):

- ``hold-sync KEY``: as ``hold``, in the main thread, with no event loop.
- ``increment-sync KEY COUNTER N THREADS``: THREADS threads, each doing N
  increments of COUNTER under KEY; print ``done``.

One shares a queue between processes and threads (file backend):

- ``share KEY COUNTER N THREADS``: make a backend, fork a child that keeps
  it, and in both run THREADS threads, each doing N increments of COUNTER
  under KEY, each in an event loop and a queue of its own (``asyncio.run()``
  per increment) on that one backend; print ``done`` once every increment
  of both is done, or ``failed`` if one raised.

One forks after making the queue, as a preforking server does (Redis):

- ``fork-increment KEY COUNTER N CHILDREN WHEN``: make one queue; if WHEN
  is ``after``, use it once (``asyncio.run``) before forking; fork CHILDREN
  children, and each of them and this process run ``increment-redis`` N
  times, each in an event loop of its own; print ``done ERRORS`` with the
  errors any of them met (``-``: none).

The last is a fork server for crashes at every step (the file backend's
calls; with ``latest`` on Redis or PostgreSQL, the steps' ops: see :class:`OpTripwire`), so
that every child starts clean:

- ``crash-each KEY [compact] [impatient]``: for each stdin line ``N``, fork
  a child that takes KEY and releases it (printing ``holding`` and
  ``released``; with ``impatient``, it takes it with ``timeout=0``, and
  prints ``timeout`` if it is not free) but
  kills itself with SIGKILL just before the N-th call of the file backend
  that changes what other processes see (see :class:`Tripwire`); print
  ``forked PID`` before the child starts, then ``ended killed`` or
  ``ended exit CODE``. With ``compact``, the child's release compacts the
  line file whenever someone is left in line behind it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from inturn import KeyedQueue, LeaseLost


def make_backend(spec: str) -> Any:
    kind, _, where = spec.partition(":")
    if kind == "file":
        from inturn.backends.file import FileBackend

        return FileBackend(where)
    if kind == "redis":
        from inturn.backends.redis import RedisBackend

        url, namespace, lease = where.split("#")
        return RedisBackend.from_url(url, namespace=namespace, lease=float(lease))
    if kind == "postgres":
        from inturn.backends.postgres import PostgresBackend

        url, namespace = where.split("#")
        return PostgresBackend.from_url(url, namespace=namespace)
    raise SystemExit(f"unknown backend {spec!r}")


def read_counter(path: str) -> int:
    with open(path) as file:
        return int(file.read() or 0)


def write_counter(path: str, value: int) -> None:
    with open(path, "w") as file:
        file.write(str(value))


async def increment(counter: str) -> None:
    """Add one to the integer in the file counter: a lost update if two run at once."""
    value = read_counter(counter)
    await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
    write_counter(counter, value + 1)


def say(*words: object) -> None:
    print(*words, flush=True)


async def read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def read_line_unbuffered() -> str:
    """A stdin line, read a byte at a time: nothing is read ahead for a forked child to share."""
    line = b""
    while (byte := os.read(0, 1)) and byte != b"\n":
        line += byte
    return line.decode()


# -- faults at a chosen step of the file backend ---------------------------------------------

#: The calls of the file backend that change what another process can see
#: (files, their contents, open ends of tickets, locks): a crash between
#: two of them is a crash at any instruction, as far as other processes can tell.
STEPS = {
    "os": {"open", "close", "write", "pwrite", "ftruncate", "unlink", "mkfifo", "mkdir", "utime"},
    "fcntl": {"flock"},
}


class Tripwire:
    """Stands in for the os and fcntl modules inside the file backend's modules, in this process.

    Every call named in STEPS goes through :meth:`before` and :meth:`after`,
    which count it and may signal this process: SIGKILL just before call
    number ``kill_before``, SIGSTOP just after the first exclusive ``flock``
    that succeeded (``stop_on_exclusive``). The calls themselves are the real ones.
    """

    def __init__(self, kill_before: int = 0, stop_on_exclusive: bool = False) -> None:
        self.calls = 0
        self.kill_before = kill_before
        self.stop_on_exclusive = stop_on_exclusive

    def install(self, *modules: ModuleType) -> None:
        for module in modules:
            for name, watched in STEPS.items():
                if hasattr(module, name):  # (a module that makes no such call may not import it)
                    setattr(module, name, _Watched(getattr(module, name), watched, self))

    def before(self, name: str, args: tuple[Any, ...]) -> None:
        self.calls += 1
        if self.calls == self.kill_before:
            os.kill(os.getpid(), signal.SIGKILL)

    def after(self, name: str, args: tuple[Any, ...]) -> None:
        import fcntl

        if self.stop_on_exclusive and name == "flock" and args[1] & fcntl.LOCK_EX:
            self.stop_on_exclusive = False
            os.kill(os.getpid(), signal.SIGSTOP)


class _Watched:
    """A module whose functions in names report to a Tripwire around each call."""

    def __init__(self, module: Any, names: set[str], tripwire: Tripwire) -> None:
        self._module = module
        self._names = names
        self._tripwire = tripwire

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._module, name)
        if name not in self._names:
            return real
        tripwire = self._tripwire

        def call(*args: Any, **kwargs: Any) -> Any:
            tripwire.before(name, args)
            result = real(*args, **kwargs)
            tripwire.after(name, args)
            return result

        return call


class OpTripwire:
    """Counts the ops of the Redis or PostgreSQL backend's steps (a task's turn and release,
    in this process): SIGKILL just before the ``kill_before``-th count. Each op counts twice:
    before its driver performs it (its call not sent yet) and once its answer came (the
    server did it), before the steps see it: between two counts, this process tells the
    server nothing."""

    def __init__(self, kill_before: int) -> None:
        self.counts = 0
        self.kill_before = kill_before

    def install(self, spec: str) -> None:
        if spec.startswith("postgres:"):
            from inturn.backends.postgres._session import PgSession

            for name in ("_acquiring", "_ending", "_releasing"):
                made = getattr(PgSession, name)
                setattr(PgSession, name, lambda *args, made=made: self.watched(made(*args)))
            return
        from inturn.backends.redis import _loop

        for name in ("taking", "releasing"):
            made = getattr(_loop, name)
            setattr(_loop, name, lambda *args, made=made: self.watched(made(*args)))

    def tick(self) -> None:
        self.counts += 1
        if self.counts == self.kill_before:
            os.kill(os.getpid(), signal.SIGKILL)

    def watched(self, steps: Any) -> Any:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value
            self.tick()
            try:
                answer, error = (yield op), None
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as problem:
                answer, error = None, problem
            self.tick()


def file_modules() -> tuple[ModuleType, ...]:
    """The modules of the file backend that make the calls in STEPS."""
    from inturn.backends import file
    from inturn.backends.file import _fds, _line, _locks, _tidy

    return file, _fds, _line, _locks, _tidy


async def victim(spec: str, key: str, step: int, flags: list[str]) -> None:
    """Take key and release it, killed just before the step-th watched call.

    With the flag ``latest``, run a work on key as latest work shared across
    processes instead: ``holding`` as it runs, then ``released`` (it ran) or
    ``superseded`` (newer work of another process ran in its place).
    """
    if "latest" in flags:
        queue = KeyedQueue(backend=make_backend(spec), pending="latest", across="processes")
        if spec.startswith(("redis:", "postgres:")):
            OpTripwire(kill_before=step).install(spec)
        else:
            Tripwire(kill_before=step).install(*file_modules())

        def work() -> str:
            say("holding")
            return "ran"

        say("released" if await queue.run(key, work) == "ran" else "superseded")
        return
    queue = KeyedQueue(backend=make_backend(spec))
    if "compact" in flags:
        from inturn.backends.file import _tidy

        _tidy._COMPACT_AT = 0
    Tripwire(kill_before=step).install(*file_modules())
    try:
        async with queue.keyed(key, timeout=0 if "impatient" in flags else None):
            say("holding")
    except TimeoutError:
        say("timeout")
    else:
        say("released")


def crash_each(spec: str, key: str, flags: list[str]) -> None:
    """The fork server of ``crash-each`` (see the module docstring)."""
    while line := read_line_unbuffered():
        go_read, go_write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            os.close(go_write)
            os.read(go_read, 1)  # until the parent has said which pid it is
            code = 0
            try:
                asyncio.run(victim(spec, key, int(line), flags))
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(go_read)
        say("forked", child)
        os.write(go_write, b"g")
        os.close(go_write)
        _, status = os.waitpid(child, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            say("ended", "killed")
        else:
            say("ended", "exit", os.waitstatus_to_exitcode(status))


def share(spec: str, key: str, counter: str, n: int, threads: int) -> None:
    """The ``share`` command (see the module docstring)."""
    backend = make_backend(spec)
    failures: list[BaseException] = []

    def increments() -> None:
        try:
            for _ in range(n):
                # (a queue of its own per job: each thread is another member of the line)
                asyncio.run(KeyedQueue(backend=backend).run(key, increment, counter))
        except BaseException as error:
            failures.append(error)
            raise

    child = os.fork()
    runners = [threading.Thread(target=increments) for _ in range(threads)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    if child == 0:  # pragma: no cover - the child
        os._exit(1 if failures else 0)
    _, status = os.waitpid(child, 0)
    say("done" if not failures and os.waitstatus_to_exitcode(status) == 0 else "failed")


def hold_sync(spec: str, key: str) -> None:
    """The ``hold-sync`` command (see the module docstring)."""
    backend = make_backend(spec)
    grant = backend.acquire_sync(key, None)
    say("holding", grant.token)
    sys.stdin.readline()
    lost = grant.lost
    backend.release_sync(grant)
    if lost:
        say("lease-lost")
    say("released")


def increment_sync(spec: str, key: str, counter: str, n: int, threads: int) -> None:
    """The ``increment-sync`` command (see the module docstring)."""
    backend = make_backend(spec)

    def increments() -> None:
        for _ in range(n):
            grant = backend.acquire_sync(key, None)
            try:
                value = read_counter(counter)
                os.sched_yield()  # others run here: a lost update, were it not for the key
                write_counter(counter, value + 1)
            finally:
                backend.release_sync(grant)

    runners = [threading.Thread(target=increments) for _ in range(threads)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    say("done")


def storm(spec: str, key: str, turns: int, seconds: float, spread: float) -> None:
    """The ``storm`` command (see the module docstring)."""
    import random

    queue = KeyedQueue(backend=make_backend(spec))
    main = threading.get_ident()
    armed = [False]  # a turn is being taken: the next SIGINT raises there (once)
    stop = threading.Event()

    # Python 3.10 may report the handler's KeyboardInterrupt as the cause of a
    # SystemError ("returned a result with an exception set") when it lands as a
    # built-in call (os.fstat) returns: an interrupt all the same.
    def handler(signum: int, frame: object) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def interrupt() -> None:
        pause = random.Random()
        while not stop.wait(pause.uniform(0, spread / 1000)):
            signal.pthread_kill(main, signal.SIGINT)

    signal.signal(signal.SIGINT, handler)
    taken = interrupted = 0
    interrupter = threading.Thread(target=interrupt, daemon=True)
    interrupter.start()
    end = time.monotonic() + seconds
    longest = 0.0  # seconds: the longest turn, taken or interrupted
    while taken + interrupted < turns and time.monotonic() < end:
        began = time.monotonic()
        try:
            armed[0] = True
            with queue.keyed(key):
                armed[0] = False  # taken: its end is not under test
                taken += 1
        except KeyboardInterrupt:
            interrupted += 1
        except SystemError as error:  # (Python 3.10: see below)
            if not isinstance(error.__cause__, KeyboardInterrupt):
                raise
            interrupted += 1
        finally:
            armed[0] = False
        longest = max(longest, time.monotonic() - began)
    stop.set()
    interrupter.join()
    say("stormed", taken, interrupted, f"{longest:.3f}")
    sys.stdin.readline()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a last one may still be on its way)
    os._exit(0)


def run_command(command: str, args: tuple[str, ...], spec: str) -> Callable[[], None] | None:
    """The commands that run without an event loop of this process's own."""
    if command == "storm":
        key, turns, seconds, spread = args
        return lambda: storm(spec, key, int(turns), float(seconds), float(spread))
    if command == "hold-sync":
        (key,) = args
        return lambda: hold_sync(spec, key)
    if command == "increment-sync":
        key, counter, n, threads = args
        return lambda: increment_sync(spec, key, counter, int(n), int(threads))
    if command == "crash-each":
        key, *flags = args
        return lambda: crash_each(spec, key, flags)
    if command == "share":
        key, counter, n, threads = args
        return lambda: share(spec, key, counter, int(n), int(threads))
    if command == "fork-increment":
        key, counter, n, children, when = args
        return lambda: fork_increment(spec, key, counter, n, children, when)
    return None


async def main(spec: str, command: str, *args: str) -> None:
    queue = KeyedQueue(backend=make_backend(spec))
    if command == "hold":
        (key,) = args
        try:
            async with queue.keyed(key) as turn:
                say("holding", turn.token)
                await read_line()
                if turn.lease_lost:
                    say("lease-lost")
        except LeaseLost:
            say("raised", "LeaseLost")
        else:
            say("released")
    elif command == "increment":
        key, counter, n = args
        for _ in range(int(n)):
            await queue.run(key, increment, counter)
        say("done")
    elif command == "increment-redis":
        import redis.asyncio as aioredis

        key, counter, n = args
        url = spec.split(":", 1)[1].split("#")[0]
        client = aioredis.Redis.from_url(url)

        async def increment_redis() -> None:
            value = int(await client.get(counter) or 0)
            await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
            await client.set(counter, value + 1)

        for _ in range(int(n)):
            await queue.run(key, increment_redis)
        await client.aclose()
        say("done")
    elif command == "fork-hold":
        (key,) = args
        async with queue.keyed(key):
            reader, writer = os.pipe()
            child = os.fork()
            if child == 0:  # pragma: no cover - the child
                os.close(writer)
                os.read(reader, 1)  # until the parent goes
                os._exit(0)
            os.close(reader)
            say("forked", child)
            await read_line()
        say("released")
        await read_line()
        os.kill(child, signal.SIGTERM)
        await asyncio.get_running_loop().run_in_executor(None, os.waitpid, child, 0)
    elif command == "try":
        key, seconds = args
        try:
            async with queue.keyed(key, timeout=float(seconds)):
                say("holding")
        except TimeoutError:
            say("timeout")
    elif command == "try-cancel":
        (key,) = args

        async def take() -> None:
            async with queue.keyed(key):
                say("holding")

        task = asyncio.create_task(take())
        await asyncio.sleep(0)  # one pass: the task is waiting, wherever it waits
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            say("cancelled")
    elif command == "latest-burst":
        key, log, n = args
        await latest_burst(spec, key, log, int(n))
    elif command == "freeze-in-tidy":
        (key,) = args
        async with queue.keyed(key):
            say("holding")
            Tripwire(stop_on_exclusive=True).install(*file_modules())
        say("released")
    else:
        raise SystemExit(f"unknown command {command!r}")
    await queue.aclose()


def append(log: str, line: str) -> None:
    """Append one line to the file log (O_APPEND: each write lands whole)."""
    with open(log, "a") as file:
        file.write(line + "\n")


async def latest_burst(spec: str, key: str, log: str, n: int) -> None:
    """``latest-burst``: N calls of KEY on a ``pending="latest"`` queue, each logging its run."""
    queue = KeyedQueue(backend=make_backend(spec), pending="latest")

    async def work(i: int) -> int:
        append(log, f"{os.getpid()} start {i}")
        await asyncio.sleep(0.001)
        append(log, f"{os.getpid()} end {i}")
        return i

    calls = [asyncio.create_task(queue.run(key, work, i)) for i in range(n)]
    for _ in range(10 * n):  # the first waits at the backend, the rest behind it
        if queue.pending(key) == n - 1:
            break
        await asyncio.sleep(0)
    else:
        raise SystemExit(f"the burst never queued: {queue!r}")
    say("queued")
    answers = await asyncio.gather(*calls)
    say("answered", *answers)
    await queue.aclose()


def fork_increment(spec: str, key: str, counter: str, n: str, children: str, when: str) -> None:
    """``fork-increment``: the queue is made before fork(), as ``gunicorn --preload`` does."""
    import redis

    queue = KeyedQueue(backend=make_backend(spec))
    url = spec.split(":", 1)[1].split("#")[0]
    if when == "after":
        asyncio.run(queue.run(f"{key}-warm-up", lambda: None))

    async def increments() -> None:
        client = redis.asyncio.Redis.from_url(url)

        async def increment() -> None:
            value = int(await client.get(counter) or 0)
            await asyncio.sleep(0)  # others run here: a lost update, were it not for the key
            await client.set(counter, value + 1)

        try:
            for _ in range(int(n)):
                await queue.run(key, increment)
        finally:
            await client.aclose()

    def work() -> str:
        try:
            asyncio.run(increments())
        except BaseException as error:
            return f"{type(error).__name__}:{error}".replace(" ", "_")
        return ""

    pids = []
    errors: list[str] = []
    for _ in range(int(children)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            problem = work()
            if problem:
                print(problem, file=sys.stderr, flush=True)
            os._exit(1 if problem else 0)
        pids.append(pid)
    if problem := work():
        errors.append(problem)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            errors.append(f"child-{pid}-failed")
    say("done", " ".join(errors) or "-")


if __name__ == "__main__":
    spec, command, *rest = sys.argv[1:]
    server = run_command(command, tuple(rest), spec)
    if server is not None:
        server()
    else:
        asyncio.run(main(spec, command, *rest))
