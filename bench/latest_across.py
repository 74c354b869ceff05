"""(w3) Latest wins across processes (issue 46): a burst of 1,000 calls on one busy key,
spread over 8 processes, on the file backend.

    python -m bench.latest_across [--repeats 3] [--quick] [--json out.json]

(``python -m bench.latest`` runs it after (w) and (w2).) This process holds
the key (a file backend's, in FileBackend()'s default directory), while
worker processes each make their share of the burst as tasks on a queue
with ``pending="latest"``; once every one says its calls wait, the holder
lets go, and the burst ends once every caller has its answer. Each work
appends nothing, yields once, and returns. Contenders:

- ``across=processes, 8 processes``: ``across="processes"``: the key keeps
  one latest work among the 8 processes (1 run after the holder);
- ``pending=latest, 8 processes``: each process conflates its own share
  (``across="process"``, the default: up to 8 runs);
- ``pending=latest, 1 process``: the whole burst in one process (1 run):
  the time the cross-process burst is held to.

Measures: the works that ran after the holder (every process's count, summed;
checked against what the contender promises, else Verification); and ms per
burst, from the first command to the workers to the last answer (the
holder's release included), the median of several bursts. Ratios are to
``pending=latest, 1 process``, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/latest_across.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .scenarios import Verification
from .targets import Rows, Target, at_most, cell, evaluate, ratio, valid

#: The burst's key (of this bench's own: other runs on the machine use other keys).
KEY = "bench-latest-across"
#: The calls of a burst, and the processes of the spread ones.
BURST, PROCESSES = 1_000, 8
#: The contenders: (name, processes, the workers' queue, runs promised after the holder).
ACROSS = "across=processes, 8 processes"
EACH = "pending=latest, 8 processes"
ONE = "pending=latest, 1 process"
CONTENDERS = ((ACROSS, PROCESSES, "across"), (EACH, PROCESSES, "process"), (ONE, 1, "process"))
BASELINE = ONE
#: Where the workers run (python -m bench.latest_across worker): the tree's root.
ROOT = str(Path(__file__).resolve().parent.parent)
RUNS = f"(w3) works run after the holder, {BURST:,} calls"
TIME = f"(w3) ms per burst of {BURST:,} calls on a busy key, to the last answer"


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.bursts = 3 if quick else 10  # timed bursts per sample (their median)


# -- the workers ------------------------------------------------------------------------


async def worker() -> None:
    """A worker process: ``burst N QUEUE`` makes N calls of KEY on its queue (``across`` or
    ``process``), says ``queued`` once they wait, then ``answered R`` (R: the works of its
    own that ran) once every caller has its answer."""
    from inturn import KeyedQueue
    from inturn.backends.file import FileBackend

    queues = {
        across: KeyedQueue(backend=FileBackend(), pending="latest", across=across)
        for across in ("process", "processes")
    }
    loop = asyncio.get_running_loop()
    ran = 0

    async def work(i: int) -> int:
        nonlocal ran
        ran += 1
        await asyncio.sleep(0)
        return i

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        _, n, which = line.split()
        queue = queues["processes" if which == "across" else "process"]
        ran = 0
        calls = [asyncio.create_task(queue.run(KEY, work, i)) for i in range(int(n))]
        for _ in range(100 * int(n)):  # (the first waits at the backend, the rest behind it)
            if queue.pending(KEY) >= int(n) - 1 or any(call.done() for call in calls):
                break
            await asyncio.sleep(0)
        print("queued", flush=True)
        await asyncio.gather(*calls)
        print("answered", ran, flush=True)


class Workers:
    """The worker processes, started once for every burst."""

    def __init__(self, processes: list[asyncio.subprocess.Process]) -> None:
        self.processes = processes

    @classmethod
    async def start(cls, n: int) -> Workers:
        command = [sys.executable, "-m", "bench.latest_across", "worker"]
        return cls(
            [
                await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    cwd=ROOT,
                )
                for _ in range(n)
            ]
        )

    async def send(self, process: asyncio.subprocess.Process, line: str) -> None:
        assert process.stdin is not None
        process.stdin.write(line.encode() + b"\n")
        await process.stdin.drain()

    async def expect(self, process: asyncio.subprocess.Process, word: str) -> list[str]:
        assert process.stdout is not None
        words = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().split()
        if not words or words[0] != word:
            raise Verification(f"(w3) a worker said {words}, expected {word!r}")
        return words[1:]

    async def close(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            await asyncio.wait_for(process.wait(), 60)


async def burst(workers: Workers, count: int, which: str) -> tuple[float, int]:
    """One burst of BURST calls spread over count workers while this process holds KEY: its
    ms, and the works that ran after the holder."""
    from inturn import KeyedQueue
    from inturn.backends.file import FileBackend

    holder = KeyedQueue(backend=FileBackend())
    participants = workers.processes[:count]
    shares = [BURST // count + (n < BURST % count) for n in range(count)]
    async with holder.keyed(KEY):
        started = time.perf_counter()
        for process, share in zip(participants, shares, strict=True):
            await workers.send(process, f"burst {share} {which}")
        for process in participants:
            await workers.expect(process, "queued")
    answers = [await workers.expect(process, "answered") for process in participants]
    elapsed = (time.perf_counter() - started) * 1000
    await holder.aclose()
    return elapsed, sum(int(words[0]) for words in answers)


async def measure(sizes: Sizes, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Each contender's medians: ms per burst and works run (checked)."""
    workers = await Workers.start(PROCESSES)
    times: dict[str, list[float]] = {name: [] for name, _, _ in CONTENDERS}
    runs: dict[str, list[int]] = {name: [] for name, _, _ in CONTENDERS}
    try:
        for repeat in range(repeats):
            for name, count, which in CONTENDERS[repeat % 3 :] + CONTENDERS[: repeat % 3]:
                for _ in range(sizes.bursts):
                    elapsed, ran = await burst(workers, count, which)
                    times[name].append(elapsed)
                    runs[name].append(ran)
            log(f"(w3) repeat {repeat + 1} of {repeats}")
    finally:
        await workers.close()
    for name in (ACROSS, ONE):
        if any(ran != 1 for ran in runs[name]):
            raise Verification(f"(w3) {name}: works run after the holder {runs[name]}, not 1")
    return {
        RUNS: {name: float(max(values)) for name, values in runs.items()},
        TIME: {name: statistics.median(values) for name, values in times.items()},
    }


def table(rows: Rows) -> str:
    names = [name for name, _, _ in CONTENDERS]
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, values in rows.items():
        cells = []
        for name in names:
            value = values.get(name)
            if value is None:
                cells.append("-")
            elif label == RUNS:
                cells.append(f"{value:,.0f}")
            else:
                quotient = ratio(value, values.get(BASELINE))
                cells.append(f"{value:,.1f}" + (f" ({quotient:.2f}x)" if valid(quotient) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_table() -> list[Target]:
    """Issue 46's: a burst spread over 8 processes runs once, in at most 1.2x one process's
    time."""
    return [
        Target(
            f"(w3) {ACROSS}: {BURST:,} calls run 1 work after the holder",
            (ACROSS,),
            lambda rows: cell(rows, RUNS, ACROSS),
            1.0,
            form="{:,.0f}",
        ),
        at_most(TIME, ACROSS, 1.2, ONE, label=f"(w3) {ACROSS}: <= 1.2x the time of {ONE}"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    from .run import machine

    parser = argparse.ArgumentParser(
        prog="python -m bench.latest_across", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument("--quick", action="store_true", help="fewer bursts: a smoke test")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    options = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    rows = asyncio.run(measure(Sizes(options.quick), options.repeats, log))
    print(report(rows, options.repeats, machine()))
    if options.json:
        options.json.write_text(json.dumps(rows, indent=2))
    return 0


def report(rows: Rows, repeats: int, machine: str) -> str:
    """(w3)'s table and its targets, as printed."""
    seen = [name for name, _, _ in CONTENDERS]
    verdicts = [evaluate(target, rows, seen) for target in target_table()]
    lines = [
        f"## (w3) latest wins across processes, file backend: {machine}, median of {repeats}",
        "",
        table(rows),
        "",
        "Targets (issue 46):",
        "",
        *(f"- {verdict} {label}: {value}" for verdict, label, value in verdicts),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        asyncio.run(worker())
    else:
        raise SystemExit(main())
