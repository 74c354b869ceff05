"""Faults on purpose, for the Redis backend's tests: a TCP proxy that freezes, cuts and injects.

:class:`Proxy` sits between the backend and a real server, in a thread and
an event loop of its own (so that a test's own loop, or a frozen client,
never stops it). Through it a test can

- :meth:`~Proxy.freeze` the network: bytes stop flowing both ways and new
  connections get no answer, as when packets are dropped; :meth:`~Proxy.thaw`
  delivers what was held and goes on, as TCP does once a partition heals;
- :meth:`~Proxy.cut` every connection at once (the peer sees a reset);
- :meth:`~Proxy.inject` bytes into every server-to-client stream, between
  two whole replies (RESP3 push frames, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from servers import free_port

T = TypeVar("T")


class _Pipe:
    """One client connection: the bytes each way, held while frozen."""

    def __init__(self, proxy: Proxy, client: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []  # the two pumps

    async def pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, downstream: bool
    ) -> None:
        proxy = self.proxy
        try:
            while data := await reader.read(65536):
                await proxy.flowing.wait()
                if downstream:
                    proxy.passed += 1
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def cut(self) -> None:
        for writer in (self.client, self.server):
            if writer is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class Proxy:
    """A TCP proxy to 127.0.0.1:target_port that a test can freeze, cut and inject into."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.pipes: set[_Pipe] = set()
        self.passed = 0  # server-to-client chunks passed on
        self.flowing = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Proxy:
        self._thread.start()
        self._call(self._start)
        return self

    async def _start(self) -> None:
        self.flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pipe = _Pipe(self, writer)
        self.pipes.add(pipe)
        try:
            await self.flowing.wait()  # frozen: the connection gets no answer
            server_reader, server_writer = await asyncio.open_connection(
                "127.0.0.1", self.target_port
            )
            pipe.server = server_writer
            pipe.tasks = [
                asyncio.ensure_future(pipe.pump(reader, server_writer, False)),
                asyncio.ensure_future(pipe.pump(server_reader, writer, True)),
            ]
            await asyncio.gather(*pipe.tasks, return_exceptions=True)
        except (ConnectionError, OSError, asyncio.CancelledError):
            # (not raised: asyncio's stream server logs a handler that ends in an error)
            pipe.cut()
        finally:
            self.pipes.discard(pipe)

    def _call(self, make: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)  # type: ignore[arg-type]

    def _do(self, action: Callable[[], Any]) -> None:
        async def run() -> None:
            action()

        self._call(run)

    def freeze(self) -> None:
        """Stop every byte both ways, and answer no new connection, until :meth:`thaw`."""
        self._do(self.flowing.clear)

    def thaw(self) -> None:
        """Deliver what was held, and flow again."""
        self._do(self.flowing.set)

    def cut(self) -> None:
        """Reset every connection through the proxy now (new ones are accepted)."""

        def cut_all() -> None:
            for pipe in list(self.pipes):
                pipe.cut()

        self._do(cut_all)

    def inject(self, data: bytes) -> int:
        """Write data to every client, between two chunks the server sent; return how many got it.

        The server's replies arrive whole in practice when nothing is in
        flight, which is when a test injects.
        """

        def write_all() -> int:
            count = 0
            for pipe in self.pipes:
                if pipe.server is not None and not pipe.client.is_closing():
                    pipe.client.write(data)
                    count += 1
            return count

        async def run() -> int:
            return write_all()

        return self._call(run)

    def connections(self) -> int:
        """Client connections open through the proxy now."""

        async def count() -> int:
            return len(self.pipes)

        return self._call(count)

    def close(self) -> None:
        async def stop() -> None:
            self.flowing.set()
            for pipe in list(self.pipes):
                pipe.cut()
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
