"""Every example runs as its users would run it, and checks its own claims."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

DIRECTORY = Path(__file__).parent.parent / "examples"
EXAMPLES = sorted(DIRECTORY.glob("*.py"))
#: Examples that need a server, each run against the session's by a test module of its own.
NEEDS_A_SERVER = {"redis_stream_consumer": "test_redis_stream_example.py"}


def test_there_are_examples() -> None:
    assert {p.stem for p in EXAMPLES} >= {
        "inventory",
        "log_append",
        "chat",
        "batch",
        "partitioned_batch",
        "manifest_sync",
        *NEEDS_A_SERVER,
    }
    for module in NEEDS_A_SERVER.values():
        assert (Path(__file__).parent / module).is_file()


@pytest.mark.parametrize(
    "example", [p for p in EXAMPLES if p.stem not in NEEDS_A_SERVER], ids=lambda p: p.stem
)
def test_example_runs(example: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr


def _load(stem: str) -> ModuleType:
    """The example stem, imported as a module of its own (its main() not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{stem}", DIRECTORY / f"{stem}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("versions", [1, 2, 3, 50])
async def test_manifest_sync_syncs_the_running_version_and_the_latest(versions: int) -> None:
    # the example's claim: a burst published while v1 syncs costs one more sync,
    # of the latest, and every publisher is answered (a replaced one by that sync)
    example = _load("manifest_sync")
    server = example.Server()
    answers = await example.publish(server, versions)
    assert server.synced == sorted({1, versions})
    assert answers == [1] + [versions] * (versions - 1)
    assert set(server.files.values()) == {f"v{versions}"}
    assert not example.Server.sync.queue.is_active("manifest-sync")  # nothing left in line


@pytest.mark.parametrize("versions", [2, 5, 13, 40])
async def test_manifest_sync_across_worker_processes_syncs_once_per_burst(
    tmp_path: Path, versions: int
) -> None:
    # the example's claim: a burst spread over 4 worker processes while v1 syncs costs one
    # more sync, of the newest; its own worker's publishers get it, the others None
    example = _load("manifest_sync")
    synced, answers = await example.fleet(tmp_path, versions, 4)
    assert synced == [1, versions]
    ran = versions % 4  # (version v went to worker v % 4)
    per_worker = [sum(1 for v in range(2, versions + 1) if v % 4 == n) for n in range(4)]
    assert answers == [
        " ".join([str(versions) if n == ran else "None"] * count)
        for n, count in enumerate(per_worker)
    ]
    files = await asyncio.to_thread(lambda: {p.read_text() for p in tmp_path.glob("file-*.bin")})
    assert files == {f"v{versions}"}
