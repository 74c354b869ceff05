"""Manifest sync: a burst of published versions syncs the running one and the latest.

inturn's origin: a server keeps its files in step with the published
manifest. Two syncs at once would mangle a file, so they take one key in
turn; but when versions are published faster than a sync runs, syncing each
in turn is wasted work, since only the latest matters. With
``pending="latest"``, while a sync runs its key keeps at most one waiting
sync: a newer version takes that one's place, and the caller it replaced
gets the newer sync's answer. The running sync is never interrupted.

Then the same across worker processes, as a web app with several workers
runs it: each "a new manifest is published" reaches one worker, so a burst
is spread over all of them. With ``across="processes"`` on a FileBackend,
the key keeps one latest sync among every process: the burst costs one
sync, the newest; a publisher in another process is answered ``None`` once
it ran (its result stays in the process that ran it).

Run: python examples/manifest_sync.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from asyncio.subprocess import PIPE
from pathlib import Path

from inturn import KeyedQueue, queue_by_key
from inturn.backends.file import FileBackend


class Server:
    """A server's files, synced from a manifest (path -> content) over a slow network."""

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self.synced: list[int] = []  # the versions whose files were synced, in order
        self.syncing = asyncio.Event()  # set once the first sync has started
        self.network = asyncio.Event()  # set: the downloads go through

    @queue_by_key(key="manifest-sync", pending="latest")
    async def sync(self, version: int, manifest: dict[str, str]) -> int:
        self.syncing.set()
        await self.network.wait()
        for path, content in manifest.items():
            await asyncio.sleep(0)  # the download
            self.files[path] = content
        self.synced.append(version)
        return version


async def publish(server: Server, versions: int) -> list[int]:
    """Publish versions 1..versions while the first one syncs: each publisher's answer."""
    manifests = [{f"file-{n}.bin": f"v{v}" for n in range(3)} for v in range(1, versions + 1)]
    first = asyncio.create_task(server.sync(1, manifests[0]))
    await server.syncing.wait()  # v1 syncs, and the network is slow ...
    rest = [asyncio.create_task(server.sync(v, m)) for v, m in enumerate(manifests[1:], 2)]
    await asyncio.sleep(0)  # ... while the others are published: each call takes its place
    server.network.set()
    return await asyncio.gather(first, *rest)


# -- across worker processes ---------------------------------------------------------------


def syncs(site: Path) -> KeyedQueue:
    """A worker's queue of syncs: one latest sync per key among every process of site."""
    return KeyedQueue(backend=FileBackend(site / "lines"), pending="latest", across="processes")


def sync_files(site: Path, version: int) -> int:
    """The sync itself: write the version's files, and note it (appended whole)."""
    for n in range(3):
        (site / f"file-{n}.bin").write_text(f"v{version}")
    with (site / "synced").open("a") as synced:
        synced.write(f"{version}\n")
    return version


async def worker(site: Path) -> None:
    """A worker process: sync each version published to it (a line on stdin), then say how
    each of its publishers was answered."""
    queue = syncs(site)
    loop = asyncio.get_running_loop()
    calls = []
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        version = int(line)
        calls.append(asyncio.create_task(queue.run("manifest", sync_files, site, version)))
        await asyncio.sleep(0)  # the call is made: it waits, as the key is busy
        print("published", flush=True)
    print(" ".join(map(str, await asyncio.gather(*calls))), flush=True)
    await queue.aclose()


async def fleet(site: Path, versions: int, workers: int) -> tuple[list[int], list[str]]:
    """Publish versions 2..versions, one by one, each to one of several worker processes,
    while this process syncs version 1: the versions synced, and each worker's answers."""
    queue = syncs(site)
    network, syncing = asyncio.Event(), asyncio.Event()

    async def first() -> int:
        syncing.set()
        await network.wait()
        return sync_files(site, 1)

    running = asyncio.create_task(queue.run("manifest", first))
    await syncing.wait()
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, __file__, "worker", str(site), stdin=PIPE, stdout=PIPE
        )
        for _ in range(workers)
    ]

    async def tell(process: asyncio.subprocess.Process, line: str | None) -> str:
        """Send line to process (None: the end of its input), and read its reply."""
        assert process.stdin is not None
        assert process.stdout is not None
        if line is None:
            process.stdin.close()
        else:
            process.stdin.write(line.encode())
        return (await process.stdout.readline()).decode()

    for version in range(2, versions + 1):  # a load balancer's round robin
        assert await tell(processes[version % workers], f"{version}\n") == "published\n"
    network.set()
    await running
    answers = [(await tell(process, None)).strip() for process in processes]
    for process in processes:
        await process.wait()
    await queue.aclose()
    synced = [int(v) for v in (site / "synced").read_text().split()]
    return synced, answers


async def main() -> None:
    server = Server()
    answers = await publish(server, 20)
    print("published v1 to v20 while v1 synced")
    print("synced:", ", ".join(f"v{v}" for v in server.synced))
    print(f"answers: v1 -> v{answers[0]}; v2 to v20 -> v{answers[-1]}, the sync that replaced them")
    print("files:", server.files)
    print("superseded:", Server.sync.queue.stats().superseded)  # v2 to v19
    assert server.synced == [1, 20], "a superseded version was synced"
    assert answers == [1] + [20] * 19, "a publisher got the wrong answer"
    assert set(server.files.values()) == {"v20"}

    with tempfile.TemporaryDirectory() as directory:
        synced, replies = await fleet(Path(directory), 13, 4)
    print("published v2 to v13 to 4 worker processes while v1 synced")
    print("synced:", ", ".join(f"v{v}" for v in synced))
    for n, reply in enumerate(replies):
        print(f"worker {n}'s publishers were answered: {reply}")
    assert synced == [1, 13], "a superseded version was synced"


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        asyncio.run(worker(Path(sys.argv[2])))
    else:
        asyncio.run(main())
