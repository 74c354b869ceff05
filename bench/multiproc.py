"""Locks shared between processes, on one contended key, side by side.

    python -m bench.multiproc [--repeats 3] [--quick] [--only file|redis|postgres|sync|...]
                              [--scenarios f1,r1,...] [--before REF] [--json out.json]
                              [--plot out.png] [--from-json out.json]

Each run starts one contender's worker processes (bench/mp_worker.py), each
in a fresh interpreter; once all are set up they are released together and
each takes the lock on one key again and again for a fixed wall time,
recording when it arrived, was granted and released every op. The records
are merged into the metrics of bench/mp_metrics.py.

Scenarios, file locks (processes of one host):

- (f1) every worker on one key, nothing outside the lock: the lock is
  always wanted, so its hand-off is the whole story;
- (f2) the same with 1 ms of work outside the lock between two ops
  (``time.sleep`` for sync contenders, ``asyncio.sleep`` for async ones).

Scenarios, Redis locks (bench/mp_servers.py finds or starts the server; the
critical section is still the counter file, which is fine on one host):

- (r1) and (r2): as (f1) and (f2);
- (r3) one process alone on the key: the cost of an uncontended turn.

Scenarios, sync turns (``--only sync``): inturn's ``with queue.keyed(key):``
from plain code, no event loop, beside the sync locks users write for the
same store, and beside inturn's own ``async with`` for reference:

- (s1) 4 processes on one key, on files: inturn's FileBackend, ``filelock``;
- (s2) one process alone on the key, on files: the uncontended turn;
- (s3) and (s4): the same on Redis: inturn's RedisBackend, redis-py's
  ``r.lock(name, timeout=..., blocking_timeout=...)``;
- (s5) and (s6): the same on PostgreSQL: inturn's PostgresBackend, the
  hand-written ``pg_advisory_lock`` loop on a sync psycopg connection.

Scenarios, PostgreSQL locks (``--only postgres``; bench/mp_pg.py finds or
starts the server): inturn's PostgresBackend beside the hand-written loop a
user writes today, ``SELECT pg_advisory_lock(id)`` ... ``SELECT
pg_advisory_unlock(id)`` on one autocommit connection per process, whose
FIFO and hand-off are the server's own:

- (p1) and (p2): as (f1) and (f2);
- (p3) one process alone on the key: the cost of an uncontended turn.

A contender that fails before its workers are ready (its set-up, or its
first turn on a key of its own, raised) is left out of the rest of the run,
and the report says why; a failure after that fails the run.

Contenders are interleaved (each repeat runs all of them, in a rotated
order) and every number is the median of the repeats, so that a noisy
neighbour on a shared machine hits all contenders alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

if __package__ in (None, ""):  # run as a script: python bench/multiproc.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .contenders import extract_version
from .mp_contenders import CONTENDERS, DEFAULT, VERSIONED, contender
from .mp_metrics import METRICS, measure_run
from .mp_pg import postgres_server
from .mp_plot import loaded, plot
from .mp_servers import redis_server
from .mp_worker import UNAVAILABLE, read_counter
from .targets import check, ratio

KEY = "k"
ROOT = Path(__file__).resolve().parent.parent
#: Seconds a worker may take past the deadline to finish and report (a hung lock fails the run).
GRACE = 60.0


@dataclass(frozen=True)
class Scenario:
    """A way of running the workers, which contenders run in it, and the subject's targets.

    The targets are about ``subject``: ops/s at least each factor of
    ``min_ops`` times that baseline's (measured in the same run), then the
    bounds that are set (None: no target).
    """

    name: str
    title: str
    #: Seconds each worker works outside the lock between two ops.
    outside: float
    #: The contenders that run in it: those of this kind (and of kind "any").
    kind: str = "file"
    #: Worker processes; None: as many as the settings say.
    workers: int | None = None
    subject: str = "inturn-file"
    #: The table's ratio rows: ops/s divided by each of these contenders'.
    ratios: tuple[str, ...] = ()
    min_ops: tuple[tuple[str, float], ...] = ()
    min_order_pct: float | None = None
    min_fairness: float | None = None
    max_handoff_ms: float | None = None
    max_wait_ms: float | None = None
    #: (baseline, factor): hand-off p50 at most factor times the baseline's.
    max_handoff_x: tuple[str, float] | None = None
    #: (baseline, points): arrival order at least the baseline's, less points.
    min_order_of: tuple[str, float] | None = None

    def processes(self, settings: Settings) -> int:
        return self.workers if self.workers is not None else settings.workers

    @property
    def on_redis(self) -> bool:
        """Whether its contenders need the Redis server."""
        return self.kind in REDIS_KINDS

    @property
    def on_postgres(self) -> bool:
        """Whether its contenders need the PostgreSQL server."""
        return self.kind in POSTGRES_KINDS


_FILE: dict[str, Any] = {
    "kind": "file",
    "subject": "inturn-file",
    "ratios": ("filelock", "portalocker"),
    "min_ops": (("filelock", 3.0), ("portalocker", 0.8)),
    "min_order_pct": 99.0,
    "max_wait_ms": 10.0,
}
_REDIS: dict[str, Any] = {
    "kind": "redis",
    "subject": "inturn-redis",
    "ratios": ("redis-py-lock", "python-redis-lock"),
}

_SYNC_FILE: dict[str, Any] = {
    "kind": "sync-file",
    "subject": "inturn-file-sync",
    "ratios": ("filelock", "inturn-file", "file-fifo-floor"),
}
_SYNC_REDIS: dict[str, Any] = {
    "kind": "sync-redis",
    "subject": "inturn-redis-sync",
    "ratios": ("redis-py-lock-lease", "inturn-redis", "redis-fifo-floor"),
}
_POSTGRES: dict[str, Any] = {
    "kind": "postgres",
    "subject": "inturn-postgres",
    "ratios": ("pg-advisory-lock",),
}
#: Issue 20's targets for the backend (its ops/s raised by issue 45): the hand-written
#: loop's ops/s (0.95x) with its FIFO, and a hand-off p50 within 1.5x the server's (the
#: loop's). The loop's order is the server's queue; the slack is for arrivals a few µs
#: apart, which the clients stamp before their requests reach that queue.
_POSTGRES_TARGETS: dict[str, Any] = {
    "min_ops": (("pg-advisory-lock", 0.95),),
    "min_order_of": ("pg-advisory-lock", 1.0),
    "max_handoff_x": ("pg-advisory-lock", 1.5),
}
_SYNC_POSTGRES: dict[str, Any] = {
    "kind": "sync-postgres",
    "subject": "inturn-postgres-sync",
    "ratios": ("pg-advisory-lock-sync", "inturn-postgres"),
}
#: Processes on the one key of (s1), (s3) and (s5).
SYNC_WORKERS = 4

SCENARIOS = (
    Scenario("f1", "one key, nothing outside the lock", 0.0, **_FILE),
    Scenario("f2", "one key, 1 ms outside the lock", 0.001, **_FILE),
    Scenario(
        "r1",
        "one key on Redis, nothing outside the lock",
        0.0,
        **_REDIS,
        min_ops=(("redis-py-lock", 1.3), ("python-redis-lock", 1.1)),
        min_order_pct=99.0,
        min_fairness=0.95,
        max_handoff_ms=0.3,
        max_wait_ms=20.0,
    ),
    Scenario(
        "r2",
        "one key on Redis, 1 ms outside the lock",
        0.001,
        **_REDIS,
        min_ops=(("redis-py-lock", 2.0),),
    ),
    Scenario(
        "r3",
        "one key on Redis, uncontended",
        0.0,
        **_REDIS,
        workers=1,
        min_ops=(("redis-py-lock", 0.95), ("redis-py-async-lock", 0.95)),
    ),
    Scenario(
        "p1",
        "one key on PostgreSQL, nothing outside the lock",
        0.0,
        **_POSTGRES,
        **_POSTGRES_TARGETS,
    ),
    Scenario(
        "p2",
        "one key on PostgreSQL, 1 ms outside the lock",
        0.001,
        **_POSTGRES,
        **_POSTGRES_TARGETS,
    ),
    Scenario(
        "p3",
        "one key on PostgreSQL, uncontended",
        0.0,
        **_POSTGRES,
        workers=1,
        min_ops=(("pg-advisory-lock", 0.95),),
    ),
    Scenario(
        "s1",
        "one key, sync turns",
        0.0,
        **_SYNC_FILE,
        workers=SYNC_WORKERS,
        # Issue 45: filelock's pace, fair (file-fifo-floor shows what a fair line can cost)
        min_ops=(("filelock", 1.0),),
        min_fairness=0.9,
    ),
    Scenario(
        "s2",
        "one key, sync turns, uncontended",
        0.0,
        **_SYNC_FILE,
        workers=1,
        min_ops=(("filelock", 0.9),),
    ),
    Scenario(
        "s3",
        "one key on Redis, sync turns",
        0.0,
        **_SYNC_REDIS,
        workers=SYNC_WORKERS,
        # Issue 45: redis-py's Lock is unfair (arrival order 0.1%), so not the yardstick;
        # the least any fair hand-off costs on Redis (a ticket lock woken by BLPOP) is.
        min_ops=(("redis-fifo-floor", 0.95),),
        min_order_pct=99.0,
        min_fairness=0.95,
    ),
    Scenario(
        "s4",
        "one key on Redis, sync turns, uncontended",
        0.0,
        **_SYNC_REDIS,
        workers=1,
        min_ops=(("redis-py-lock-lease", 1.0),),
    ),
    Scenario(
        "s5",
        "one key on PostgreSQL, sync turns",
        0.0,
        **_SYNC_POSTGRES,
        workers=SYNC_WORKERS,
        min_ops=(("pg-advisory-lock-sync", 0.95),),
    ),
    Scenario(
        "s6",
        "one key on PostgreSQL, sync turns, uncontended",
        0.0,
        **_SYNC_POSTGRES,
        workers=1,
        min_ops=(("pg-advisory-lock-sync", 0.95),),
    ),
)
#: The kinds of scenario, for --only.
KINDS = ("file", "redis", "postgres", "sync-file", "sync-redis", "sync-postgres")
#: The kinds whose contenders need the Redis server.
REDIS_KINDS = frozenset({"redis", "sync-redis"})
#: The kinds whose contenders need the PostgreSQL server.
POSTGRES_KINDS = frozenset({"postgres", "sync-postgres"})
#: --only's names for several kinds at once.
GROUPS = {
    "sync": ("sync-file", "sync-redis", "sync-postgres"),
    "all-postgres": ("postgres", "sync-postgres"),
}


@dataclass
class Settings:
    """How much to measure: workers per run, seconds per run, repeats, contenders, kinds."""

    workers: int = 8
    seconds: float = 2.0
    repeats: int = 3
    contenders: list[str] = field(default_factory=lambda: list(DEFAULT))
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    #: A git revision whose inturn contenders run too, as ``name@REF``.
    before: str | None = None
    #: Only these scenarios (their names: f1, r1...); None: every one of the kinds.
    scenarios: list[str] | None = None
    #: Where each run's work directory is made (the file locks' and inturn's files
    #: live in it): None, where ``FileBackend()`` keeps its files by default (see
    #: default_directory), so the bench measures what a user gets. Its file system
    #: sets what making and deleting a file costs (ext4 journals it; a tmpfs does not).
    directory: str | None = None

    @classmethod
    def make(cls, quick: bool, repeats: int = 3) -> Settings:
        """The default settings, or with quick those of a smoke test (0.5 s runs)."""
        return cls(seconds=0.5 if quick else 2.0, repeats=repeats)


Log = Callable[[str], None]


def log(message: str) -> None:
    """The benchmark's progress, on stderr (the tables go to stdout)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: this one's, extra, and the bench package and PYTHONPATH's
    entries on its path (made absolute: workers run in ROOT, not in this directory)."""
    env = dict(os.environ)
    env.update(extra or {})
    paths = [os.path.abspath(path) for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *paths])
    return env


def _spawn(config: dict[str, Any], env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """A worker process; env: variables to set in its environment (besides this one's)."""
    env = worker_env(env)
    return subprocess.Popen(
        [sys.executable, "-m", "bench.mp_worker", json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env=env,
        text=True,
    )


class Unavailable(RuntimeError):
    """A contender's worker failed before it was ready: its set-up or its first turn raised."""


def _line(pipe: IO[str] | None, what: str, until: float | None = None) -> str:
    """The next line a worker sends (by time.monotonic() until, at the latest)."""
    assert pipe is not None
    left = None if until is None else max(0.0, until - time.monotonic())
    if left is not None and not select.select([pipe], [], [], left)[0]:
        raise RuntimeError(f"a worker sent no {what} in time: is the lock stuck?")
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


def run_once(
    contender: str,
    scenario: Scenario,
    settings: Settings,
    redis_url: str | None = None,
    versions: dict[str, tuple[Path, str]] | None = None,
    postgres_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Start the workers of one run, release them together, and measure their records.

    versions: by git revision, where its inturn was unpacked and the package's name;
    env: variables to set in the workers' environment (``INTURN_REDIS_WIRE``, say).
    """
    where = settings.directory or default_directory()
    with tempfile.TemporaryDirectory(prefix="inturn-bench-", dir=where) as directory:
        workdir = Path(directory)
        tag = secrets.token_hex(4)  # server-side names of this run: no run sees another's
        on_server = scenario.on_redis or scenario.on_postgres
        config: dict[str, Any] = {
            "contender": contender,
            "workdir": str(workdir),
            "redis_url": redis_url if scenario.on_redis else None,
            "postgres_url": postgres_url if scenario.on_postgres else None,
            "tag": tag,
            "key": f"bench:{tag}:{KEY}" if on_server else KEY,
            "outside": scenario.outside,
        }
        _, at, ref = contender.partition("@")
        if at:
            assert versions is not None
            path, package = versions[ref]
            config.update(package=package, package_path=str(path))
        workers = [_spawn(config, env) for _ in range(scenario.processes(settings))]
        try:
            for worker in workers:
                said = _line(worker.stdout, "ready")
                if said.startswith(UNAVAILABLE):
                    raise Unavailable(said[len(UNAVAILABLE) :].strip())
            start = _release(workers, settings.seconds)
            until = time.monotonic() + settings.seconds + GRACE
            for worker in workers:
                _line(worker.stdout, "finished", until)
            for worker in workers:  # every worker is done measuring: now they may tear down
                assert worker.stdin is not None
                worker.stdin.write("teardown\n")
                worker.stdin.flush()
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
        reason = contender(name).available()
        if reason is None:
            kept.append(name)
        else:
            log(f"multiproc: skipping {name}: {reason}")
    return kept


def _of_kind(names: Sequence[str], kind: str) -> list[str]:
    return [name for name in names if {kind, "any"} & set(contender(name).kinds)]


def _rotated(items: Sequence[str], by: int) -> list[str]:
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def measure(settings: Settings, log: Log) -> dict[str, Any]:
    """Run every scenario for every contender, interleaved; the medians and targets.

    The answer is what ``--json`` writes: ``settings``, ``runs`` (every
    repeat's metrics), ``medians`` (scenario -> contender -> metric),
    ``targets``, and ``load``: the machine's load average (1 minute) at the
    start and at the end, since other jobs on a shared machine cost a FIFO
    hand-off most (each waits for the next process to be scheduled).
    """
    load = [_load()]
    wanted = list(settings.contenders)
    versions: dict[str, tuple[Path, str]] = {}
    if settings.before is not None:
        versions[settings.before] = extract_version(settings.before)
        wanted += [f"{name}@{settings.before}" for name in wanted if name in VERSIONED]
    names = runnable(wanted, log)
    chosen = [
        scenario
        for scenario in SCENARIOS
        if scenario.kind in settings.kinds
        and (settings.scenarios is None or scenario.name in settings.scenarios)
        and _of_kind(names, scenario.kind)
    ]
    runs: dict[str, dict[str, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
    unavailable: dict[str, str] = {}  # contender -> why it was left out
    with ExitStack() as stack:
        url = pg_url = None
        if any(scenario.on_redis for scenario in chosen):
            url = stack.enter_context(redis_server(log))
            if url is None:
                chosen = [scenario for scenario in chosen if not scenario.on_redis]
        if any(scenario.on_postgres for scenario in chosen):
            pg_url = stack.enter_context(postgres_server(log))
            if pg_url is None:
                chosen = [scenario for scenario in chosen if not scenario.on_postgres]
        for repeat in range(settings.repeats):
            log(f"multiproc: repeat {repeat + 1}/{settings.repeats}")
            for scenario in chosen:
                for name in _rotated(_of_kind(names, scenario.kind), repeat):
                    if name in unavailable:
                        continue
                    try:
                        result = run_once(name, scenario, settings, url, versions, pg_url)
                    except Unavailable as error:
                        unavailable[name] = str(error)
                        log(f"multiproc: leaving {name} out of this run: {error}")
                        continue
                    runs[scenario.name][name].append(result)
    for by_name in runs.values():  # a contender left out late has no column anywhere
        for name in unavailable:
            by_name.pop(name, None)
    medians = {
        scenario: {name: _median(samples) for name, samples in by_name.items()}
        for scenario, by_name in runs.items()
    }
    load.append(_load())
    return {
        "machine": machine(),
        "load": load,
        "settings": asdict(settings),
        "metrics": METRICS,
        "runs": runs,
        "medians": medians,
        "unavailable": unavailable,
        "targets": [
            {"target": label, "pass": ok, "value": value} for label, ok, value in targets(medians)
        ],
    }


def _load() -> float | None:
    """The machine's load average over the last minute, where the system tells it."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


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
    "cpu_us_per_op": ("client CPU per op (µs)", "{:,.1f}"),
}


#: Metrics that say nothing with one process alone on the key.
CONTENDED_ONLY = frozenset({"handoff_p50_us", "handoff_p99_us", "arrival_order_pct", "fairness"})


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
        processes = scenario.processes(settings)
        lines = [
            f"### ({scenario.name}) {processes} process{'es' if processes != 1 else ''}, "
            f"{scenario.title}\n",
            "| metric | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for metric, (label, form) in ROWS.items():
            if processes == 1 and metric in CONTENDED_ONLY:
                continue
            cells = [form.format(values[name][metric]) for name in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            if metric == "ops_per_s":
                earlier = [name for name in names if name.startswith(scenario.subject + "@")]
                baselines = [b for b in scenario.ratios if b in values] + earlier
                lines.extend(_ratio_row(values, names, b) for b in baselines)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


Result = tuple[str, bool | None, str]


def _bounds(scenario: Scenario, subject: dict[str, float]) -> list[Result]:
    """The subject's targets that are bounds on one of its own metrics."""
    tag = f"({scenario.name}) {scenario.subject}"
    results: list[Result] = []
    if scenario.min_order_pct is not None:
        order = subject["arrival_order_pct"]
        label = f"{tag} arrival order >= {scenario.min_order_pct:g}%"
        results.append(
            (label, check(order, scenario.min_order_pct, at_most=False), f"{order:.1f}%")
        )
    if scenario.min_fairness is not None:
        fair = subject["fairness"]
        label = f"{tag} fairness >= {scenario.min_fairness:g}"
        results.append((label, check(fair, scenario.min_fairness, at_most=False), f"{fair:.2f}"))
    if scenario.max_handoff_ms is not None:
        handoff = subject["handoff_p50_us"] / 1e3
        label = f"{tag} hand-off p50 <= {scenario.max_handoff_ms:g} ms"
        results.append((label, check(handoff, scenario.max_handoff_ms), f"{handoff:.3f} ms"))
    if scenario.max_wait_ms is not None:
        wait = subject["longest_wait_ms"]
        label = f"{tag} longest wait <= {scenario.max_wait_ms:g} ms"
        results.append((label, check(wait, scenario.max_wait_ms), f"{wait:.1f} ms"))
    return results


def _relative(
    scenario: Scenario, subject: dict[str, float], values: dict[str, dict[str, float]]
) -> list[Result]:
    """The subject's targets that are bounds relative to another contender's metric."""
    tag = f"({scenario.name}) {scenario.subject}"
    results: list[Result] = []
    if scenario.min_order_of is not None:
        baseline, points = scenario.min_order_of
        label = f"{tag} arrival order >= {baseline}'s - {points:g} points"
        other = values.get(baseline)
        if other is None:
            results.append((label, None, "not measured"))
        else:
            order, floor = subject["arrival_order_pct"], other["arrival_order_pct"]
            shown = f"{order:.1f}% (its: {floor:.1f}%)"
            results.append((label, check(order, floor - points, at_most=False), shown))
    if scenario.max_handoff_x is not None:
        baseline, factor = scenario.max_handoff_x
        label = f"{tag} hand-off p50 <= {factor:g}x {baseline}'s"
        other = values.get(baseline)
        if other is None:
            results.append((label, None, "not measured"))
        else:
            quotient = ratio(subject["handoff_p50_us"], other["handoff_p50_us"])
            shown = (
                f"{quotient:.2f}x ({subject['handoff_p50_us']:,.0f} µs, "
                f"its: {other['handoff_p50_us']:,.0f} µs)"
            )
            results.append((label, check(quotient, factor), shown))
    return results


def targets(medians: dict[str, dict[str, dict[str, float]]]) -> list[Result]:
    """Each scenario's targets: (label, passed or None if not measured, value).

    A value that is not a measure (NaN, negative; ops/s of zero) is not passed:
    see :func:`bench.targets.check`.
    """
    results: list[Result] = []
    for scenario in SCENARIOS:
        values = medians.get(scenario.name, {})
        subject = values.get(scenario.subject)
        if subject is None:
            continue
        results.extend(_bounds(scenario, subject))
        results.extend(_relative(scenario, subject, values))
        for baseline, floor in scenario.min_ops:
            label = f"({scenario.name}) {scenario.subject} ops/s >= {floor:g}x {baseline}"
            other = values.get(baseline)
            if other is None:
                results.append((label, None, "not measured"))
                continue
            quotient = ratio(subject["ops_per_s"], other["ops_per_s"])
            results.append((label, check(quotient, floor, at_most=False), f"{quotient:.2f}x"))
    return results


def report(result: dict[str, Any]) -> str:
    """The Markdown of a measure() result: the tables, the targets, what the metrics mean."""
    settings = Settings(**result["settings"])
    lines = [
        f"## Across processes: {result['machine']}{loaded(result)}, "
        f"{settings.workers} workers x {settings.seconds:g} s, median of {settings.repeats}"
        f"{on_file_system(settings.directory or default_directory())}\n",
        table(result["medians"], settings),
    ]
    for name, reason in result.get("unavailable", {}).items():
        lines.append(f"\nNot measured: {name}, whose workers failed before the start: {reason}")
    lines.append("\nTargets (multi-process):\n")
    for target in result["targets"]:
        verdict = {True: "PASS", False: "MISS", None: "SKIP"}[target["pass"]]
        lines.append(f"- {verdict} {target['target']}: {target['value']}")
    if not result["targets"]:
        subjects = sorted({scenario.subject for scenario in SCENARIOS})
        lines.append(f"- none: {' and '.join(subjects)} were not measured")
    lines.append("\nMetrics:\n")
    lines.extend(f"- {ROWS[metric][0]}: {meaning}" for metric, meaning in METRICS.items())
    return "\n".join(lines)


def default_directory() -> str:
    """Where ``FileBackend()`` makes its directory by default (/dev/shm on Linux, a tmpfs,
    if this user may write there; else the system's temporary directory)."""
    from inturn.backends.file import FileBackend

    return str(FileBackend().directory.parent)


def on_file_system(directory: str) -> str:
    """Where the runs' files were, for a report's heading: the file system's type too (Linux)."""
    where = Path(directory).resolve()
    kind = ""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        mounts = []
    best = ""
    for fields in mounts:  # the longest mount point that holds where
        if len(fields) > 2 and where.is_relative_to(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], f" ({fields[2]})"
    return f", files in {where}{kind}"


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
    parser.add_argument(
        "--only",
        choices=(*KINDS, *GROUPS),
        default=None,
        help="only the file scenarios (f1, f2), the Redis ones (r1 to r3), the PostgreSQL "
        "ones (p1 to p3), the sync turns on files (s1, s2), on Redis (s3, s4) or on "
        "PostgreSQL (s5, s6), every sync one (s1 to s6), or every PostgreSQL one "
        "(p1 to p3, s5, s6)",
    )
    parser.add_argument(
        "--before",
        metavar="GIT_REF",
        default=None,
        help="also measure inturn's contenders as they were at this git revision",
    )
    parser.add_argument(
        "--scenarios",
        metavar="NAMES",
        default=None,
        help="comma-separated: only these scenarios of the kinds chosen (f1, r1, p1...)",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="make each run's work directory in this one (default: where FileBackend() keeps "
        "its files, /dev/shm on Linux): the file system the file contenders run on, say /tmp "
        "for a disk's",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="draw each backend beside its alternatives to this PNG (bench/mp_plot.py)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="measure nothing: report (and --plot) the results a --json run wrote",
    )
    options = parser.parse_args(argv)
    if options.from_json is not None:
        result = json.loads(options.from_json.read_text())
        print(report(result))
        if options.plot:
            plot(result, options.plot)
        return 0
    settings = Settings.make(options.quick, options.repeats)
    settings.before = options.before
    settings.workers = options.workers
    settings.directory = options.dir
    if options.only is not None:
        settings.kinds = list(GROUPS.get(options.only, (options.only,)))
    if options.seconds is not None:
        settings.seconds = options.seconds
    if options.scenarios is not None:
        settings.scenarios = [name.strip() for name in options.scenarios.split(",")]
        known = {scenario.name for scenario in SCENARIOS}
        if not set(settings.scenarios) <= known:
            parser.error(f"--scenarios: of {', '.join(sorted(known))}")
    settings.contenders = [name.strip() for name in options.contenders.split(",") if name.strip()]
    unknown = [name for name in settings.contenders if name not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders: {', '.join(unknown)}")

    started = time.perf_counter()
    result = measure(settings, log)
    print(report(result))
    log(f"multiproc: done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps(result, indent=2))
    if options.plot:
        plot(result, options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
