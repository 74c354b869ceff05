"""A Redis URL that names a server that is not Redis: a turn's error says so, with its address.

No Redis here: the servers are an HTTP server that closes each connection
after its answer (so the answer is lost in the reset, and redis-py reads only
a closed connection), one that reads all before closing (the answer arrives,
and is not Redis's protocol), and one that closes each connection at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from inturn import BackendUnavailable, KeyedQueue
from inturn.backends.redis import RedisBackend

from support.helpers import PATIENCE


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class _Lingering(_Quiet):
    """Reads all the client sends before it closes (nginx's lingering close), so the
    answer arrives."""

    default_request_version = "HTTP/1.1"

    def finish(self) -> None:
        super().finish()
        self.request.settimeout(PATIENCE)
        with contextlib.suppress(OSError):
            while self.request.recv(65536):
                pass


@contextlib.contextmanager
def _http(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        serving.join(PATIENCE)


@contextlib.contextmanager
def _closing() -> Iterator[int]:
    """A port whose server accepts each connection and closes it, saying nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            with contextlib.suppress(OSError):
                listener.accept()[0].close()

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        serving.join(PATIENCE)
        listener.close()


SERVERS = {
    "http": lambda: _http(_Quiet),
    "http-lingering": lambda: _http(_Lingering),
    "closing": _closing,
}


@pytest.mark.parametrize("blocking", [False, True], ids=["task", "thread"])
@pytest.mark.parametrize("server", SERVERS)
async def test_a_turn_on_a_server_that_is_not_redis_says_so_with_its_address(
    server: str, blocking: bool
) -> None:
    with SERVERS[server]() as port:
        backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", namespace="shop")
        queue = KeyedQueue(backend=backend, timeout=PATIENCE)
        ran: list[int] = []
        turn = (
            asyncio.to_thread(queue.run_sync, "k", ran.append, 1)
            if blocking
            else queue.run("k", ran.append, 1)
        )
        try:
            with pytest.raises(BackendUnavailable) as refused:
                await turn
        finally:
            await queue.aclose()
    message = str(refused.value)
    assert message.startswith("inturn: what answered is not a Redis server"), message
    assert f"check the URL's host and port (127.0.0.1:{port})" in message
    assert message.endswith("; the work did not run")
    assert ran == []
