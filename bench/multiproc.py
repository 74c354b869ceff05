"""Locks shared between processes, on one contended key, side by side.

    python -m bench.multiproc [--repeats 3] [--quick] [--json out.json]

Each run starts one contender's worker processes (bench/mp_worker.py), each
in a fresh interpreter; once all are set up they are released together and
each takes the lock on one key again and again for a fixed wall time,
recording when it arrived, was granted and released every op. The records
are merged into the metrics of bench/mp_metrics.py.

Scenarios:

- (f1) every worker on one key, nothing outside the lock: the lock is
  always wanted, so its hand-off is the whole story;
- (f2) the same with 1 ms of work outside the lock between two ops
  (``time.sleep`` for sync contenders, ``asyncio.sleep`` for async ones).

Contenders are interleaved (each repeat runs all of them, in a rotated
order) and every number is the median of the repeats, so that a noisy
neighbour on a shared machine hits all contenders alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script: python bench/multiproc.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .mp_contenders import CONTENDERS, DEFAULT
from .mp_metrics import METRICS, measure_run
from .mp_worker import read_counter

#: The contender the targets are about.
SUBJECT = "inturn-file"
#: Its targets: arrival order (%) at least, longest wait (ms) at most, and
#: ops/s at least these multiples of each baseline's, measured in the same run.
MIN_ORDER_PCT = 99.0
MAX_WAIT_MS = 10.0
BASELINES: dict[str, float] = {"filelock": 3.0, "portalocker": 0.8}
KEY = "k"
ROOT = Path(__file__).resolve().parent.parent
#: Seconds a worker may take past the deadline to finish and report (a hung lock fails the run).
GRACE = 60.0


@dataclass(frozen=True)
class Scenario:
    """A way of running the workers: how long each works outside the lock between ops."""

    name: str
    title: str
    outside: float


SCENARIOS = (
    Scenario("f1", "one key, nothing outside the lock", 0.0),
    Scenario("f2", "one key, 1 ms outside the lock", 0.001),
)


@dataclass
class Settings:
    """How much to measure: workers per run, seconds per run, repeats, contenders."""

    workers: int = 8
    seconds: float = 2.0
    repeats: int = 3
    contenders: list[str] = field(default_factory=lambda: list(DEFAULT))

    @classmethod
    def make(cls, quick: bool, repeats: int = 3) -> Settings:
        """The default settings, or with quick those of a smoke test (0.5 s runs)."""
        return cls(seconds=0.5 if quick else 2.0, repeats=repeats)


Log = Callable[[str], None]


def _spawn(config: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return subprocess.Popen(
        [sys.executable, "-m", "bench.mp_worker", json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
        text=True,
    )


def _line(pipe: IO[str] | None, what: str) -> str:
    assert pipe is not None
    line = pipe.readline()
    if not line:
        raise RuntimeError(f"a worker exited before it sent {what} (see its stderr above)")
    return line


def _release(workers: Sequence[subprocess.Popen[str]], seconds: float) -> int:
    """Send every worker the deadline, at once; return the start, in monotonic ns."""
    start = time.monotonic_ns()
    deadline = start + int(seconds * 1e9)
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write(f"{deadline}\n")
        worker.stdin.flush()
    return start


def _records(worker: subprocess.Popen[str], contender: str, timeout: float) -> Any:
    """A worker's records, once it has exited (after timeout seconds at most)."""
    out, _ = worker.communicate(timeout=timeout)
    if worker.returncode != 0 or not out:
        raise RuntimeError(f"a {contender} worker exited with {worker.returncode} (see above)")
    return json.loads(out)


def run_once(contender: str, scenario: Scenario, settings: Settings) -> dict[str, float]:
    """Start the workers of one run, release them together, and measure their records."""
    with tempfile.TemporaryDirectory(prefix="inturn-bench-") as directory:
        workdir = Path(directory)
        config = {
            "contender": contender,
            "workdir": str(workdir),
            "key": KEY,
            "outside": scenario.outside,
        }
        workers = [_spawn(config) for _ in range(settings.workers)]
        try:
            for worker in workers:
                _line(worker.stdout, "ready")
            start = _release(workers, settings.seconds)
            records = [_records(worker, contender, settings.seconds + GRACE) for worker in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        counter = read_counter(workdir)
    return measure_run(records, start, counter)


def runnable(names: Sequence[str], log: Log) -> list[str]:
    """The contenders of names that can run here; say why the others cannot."""
    kept = []
    for name in names:
        reason = CONTENDERS[name]().available()
        if reason is None:
            kept.append(name)
        else:
            log(f"multiproc: skipping {name}: {reason}")
    return kept


def _rotated(items: Sequence[str], by: int) -> list[str]:
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure(settings: Settings, log: Log) -> dict[str, Any]:
    """Run every scenario for every contender, interleaved; the medians and targets.

    The answer is what ``--json`` writes: ``settings``, ``runs`` (every
    repeat's metrics), ``medians`` (scenario -> contender -> metric) and
    ``targets``.
    """
    names = runnable(settings.contenders, log)
    runs: dict[str, dict[str, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(settings.repeats):
        log(f"multiproc: repeat {repeat + 1}/{settings.repeats}")
        for scenario in SCENARIOS:
            for name in _rotated(names, repeat):
                runs[scenario.name][name].append(run_once(name, scenario, settings))
    medians = {
        scenario: {name: _median(samples) for name, samples in by_name.items()}
        for scenario, by_name in runs.items()
    }
    return {
        "machine": machine(),
        "settings": asdict(settings),
        "metrics": METRICS,
        "runs": runs,
        "medians": medians,
        "targets": [
            {"target": label, "pass": ok, "value": value} for label, ok, value in targets(medians)
        ],
    }


def _median(samples: list[dict[str, float]]) -> dict[str, float]:
    return {metric: statistics.median(run[metric] for run in samples) for metric in samples[0]}


#: How each metric is shown: its row label and the format of its value.
ROWS: dict[str, tuple[str, str]] = {
    "ops_per_s": ("ops/s", "{:,.0f}"),
    "handoff_p50_us": ("hand-off p50 (µs)", "{:,.0f}"),
    "handoff_p99_us": ("hand-off p99 (µs)", "{:,.0f}"),
    "arrival_order_pct": ("arrival order (%)", "{:.1f}"),
    "fairness": ("fairness (min/max ops per worker)", "{:.2f}"),
    "longest_wait_ms": ("longest wait (ms)", "{:,.1f}"),
    "lost_updates": ("lost updates", "{:.0f}"),
}


def _ratio_row(values: dict[str, dict[str, float]], names: list[str], baseline: str) -> str:
    base = values[baseline]["ops_per_s"]
    cells = [f"{values[name]['ops_per_s'] / base:.2f}x" if base else "-" for name in names]
    return f"| ops/s, x {baseline} | " + " | ".join(cells) + " |"


def table(medians: dict[str, dict[str, dict[str, float]]], settings: Settings) -> str:
    """One Markdown table per scenario: a row per metric, a column per contender."""
    parts = []
    for scenario in SCENARIOS:
        values = medians.get(scenario.name, {})
        names = list(values)
        if not names:
            continue
        lines = [
            f"### ({scenario.name}) {settings.workers} processes, {scenario.title}\n",
            "| metric | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for metric, (label, form) in ROWS.items():
            cells = [form.format(values[name][metric]) for name in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            if metric == "ops_per_s":
                lines.extend(_ratio_row(values, names, b) for b in BASELINES if b in values)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def targets(medians: dict[str, dict[str, dict[str, float]]]) -> list[tuple[str, bool | None, str]]:
    """The targets for inturn-file, per scenario: (label, passed or None if not measured, value)."""
    results: list[tuple[str, bool | None, str]] = []
    for scenario in SCENARIOS:
        values = medians.get(scenario.name, {})
        tag = f"({scenario.name})"
        subject = values.get(SUBJECT)
        if subject is None:
            continue
        order, wait = subject["arrival_order_pct"], subject["longest_wait_ms"]
        label = f"{tag} {SUBJECT} arrival order >= {MIN_ORDER_PCT:g}%"
        results.append((label, order >= MIN_ORDER_PCT, f"{order:.1f}%"))
        label = f"{tag} {SUBJECT} longest wait <= {MAX_WAIT_MS:g} ms"
        results.append((label, wait <= MAX_WAIT_MS, f"{wait:.1f} ms"))
        for baseline, floor in BASELINES.items():
            label = f"{tag} {SUBJECT} ops/s >= {floor:g}x {baseline}"
            other = values.get(baseline)
            if other is None:
                results.append((label, None, "not measured"))
                continue
            ratio = subject["ops_per_s"] / other["ops_per_s"]
            results.append((label, ratio >= floor, f"{ratio:.2f}x"))
    return results


def report(result: dict[str, Any]) -> str:
    """The Markdown of a measure() result: the tables, the targets, what the metrics mean."""
    settings = Settings(**result["settings"])
    lines = [
        f"## Across processes: {result['machine']}, "
        f"{settings.workers} workers x {settings.seconds:g} s, median of {settings.repeats}\n",
        table(result["medians"], settings),
        "\nTargets (multi-process):\n",
    ]
    for target in result["targets"]:
        verdict = {True: "PASS", False: "MISS", None: "SKIP"}[target["pass"]]
        lines.append(f"- {verdict} {target['target']}: {target['value']}")
    if not result["targets"]:
        lines.append(f"- none: {SUBJECT} was not measured")
    lines.append("\nMetrics:\n")
    lines.extend(f"- {ROWS[metric][0]}: {meaning}" for metric, meaning in METRICS.items())
    return "\n".join(lines)


def machine() -> str:
    return (
        f"CPython {platform.python_version()} on {platform.machine()} "
        f"({os.cpu_count()} cores), {platform.system()} {platform.release()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.multiproc", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (median)")
    parser.add_argument("--quick", action="store_true", help="0.5 s runs: a smoke test")
    parser.add_argument("--seconds", type=float, default=None, help="wall time of each run")
    parser.add_argument("--workers", type=int, default=8, help="processes per run")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT),
        help=f"comma-separated, of: {', '.join(CONTENDERS)}",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    options = parser.parse_args(argv)
    settings = Settings.make(options.quick, options.repeats)
    settings.workers = options.workers
    if options.seconds is not None:
        settings.seconds = options.seconds
    settings.contenders = [name.strip() for name in options.contenders.split(",") if name.strip()]
    unknown = [name for name in settings.contenders if name not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders: {', '.join(unknown)}")

    def log(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = measure(settings, log)
    print(report(result))
    log(f"multiproc: done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
