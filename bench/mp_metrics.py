"""The metrics of one multi-process run, from the records of every worker merged.

Each worker records, for each op (one turn on the lock), three
``time.monotonic_ns()`` readings (one clock for every process of a Linux
host): *arrival* (just before it asks for the lock), *grant* (first thing
once it holds it) and *release* (last thing before it lets go). Merged and
sorted by grant time, the ops of a run are the history of the lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ("METRICS", "Op", "measure_run", "merge")


@dataclass(frozen=True)
class Op:
    """One turn on the lock, by one worker."""

    worker: int
    arrival: int
    grant: int
    release: int


#: Each metric's name, in table order, and what it means.
METRICS: dict[str, str] = {
    "ops_per_s": "ops per second, all workers together, from the go to the last release",
    "handoff_p50_us": (
        "median hand-off, in µs: for each grant made while an op was waiting at "
        "the previous release, that grant's time minus the previous release's "
        "(the lock's dead time between two holders, the release call included)"
    ),
    "handoff_p99_us": "99th percentile of the same hand-offs, in µs",
    "arrival_order_pct": (
        "of the grants made while another op was waiting, the share (%) given "
        "to the op that had arrived first: no op that arrived earlier was still "
        "waiting"
    ),
    "fairness": "ops of the worker with fewest divided by those of the one with most",
    "longest_wait_ms": "the longest wait of any op, grant minus arrival, in ms",
    "lost_updates": "ops whose counter increment was lost: ops minus the counter's final value",
    "cpu_us_per_op": (
        "CPU time of the worker processes per op, in µs (user and system, every thread, from "
        "the go to the last op): what a turn costs the client machine, steadier than wall "
        "time on a shared one (a server's own CPU is not counted)"
    ),
}


def merge(records: Sequence[dict[str, list[int]]]) -> list[Op]:
    """Every worker's ops in one list, sorted by grant time."""
    ops = [
        Op(worker, arrival, grant, release)
        for worker, record in enumerate(records)
        for arrival, grant, release in zip(
            record["arrivals"], record["grants"], record["releases"], strict=True
        )
    ]
    ops.sort(key=lambda op: op.grant)
    return ops


def _percentile(values: Sequence[int], fraction: float) -> float:
    """The nearest-rank percentile of values (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(fraction * len(ordered)) - 1)])


def _earliest_from(ops: Sequence[Op]) -> list[float]:
    """For each index i, the earliest arrival among ops[i:] (inf past the end)."""
    earliest = [math.inf] * (len(ops) + 1)
    for i in range(len(ops) - 1, -1, -1):
        earliest[i] = min(earliest[i + 1], ops[i].arrival)
    return earliest


def handoffs(ops: Sequence[Op], earliest: Sequence[float]) -> list[int]:
    """The hand-offs, in ns: grant minus the previous release, where an op was waiting.

    A grant counts if, at the previous op's release, some op granted later
    (this one or another) had already arrived: the lock was wanted, so the
    gap is the cost of handing it on, not idleness.
    """
    return [
        ops[i].grant - ops[i - 1].release
        for i in range(1, len(ops))
        if earliest[i] <= ops[i - 1].release
    ]


def arrival_order(ops: Sequence[Op], earliest: Sequence[float]) -> tuple[int, int]:
    """(grants in arrival order, grants that had a choice).

    A grant had a choice if some op granted later had already arrived when it
    was made; it was in order if none of those had arrived before it.
    """
    chosen = in_order = 0
    for i, op in enumerate(ops):
        waiting_since = earliest[i + 1]
        if waiting_since < op.grant:
            chosen += 1
            if op.arrival <= waiting_since:
                in_order += 1
    return in_order, chosen


def fairness(ops: Sequence[Op], workers: int) -> float:
    """Ops of the worker with fewest over those of the one with most (1.0 is even)."""
    counts = [0] * workers
    for op in ops:
        counts[op.worker] += 1
    return min(counts) / max(counts) if max(counts) else 0.0


def measure_run(
    records: Sequence[dict[str, list[int]]], start_ns: int, counter: int
) -> dict[str, float]:
    """Every metric of :data:`METRICS` for one run.

    :param records: each worker's records, as bench/mp_worker.py prints them.
    :param start_ns: when the workers were released, in ``time.monotonic_ns()``.
    :param counter: the shared counter's final value.
    """
    ops = merge(records)
    if not ops:
        raise ValueError("no worker took the lock even once")
    earliest = _earliest_from(ops)
    gaps = handoffs(ops, earliest)
    in_order, chosen = arrival_order(ops, earliest)
    elapsed = max(op.release for op in ops) - start_ns
    return {
        "ops_per_s": len(ops) / (elapsed / 1e9),
        "handoff_p50_us": _percentile(gaps, 0.50) / 1e3,
        "handoff_p99_us": _percentile(gaps, 0.99) / 1e3,
        "arrival_order_pct": 100.0 * in_order / chosen if chosen else 100.0,
        "fairness": fairness(ops, len(records)),
        "longest_wait_ms": max(op.grant - op.arrival for op in ops) / 1e6,
        "lost_updates": float(len(ops) - counter),
        "cpu_us_per_op": sum(sum(record.get("cpu_ns", ())) for record in records) / len(ops) / 1e3,
    }
