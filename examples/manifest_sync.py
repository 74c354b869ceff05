"""Manifest sync: a burst of published versions syncs the running one and the latest.

inturn's origin: a server keeps its files in step with the published
manifest. Two syncs at once would mangle a file, so they take one key in
turn; but when versions are published faster than a sync runs, syncing each
in turn is wasted work, since only the latest matters. With
``pending="latest"``, while a sync runs its key keeps at most one waiting
sync: a newer version takes that one's place, and the caller it replaced
gets the newer sync's answer. The running sync is never interrupted.

Run: python examples/manifest_sync.py
"""

from __future__ import annotations

import asyncio

from inturn import queue_by_key


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


if __name__ == "__main__":
    asyncio.run(main())
