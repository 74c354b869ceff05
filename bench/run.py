"""Run every scenario for every contender in one process, and report ratios.

    python -m bench [--repeats 3] [--json bench/results.json] [--plot out.png] [--quick]
                    [--no-threads] [--no-latest] [--no-multiproc]

Contenders are interleaved (each repeat runs all of them, in a rotated
order) and every number is the median of the repeats, so that a noisy
neighbour on a shared machine hits all contenders alike. Ratios are to the
hand-written dict of asyncio.Lock, measured in the same run.

Scenario (e) reports whole costs per task, with no floor subtracted: one
key with 1,000, 10,000 and 100,000 tasks queued, each length timed over
100,000 tasks in all (100 runs of 1,000, ...), and each contender's ratio of
its cost at the longest queue to its cost at the shortest. A timing of a
whole run is positive, so noise can move that ratio but not flip its sign.

Then scenario (g), bench/flow.py: a batch of keyed messages on a queue
with max_running, beside a hand-written lock and semaphore.

Then, unless ``--no-threads``, scenario (t), bench/threads.py: sync turns
taken from threads, beside a hand-written dict of threading.Lock.

Then scenario (u), bench/turns.py (alone: ``python -m bench.turns``): one
uncontended turn of each shape (``run``, ``keyed``, the decorator, two keys,
``max_hold``, an observer, ``max_running`` with a timeout, and from threads
unless ``--no-threads``), as ratios to the hand-written lock; with
``--before``, also on that revision's inturn.

Then, unless ``--no-latest``, scenario (w), bench/latest.py (alone:
``python -m bench.latest``): a burst of 1,000 submissions on one busy key,
on ``KeyedQueue()`` beside ``KeyedQueue(pending="latest")`` (issue 32) and a
hand-written lock that skips stale callers: the works run, the time of the
burst and the memory it holds, as ratios to ``KeyedQueue()``; and (w2), the
uncontended turns of (u) on the latest queue over the default one.

Then the targets (bench/targets.py): each PASS or MISS, SKIP when its
contenders were not measured (the ``--before`` revision's, without it).

Then, unless ``--no-multiproc``, the multi-process part (bench/multiproc.py):
locks shared between worker processes on one contended key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from . import flow, latest, multiproc, scenarios, threads, turns
from .contenders import ALL, Contender, InturnSlots, at_version
from .targets import Rows, Target, at_most, cell, evaluate, ratio, valid

BASELINE = "handwritten"
FLOOR = "bare"


class Sizes:
    def __init__(self, quick: bool) -> None:
        scale = 20 if quick else 1
        self.sequential = 200_000 // scale
        self.one_key = 100_000 // scale
        self.many_keys = (1_000 // (scale if quick else 1), 100 // (5 if quick else 1))
        self.memory_keys = 10_000 // scale
        self.scaling = [1_000, 10_000, 100_000] if not quick else [500, 1_000, 5_000]
        #: (e): tasks timed at every queue length, in runs of that length, so that the
        #: shortest queue's figure averages as many hand-offs as the longest's.
        self.scaling_tasks = self.scaling[-1]

    def scaling_runs(self, queued: int) -> int:
        """(e): how many runs of ``queued`` tasks make up ``scaling_tasks``."""
        return max(1, self.scaling_tasks // queued)


def _rotated(items: Sequence[Contender], by: int) -> list[Contender]:
    by %= len(items)
    return [*items[by:], *items[:by]]


async def measure(
    sizes: Sizes, repeats: int, log: Callable[[str], None], kinds: Sequence[type[Contender]]
) -> dict[str, Any]:
    contenders = [cls() for cls in kinds]
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(repeats):
        log(f"repeat {repeat + 1}/{repeats}")
        for contender in _rotated(contenders, repeat):
            name = contender.name
            samples["a"][name].append(await scenarios.sequential(contender, sizes.sequential))
            samples["b"][name].append(
                await scenarios.gathered(contender, 1, sizes.one_key, verify=True)
            )
            keys, per_key = sizes.many_keys
            samples["c"][name].append(
                await scenarios.gathered(contender, keys, per_key, verify=True)
            )
            for n in sizes.scaling:
                runs = [
                    await scenarios.gathered(contender, 1, n, verify=False)
                    for _ in range(sizes.scaling_runs(n))
                ]
                samples[f"e{n}"][name].append(statistics.fmean(runs))
            for field, value in (await scenarios.memory(contender, sizes.memory_keys)).items():
                samples[f"d_{field}"][name].append(value)
            floor = await scenarios.memory(contender, sizes.memory_keys, through=True)
            samples["d_through_bytes"][name].append(floor["in_flight_bytes"])
    return {
        scenario: {name: statistics.median(values) for name, values in by_name.items()}
        for scenario, by_name in samples.items()
    }


def _above_floor(medians: dict[str, Any], scenario: str) -> dict[str, float]:
    floor = medians[scenario][FLOOR]
    return {name: value - floor for name, value in medians[scenario].items()}


def derive(medians: dict[str, Any], sizes: Sizes) -> dict[str, dict[str, float]]:
    """The reported rows: costs above the bare floor, per call, task or key; (e) whole costs."""
    rows: dict[str, dict[str, float]] = {}
    rows["(a) ns/call above bare, uncontended"] = _above_floor(medians, "a")
    rows["(b) ns/task above bare, one key"] = _above_floor(medians, "b")
    rows["(c) ns/task above bare, 1,000 keys"] = _above_floor(medians, "c")
    in_flight = medians["d_in_flight_bytes"]
    rows["(d) bookkeeping bytes per in-flight key"] = {
        name: (value - medians["d_through_bytes"][name]) / sizes.memory_keys
        for name, value in in_flight.items()
    }
    rows["(d) bytes per in-flight key, whole call"] = {
        name: value / sizes.memory_keys
        for name, value in _above_floor(medians, "d_in_flight_bytes").items()
    }
    rows["(d) bytes retained when idle"] = _above_floor(medians, "d_retained_bytes")
    rows["(d) bytes grown by a 2nd wave"] = _above_floor(medians, "d_growth_bytes")
    rows["(d) keys kept when idle"] = dict(medians["d_keys_kept"])
    # (e) reports whole costs, not costs above bare: each is a timing of at
    # least one task, so positive, and so is their ratio, whatever the noise.
    for n in sizes.scaling:
        rows[scaling_label(n)] = dict(medians[f"e{n}"])
    first, last = sizes.scaling[0], sizes.scaling[-1]
    rows[scaling_ratio_label(sizes)] = {
        name: ratio(value, medians[f"e{first}"].get(name))
        for name, value in medians[f"e{last}"].items()
    }
    return rows


def scaling_label(queued: int) -> str:
    return f"(e) ns/task, {queued:,} queued"


def scaling_ratio_label(sizes: Sizes) -> str:
    first, last = sizes.scaling[0], sizes.scaling[-1]
    return f"(e) ratio of ns/task, {last:,} queued / {first:,} queued"


A = "(a) ns/call above bare, uncontended"
B = "(b) ns/task above bare, one key"
C = "(c) ns/task above bare, 1,000 keys"
D_PER_KEY = "(d) bookkeeping bytes per in-flight key"
D_GROWTH = "(d) bytes grown by a 2nd wave"
D_KEPT = "(d) keys kept when idle"
RUN, KEYED, DECORATED, SLOTTED = "inturn.run", "inturn.keyed", "@queue_by_key", InturnSlots.name
#: "No worse than --before": the bound on this tree's cost over the earlier revision's,
#: with 5% for a shared machine's noise between two interleaved medians.
NO_WORSE = 1.05


def _own(row: str, name: str, label: str, limit: float, **options: Any) -> Target:
    """name's own row figure, at most limit."""
    return Target(label, (name,), lambda rows: cell(rows, row, name), limit, **options)


def target_table(sizes: Sizes, flow_sizes: flow.Sizes, before: str | None) -> list[Target]:
    """Every target of the Benchmark issue and issues 17, 29 and 32, in the order they are printed.

    Targets against the inturn of ``--before`` are SKIP without it.
    """
    first, last = sizes.scaling[0], sizes.scaling[-1]
    table = [
        # asyncio.current_task() is in C from CPython 3.12: before it, reported only.
        at_most(A, RUN, 0.5, BASELINE, since=(3, 12)),
        at_most(A, KEYED, 1.2, BASELINE),
        at_most(A, DECORATED, 1.5, BASELINE),
        at_most(A, SLOTTED, 2.0, RUN),
        at_most(B, SLOTTED, 2.0, RUN),
        at_most(B, RUN, 0.95, BASELINE),
        at_most(C, RUN, 0.95, BASELINE),
        _own(D_PER_KEY, RUN, "(d) inturn <= 150 B per in-flight key", 150.0, form="{:,.0f} B"),
        # Memory may shrink between two waves: a negative growth is a measure,
        # not noise. The allocator moves a few hundred bytes from wave to wave
        # (the hand-written lock's too); a growth with the keys is 1 B per key
        # of the wave or more (a dict that keeps its keys: 64 B per key).
        _own(
            D_GROWTH,
            RUN,
            f"(d) inturn: no growth with the {sizes.memory_keys:,} keys of a 2nd wave (<= 1 B/key)",
            float(sizes.memory_keys),
            signed=True,
            form="{:,.0f} B",
        ),
        _own(D_KEPT, RUN, "(d) inturn: no keys kept", 0.0, form="{:,.0f}"),
        _own(
            scaling_ratio_label(sizes),
            RUN,
            f"(e) inturn.run at {last:,} queued <= 1.2x at {first:,} (ns/task, whole)",
            1.2,
        ),
    ]
    ref = before or "--before"
    for row, what in ((B, ""), (C, ""), (scaling_label(last), f", {last:,} queued")):
        for name in (RUN, KEYED, DECORATED):
            earlier = f"{name}@{ref}"
            label = f"{row[:3]} {name} <= {NO_WORSE:g}x {earlier}{what}"
            table.append(at_most(row, name, NO_WORSE, earlier, label=label))
    batch, backpressure, bound = "inturn.batch", "handwritten+backpressure", 4 * flow.SLOTS
    distributions = list(flow.distributions(flow_sizes))
    table.extend(
        at_most(
            f"(g) ns/message, {label}",
            batch,
            1.2,
            backpressure,
            label=f"(g) {batch} <= 1.2x {backpressure} per message, {label}",
        )
        for label in distributions
    )
    table.extend(
        _own(
            f"(g) peak tasks alive, {label}",
            batch,
            f"(g) {batch} peak tasks alive <= {bound} (4x max_running), {label}",
            bound,
            form="{:,.0f}",
        )
        for label in distributions
    )
    table.extend(turns.target_table())
    table.extend(latest.target_table())
    return table


def targets(
    rows: Rows,
    measured: Sequence[str],
    sizes: Sizes,
    flow_sizes: flow.Sizes,
    before: str | None = None,
) -> list[tuple[str, str, str]]:
    """(verdict, label, value) of every target, on this run's rows (in process, (g), (u), (w))."""
    return [evaluate(target, rows, measured) for target in target_table(sizes, flow_sizes, before)]


def versus(rows: dict[str, dict[str, float]], ref: str) -> str:
    """Each inturn contender's time as a ratio to the same contender at git revision ref."""
    names = ["inturn.run", "inturn.keyed", "@queue_by_key"]
    lines = ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, values in rows.items():
        if not label.startswith(("(a)", "(b)", "(c)", "(e)")):
            continue
        quotients = [ratio(values[n], values[f"{n}@{ref}"]) for n in names]
        cells = [f"{q:.2f}x" if valid(q) else "-" for q in quotients]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float, baseline: float, relative: bool) -> str:
    text = f"{value:,.0f}"
    if relative and baseline:
        text += f" ({value / baseline:.2f}x)"
    return text


def _is_ratio(label: str) -> bool:
    """Whether the row's figures are already ratios (each contender's to itself)."""
    return label.startswith("(e) ratio")


def table(rows: dict[str, dict[str, float]], names: list[str]) -> str:
    lines = [
        "| scenario | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label, values in rows.items():
        if _is_ratio(label):
            cells = [f"{values[name]:.2f}x" if valid(values[name]) else "-" for name in names]
        else:
            relative = "keys kept" not in label and "grown" not in label
            cells = [_cell(values[name], values[BASELINE], relative) for name in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, float]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    shown = [
        label
        for label in rows
        if "kept" not in label and "grown" not in label and not _is_ratio(label)
    ]
    contenders = [n for n in names if n not in (FLOOR, "wrapt (empty)")]
    fig, ax = plt.subplots(figsize=(12, 6))
    width = 0.8 / len(contenders)
    for i, name in enumerate(contenders):
        ratios = [
            rows[label][name] / rows[label][BASELINE] if rows[label][BASELINE] else 0
            for label in shown
        ]
        ax.bar([x + i * width for x in range(len(shown))], ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shown))])
    ax.set_xticklabels([label.split(" ", 1)[1] for label in shown], rotation=30, ha="right")
    ax.set_ylabel("x handwritten (lower is better)")
    ax.set_yscale("log")
    # ratios read as ratios (0.5x, 2x), not as powers of ten
    ax.set_yticks([0.25, 0.5, 1, 2, 4, 8])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title("inturn and alternatives, as ratios to a hand-written dict of asyncio.Lock")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def machine() -> str:
    import os

    return (
        f"CPython {platform.python_version()} on {platform.machine()} "
        f"({os.cpu_count()} cores), {platform.system()} {platform.release()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1/20 of the sizes, 0.5 s multi-process runs: a smoke test",
    )
    parser.add_argument("--json", type=Path, default=None, help="write raw medians and rows here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the ratios to this PNG")
    parser.add_argument(
        "--threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure sync turns from threads (bench/threads.py)",
    )
    parser.add_argument(
        "--latest",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a burst on one busy key with pending='latest' (bench/latest.py)",
    )
    parser.add_argument(
        "--multiproc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure locks shared between processes (bench/multiproc.py)",
    )
    parser.add_argument(
        "--before",
        metavar="GIT_REF",
        default=None,
        help="also measure inturn as it was at this git revision, beside this tree's",
    )
    options = parser.parse_args(argv)
    sizes = Sizes(options.quick)
    kinds = [*ALL, *(at_version(options.before) if options.before else ())]
    names = [cls.name for cls in kinds]

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    medians = asyncio.run(measure(sizes, options.repeats, log, kinds))
    rows = derive(medians, sizes)
    print(f"## In process: {machine()}, median of {options.repeats}\n")
    print(table(rows, names))
    if options.before:
        print(f"\nThis tree against {options.before} (same run; below 1.00x is faster now):\n")
        print(versus(rows, options.before))
    flow_sizes = flow.Sizes(options.quick)
    flow_medians = asyncio.run(flow.measure(flow_sizes, options.repeats, log))
    flow_rows = flow.derive(flow_medians, flow_sizes)
    print(f"\n## {flow.title(flow_sizes)}: {machine()}, median of {options.repeats}\n")
    print(table(flow_rows, flow.NAMES))
    thread_result = None
    if options.threads:
        thread_sizes = threads.Sizes(options.quick)
        thread_medians = threads.measure(thread_sizes, options.repeats, log)
        thread_rows = threads.derive(thread_medians, thread_sizes)
        thread_result = {"medians": thread_medians, "rows": thread_rows}
        print(f"\n## {threads.title(thread_sizes)}: {machine()}, median of {options.repeats}\n")
        print(threads.table(thread_rows, thread_sizes))
    turn_kinds = turns.kinds(options.before, with_threads=options.threads)
    turn_medians = turns.measure(turns.Sizes(options.quick), options.repeats, log, turn_kinds)
    turn_rows = turns.derive(turn_medians)
    print(f"\n## {turns.TITLE}: {machine()}, median of {options.repeats}\n")
    print(turns.table(turn_rows, options.before))
    latest_result, latest_rows, latest_names = None, {}, []
    if options.latest:
        latest_sizes = latest.Sizes(options.quick)
        latest_kinds = latest.kinds(options.before)
        latest_medians = asyncio.run(
            latest.measure(latest_sizes, options.repeats, log, latest_kinds)
        )
        latest_rows = latest.derive(latest_medians, latest_sizes)
        latest_names = latest.measured(latest_medians, latest_kinds)
        latest_result = {"medians": latest_medians, "rows": latest_rows}
        print(f"\n## {latest.title(latest_sizes)}: {machine()}, median of {options.repeats}\n")
        print(latest.table(latest_rows, latest_names))
        print(f"\n{latest.uncontended_table(turn_rows)}")
    print(
        "\nTargets (the Benchmark issue's, issues 17, 29 and 32; SKIP: not measured in this run):\n"
    )
    results = targets(
        {**rows, **flow_rows, **turn_rows, **latest_rows},
        [*names, *flow.NAMES, *turn_medians, *latest_names],
        sizes,
        flow_sizes,
        options.before,
    )
    for verdict, label, value in results:
        print(f"- {verdict} {label}: {value}")
    across = None
    if options.multiproc:
        settings = multiproc.Settings.make(options.quick, options.repeats)
        settings.before = options.before
        across = multiproc.measure(settings, log)
        print("\n" + multiproc.report(across))
    log(f"done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "repeats": options.repeats,
                    "quick": options.quick,
                    "medians": medians,
                    "rows": rows,
                    "targets": [
                        {"target": label, "verdict": verdict, "value": value}
                        for verdict, label, value in results
                    ],
                    "flow": {"medians": flow_medians, "rows": flow_rows},
                    "threads": thread_result,
                    "turns": {"medians": turn_medians, "rows": turn_rows},
                    "latest": latest_result,
                    "multiproc": across,
                },
                indent=2,
            )
        )
    if options.plot:
        plot(rows, names, options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
