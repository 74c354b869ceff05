"""Safe appends to one file from many tasks.

Writers add multi-line records to a log, yielding between lines as an async
file API would. Holding the file's key with ``async with keyed(path)`` keeps
every record whole: no other writer's lines land in the middle of it.

Run: python examples/log_append.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from inturn import keyed


async def append_record(path: Path, writer: int, lines: int) -> None:
    async with keyed(f"file:{path}"):
        with path.open("a") as log:
            for n in range(lines):
                log.write(f"writer {writer} line {n + 1}/{lines}\n")
                log.flush()
                await asyncio.sleep(0)  # what an async file API does between writes


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "system.log"
        await asyncio.gather(*(append_record(path, w, lines=5) for w in range(20)))
        text = path.read_text().splitlines()
    records = [text[i : i + 5] for i in range(0, len(text), 5)]
    for record in records:
        writers = {line.split()[1] for line in record}
        assert len(writers) == 1, f"interleaved record: {record}"
    print(f"{len(records)} records of 5 lines appended concurrently, none interleaved")
    print("first record:", *records[0], sep="\n  ")


if __name__ == "__main__":
    asyncio.run(main())
