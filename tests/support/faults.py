"""Faults on purpose, for the Redis backend's tests: a TCP proxy that freezes, cuts and injects.

:class:`Proxy` sits between the backend and a real server, in a thread of
its own (so that a test's event loop, or a frozen client, never stops it).
Through it a test can

- :meth:`~Proxy.freeze` the network: bytes stop flowing both ways and new
  connections get no answer, as when packets are dropped; :meth:`~Proxy.thaw`
  delivers what was held and goes on, as TCP does once a partition heals;
- :meth:`~Proxy.hold_replies`: the server's bytes stop reaching the
  clients connected now (theirs still reach the server, and new
  connections flow), as when a network drops one direction of a flow;
- :meth:`~Proxy.cut` every connection at once (the peer sees a reset);
- :meth:`~Proxy.inject` bytes into every server-to-client stream (RESP3 push
  frames, say), written between two chunks the server sent;
- :meth:`~Proxy.hears` whether the clients sent given bytes (a statement's
  name, say), waiting for them: with :meth:`~Proxy.hold_replies`, what a
  client sends before any answer comes back.

Plain sockets and one selector: every socket the proxy opens is in one set,
and :meth:`~Proxy.close` closes each of them.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

from .servers import free_port

T = TypeVar("T")


class _Pipe:
    """One client connection and its connection to the server, with what waits to be sent."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.server: socket.socket | None = None
        self.to_server = bytearray()  # read from the client, held while frozen
        self.to_client = bytearray()
        self.replies_held = False  # the server's bytes wait (the client's flow)


class Proxy:
    """A TCP proxy to 127.0.0.1:target_port that a test can freeze, cut and inject into."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._pipes: dict[socket.socket, _Pipe] = {}  # by either of its sockets
        self._frozen = False
        self._closed = False
        self._lock = threading.Lock()  # held to change the pipes or the state
        self._wake_r, self._wake_w = socket.socketpair()  # wakes the selector for a change
        self._heard = bytearray()  # what the clients sent, since the start or forget()
        self._hearing = threading.Condition(self._lock)  # notified as the clients send
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Proxy:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()
        return self

    # -- the proxy's thread -----------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                with self._lock:
                    if self._closed:
                        return
                    if sock is self._wake_r:
                        self._wake_r.recv(4096)
                    elif sock is self._listener:
                        self._accept()
                    elif sock in self._pipes:
                        self._read(sock)
            with self._lock:
                if not self._frozen:
                    self._flush()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        pipe = _Pipe(client)
        self._pipes[client] = pipe
        self._selector.register(client, selectors.EVENT_READ)

    def _connect(self, pipe: _Pipe) -> bool:
        """Open pipe's connection to the server (once not frozen); False if it failed."""
        if pipe.server is not None:
            return True
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            self._drop(pipe)
            return False
        server.setblocking(False)
        pipe.server = server
        self._pipes[server] = pipe
        self._selector.register(server, selectors.EVENT_READ)
        return True

    def _read(self, sock: socket.socket) -> None:
        pipe = self._pipes[sock]
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pipe)
            return
        if sock is pipe.client:
            pipe.to_server.extend(data)
            self._heard.extend(data)
            self._hearing.notify_all()
        else:
            pipe.to_client.extend(data)

    def _flush(self) -> None:
        """Pass on what every pipe holds (the proxy is not frozen)."""
        for pipe in list(set(self._pipes.values())):
            if not self._connect(pipe):
                continue
            assert pipe.server is not None
            for data, sock in ((pipe.to_server, pipe.server), (pipe.to_client, pipe.client)):
                if data and not (pipe.replies_held and sock is pipe.client):
                    try:
                        sent = sock.send(data)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        self._drop(pipe)
                        break
                    del data[:sent]

    def _drop(self, pipe: _Pipe, reset: bool = False) -> None:
        for sock in (pipe.client, pipe.server):
            if sock is None:
                continue
            self._pipes.pop(sock, None)
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            if reset:  # the peer sees a reset, not an orderly end
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    # -- what a test does ---------------------------------------------------------------

    def _change(self, change: Callable[[], T]) -> T:
        with self._lock:
            result = change()
        self._wake_w.send(b"x")
        return result

    def freeze(self) -> None:
        """Stop every byte both ways, and answer no new connection, until :meth:`thaw`."""

        def freeze() -> None:
            self._frozen = True

        self._change(freeze)

    def thaw(self) -> None:
        """Deliver what was held, and flow again."""

        def thaw() -> None:
            self._frozen = False
            for pipe in self._pipes.values():
                pipe.replies_held = False

        self._change(thaw)

    def hold_replies(self) -> None:
        """Keep the server's bytes from the clients connected now (theirs still reach it;
        new connections flow), until :meth:`thaw`."""

        def hold() -> None:
            for pipe in self._pipes.values():
                pipe.replies_held = True

        self._change(hold)

    def cut(self) -> None:
        """Reset every connection through the proxy now (new ones are accepted)."""

        def cut() -> None:
            for pipe in list(set(self._pipes.values())):
                self._drop(pipe, reset=True)

        self._change(cut)

    def inject(self, data: bytes) -> int:
        """Queue data for every client connected to the server; return how many get it."""

        def inject() -> int:
            pipes = [pipe for pipe in set(self._pipes.values()) if pipe.server is not None]
            for pipe in pipes:
                pipe.to_client.extend(data)
            return len(pipes)

        return self._change(inject)

    def hears(self, data: bytes, timeout: float) -> bytes | None:
        """What the clients sent since the start or :meth:`forget`, once it holds data
        (waiting for it up to timeout seconds); None if it did not come by then."""
        with self._hearing:
            if not self._hearing.wait_for(lambda: data in self._heard, timeout):
                return None
            return bytes(self._heard)

    def forget(self) -> None:
        """Forget what the clients sent until now (for :meth:`hears`)."""
        with self._lock:
            self._heard.clear()

    def connections(self) -> int:
        """Client connections open through the proxy now."""
        return self._change(lambda: len({id(pipe) for pipe in self._pipes.values()}))

    def close(self) -> None:
        """Close every connection and stop; every socket the proxy opened is closed."""

        def close() -> None:
            self._closed = True
            for pipe in list(set(self._pipes.values())):
                self._drop(pipe, reset=True)

        self._change(close)
        self._thread.join(10)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
