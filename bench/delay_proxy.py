"""A TCP proxy that delays each direction: a network round trip, on loopback.

    python -m bench.delay_proxy --upstream 127.0.0.1:6379 --rtt-ms 0.25 [--port 0]

prints ``listening 127.0.0.1:PORT`` and forwards every connection made to
that port to the upstream, each chunk written ``rtt / 2`` after it was read,
in both directions. It stands in for ``tc qdisc ... netem delay``, where the
kernel has no ``sch_netem``.

- A chunk read at t is written at t + delay: the delay is not added to that
  of the chunks before it, so a pipelined stream does not pile delays up;
  each direction keeps its order (a FIFO per direction, one timer for its
  head).
- TCP_NODELAY on both sockets (asyncio sets it too).
- When either side closes, the other is closed once what was read before
  the close has been written (after the same delay).
- No busy loop: the event loop sleeps in ``select(2)``, whose timeout has
  microsecond resolution (``epoll_wait``'s is a millisecond, and Python rounds
  a sub-millisecond wait up to one); the process's timer slack is set to
  1 ns where Linux allows, so a wake-up overshoots by tens of µs, not 50 µs
  more. Fewer than 1024 descriptors: plenty for a benchmark.

Its own processing (two more hops through the kernel, a pass of the loop)
adds to the round trip, and so does the wake-up's overshoot.
:func:`delayed` runs the proxy in a process of its own and calibrates it
against a Redis upstream: it measures ``PING`` (redis-py, median of a few
hundred) direct and through the proxy, at a delay of 0 first, then sets the
delay so that the round trip the proxy adds comes close to the one wanted
(and corrects it, a few times at most, by what that delay achieved), never
below 0. With
``--control`` the proxy takes ``rtt MS`` lines on stdin (answering ``ok``)
and exits when stdin closes: that is how :func:`delayed` drives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import selectors
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

if __package__ in (None, ""):  # run as a script: python bench/delay_proxy.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

__all__ = ("Delayed", "Proxy", "delayed", "ping_ms", "serve")

ROOT = Path(__file__).resolve().parent.parent
#: PINGs per measurement of the round trip (the median is taken).
PINGS = 300
#: Corrections of the delay at most, by what it achieved, until it is this close
#: to the round trip wanted (a share of it, or ms, whichever is more).
ROUNDS, CLOSE, CLOSE_MS = 3, 0.02, 0.005


class Proxy:
    """The proxy's settings, shared by its connections: the delay of each direction."""

    def __init__(self, upstream: tuple[str, int], rtt_s: float) -> None:
        self.upstream = upstream
        self.delay = rtt_s / 2


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Side(asyncio.Protocol):
    """One socket of a proxied connection, and the chunks due to be written to it."""

    def __init__(self, proxy: Proxy, loop: asyncio.AbstractEventLoop) -> None:
        self.proxy = proxy
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        #: (when, chunk) in the order read from the peer; None: close after the rest.
        self.due: deque[tuple[float, bytes | None]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        #: What was read before the peer's socket opened, to be written once it has.
        self.early: list[bytes] = []

    # What the other side read, to be written here.

    def later(self, chunk: bytes | None) -> None:
        """Write chunk (None: close) proxy.delay after now, after what is due before it."""
        delay = self.proxy.delay
        if delay <= 0 and not self.due:
            self._write(chunk)
            return
        when = self.loop.time() + delay
        self.due.append((when, chunk))
        if self.timer is None:
            self.timer = self.loop.call_at(when, self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        due = self.due
        while due and due[0][0] <= now:
            self._write(due.popleft()[1])
        if due:  # (a chunk never jumps its queue, even if the delay was shortened)
            self.timer = self.loop.call_at(due[0][0], self._flush)

    def _write(self, chunk: bytes | None) -> None:
        if self.transport is None or self.closed:
            return
        if chunk is None:
            self.close()
        else:
            self.transport.write(chunk)

    def close(self) -> None:
        """Close this socket once its buffer is written, and forget what is still due."""
        if self.closed:
            return
        self.closed = True
        self.due.clear()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()

    # What this side's socket does.

    def data_received(self, data: bytes) -> None:
        if self.peer is not None:
            self.peer.later(data)
        else:  # (before 3.11, a transport reads even if paused in connection_made)
            self.early.append(data)

    def eof_received(self) -> bool:
        if self.peer is not None:
            self.peer.later(None)
        return False  # close this one

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.due.clear()
        if self.peer is not None and not self.peer.closed:
            self.peer.later(None)

    # Back-pressure: a peer that cannot keep up pauses the reading of this side.

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            self.peer.transport.resume_reading()


class _Client(_Side):
    """A client's connection: opens the upstream one, and reads nothing until it is open."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        _nodelay(transport)
        transport.pause_reading()
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        host, port = self.proxy.upstream
        upstream = _Side(self.proxy, self.loop)
        try:
            transport, _ = await self.loop.create_connection(lambda: upstream, host, port)
        except OSError:
            self.close()
            return
        _nodelay(transport)
        upstream.transport = transport
        upstream.peer, self.peer = self, upstream
        if self.closed:  # the client left while the upstream was opening
            upstream.close()
            return
        for chunk in self.early:
            upstream.later(chunk)
        self.early.clear()
        assert self.transport is not None
        self.transport.resume_reading()


def _least_timer_slack() -> None:
    """Have this process's timed waits overshoot as little as Linux lets them (1 ns slack)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK


def _control(proxy: Proxy, fd: int, stopped: asyncio.Future[None]) -> Callable[[], None]:
    """The reader of ``rtt MS`` lines on fd (stdin); its end stops the proxy."""
    pending = bytearray()

    def read() -> None:
        data = os.read(fd, 4096)
        if not data:
            if not stopped.done():
                stopped.set_result(None)
            return
        pending.extend(data)
        while (end := pending.find(b"\n")) >= 0:
            line = pending[:end].decode().strip()
            del pending[: end + 1]
            word, _, value = line.partition(" ")
            if word == "rtt":
                proxy.delay = max(0.0, float(value) / 1e3 / 2)
                print("ok", flush=True)
            else:
                print(f"unknown command: {line}", flush=True)

    return read


def serve(upstream: tuple[str, int], rtt_ms: float, port: int = 0, control: bool = False) -> None:
    """Run the proxy in this process until stdin closes (control) or forever."""
    _least_timer_slack()
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    asyncio.set_event_loop(loop)
    proxy = Proxy(upstream, rtt_ms / 1e3)
    server = loop.run_until_complete(
        loop.create_server(lambda: _Client(proxy, loop), "127.0.0.1", port)
    )
    host, bound = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{bound}", flush=True)
    stopped: asyncio.Future[None] = loop.create_future()
    if control:
        loop.add_reader(sys.stdin.fileno(), _control(proxy, sys.stdin.fileno(), stopped))
    try:
        loop.run_until_complete(stopped)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        loop.close()


# The parent's side: a proxy process in front of a Redis server, calibrated.


def ping_ms(url: str, count: int = PINGS) -> float:
    """The median time of a redis-py ``PING`` to url, in ms (after a few not counted)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        for _ in range(20):
            client.ping()
        times = []
        clock = time.perf_counter
        for _ in range(count):
            start = clock()
            client.ping()
            times.append(clock() - start)
    finally:
        client.close()
    return statistics.median(times) * 1e3


@dataclass
class Delayed:
    """A proxy in front of a Redis server, and the round trip it was measured to add."""

    #: The proxy's URL: the server's, with the proxy's host and port.
    url: str
    #: The round trip wanted, in ms.
    target_ms: float
    #: The round trip the proxy is told to make (each direction half of it), in ms.
    set_ms: float = 0.0
    #: PING, direct to the server, in ms (median).
    direct_ms: float = 0.0
    #: PING through the proxy, in ms (median).
    ping_ms: float = 0.0
    #: PING through the proxy at a delay of 0: its own cost, in ms (median).
    zero_ms: float = 0.0
    #: Tells the proxy another round trip, in ms (uncalibrated): see retime().
    _set_rtt: Callable[[float], None] | None = None

    def retime(self, rtt_ms: float) -> None:
        """Have the proxy add rtt_ms (as told, uncalibrated) from now on, to every connection."""
        assert self._set_rtt is not None
        self._set_rtt(rtt_ms)
        self.set_ms = rtt_ms

    @property
    def achieved_ms(self) -> float:
        """The round trip the proxy adds: PING through it less PING direct."""
        return self.ping_ms - self.direct_ms

    def as_dict(self) -> dict[str, float | str]:
        return {
            "url": self.url,
            "target_ms": self.target_ms,
            "set_ms": self.set_ms,
            "direct_ms": self.direct_ms,
            "zero_ms": self.zero_ms,
            "ping_ms": self.ping_ms,
            "achieved_ms": self.achieved_ms,
        }


class _ProxyProcess:
    """The proxy's process, driven over its stdin."""

    def __init__(self, upstream: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.delay_proxy", "--upstream", upstream, "--control"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        said = self._line()
        if not said.startswith("listening "):
            raise RuntimeError(f"the delay proxy said {said!r}")
        self.address = said.split()[1]

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the delay proxy exited (see its stderr above)")
        return line

    def set_rtt(self, rtt_ms: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"rtt {rtt_ms!r}\n")
        self.process.stdin.flush()
        said = self._line()
        if said.strip() != "ok":
            raise RuntimeError(f"the delay proxy said {said!r}")

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # its end of stdin stops it
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _via(url: str, address: str) -> str:
    """url, with its host and port replaced by address (user and password kept)."""
    parts = urlsplit(url)
    user, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}{at}{address}"))


def _upstream(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}"


@contextlib.contextmanager
def delayed(
    url: str, rtt_ms: float, *, calibrate: bool = True, pings: int = PINGS
) -> Iterator[Delayed]:
    """A proxy process in front of the Redis server at url, adding rtt_ms to a round trip.

    Calibrated (unless told not to): the PING through it at a delay of 0 is
    its own cost above the direct PING; the round trip it is told to make is
    the one wanted less that (never below 0), then corrected once by what
    that achieved (which includes the timer's overshoot), up to ROUNDS times
    until within CLOSE of it. The answer says what it achieved either way.
    """
    proxy = _ProxyProcess(_upstream(url))
    try:
        through = _via(url, proxy.address)
        result = Delayed(through, rtt_ms, _set_rtt=proxy.set_rtt)
        result.direct_ms = ping_ms(url, pings)
        if calibrate:
            proxy.set_rtt(0.0)
            result.zero_ms = ping_ms(through, pings)
            own = result.zero_ms - result.direct_ms
            result.set_ms = max(0.0, rtt_ms - own) if rtt_ms > 0 else 0.0
            for _ in range(ROUNDS if result.set_ms > 0 else 0):
                proxy.set_rtt(result.set_ms)
                error = ping_ms(through, pings) - result.direct_ms - rtt_ms
                if abs(error) <= max(CLOSE_MS, CLOSE * rtt_ms):
                    break
                result.set_ms = max(0.0, result.set_ms - error)
        else:
            result.set_ms = rtt_ms
        proxy.set_rtt(result.set_ms)
        result.ping_ms = ping_ms(through, pings)
        yield result
    finally:
        proxy.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.delay_proxy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip to add, in ms")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    parser.add_argument(
        "--control", action="store_true", help="take 'rtt MS' lines on stdin; exit at its end"
    )
    options = parser.parse_args(argv)
    host, _, port = options.upstream.rpartition(":")
    serve((host or "127.0.0.1", int(port)), options.rtt_ms, options.port, options.control)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
