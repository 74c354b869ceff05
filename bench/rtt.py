"""inturn's Redis wire, taken over or public, at network round trips of ~0, 0.25 and 1 ms.

    python -m bench.rtt [--repeats N] [--quick] [--seconds S] [--json out.json]

(5 repeats of 1.5 s runs: about 7 minutes on 2 cores; --quick: 1 repeat of
0.4 s runs, about 30 s.)

The Redis backend carries its connections one of two ways: taken over (it
writes redis-py's transport and parses the replies itself) or through
redis-py's public API (``INTURN_REDIS_WIRE=public``, read at import). The
takeover is kept only where it wins by 1.2x at a realistic round trip of
0.25 ms: this measures both, in one run, at each round trip of :data:`RTTS`.
Loopback is the round trip of ~0 (direct to the server); the others go
through bench/delay_proxy.py, a proxy process that delays each direction by
half the round trip, calibrated on redis-py ``PING`` (the round trip it
adds, achieved, is printed beside the one wanted, before and after the run).

Scenarios, each a run of bench/multiproc.py's harness (bench/mp_worker.py
workers, one fresh interpreter each, the wire mode in its environment):

- (n1) one process, uncontended ``async with queue.keyed(key)`` on a
  RedisBackend queue (the same key every turn, as multiproc's (r3));
  reference: redis-py's asyncio ``Lock``, ``timeout=10, blocking_timeout=60``;
- (n2) one process, uncontended ``with queue.keyed(key)`` from its main
  thread, no event loop in the caller (multiproc's (s4)); reference:
  redis-py's ``r.lock(name, timeout=10, blocking_timeout=60)``. A thread's
  calls no longer ride the takeover (see UNWIRED): both wire modes take the
  same path, and n2 is out of the rule;
- (n3) 4 processes on one key, ``async with`` (multiproc's (r1), 4 workers);
- (n4) and (n5): 8 processes on one key, ``async with``, with nothing and
  with 1 ms (``asyncio.sleep``) outside the lock: multiproc's (r1) and (r2),
  where 8 processes share 2 cores, so what each turn costs the CPU counts.

Each repeat runs every contender of every scenario once, at every round
trip, in a rotated order; the numbers are the medians of the repeats, and
the ratio takeover / public is that of the median turns per second (the
range of the ratios of the repeats' pairs is shown too: their spread is
the noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/rtt.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .delay_proxy import Delayed, delayed, ping_ms
from .mp_servers import redis_server
from .multiproc import ROOT, Log, Scenario, Settings, log, machine, run_once, worker_env
from .targets import check, ratio

#: The round trips, in ms; 0 is loopback, direct to the server (no proxy).
RTTS = (0.0, 0.25, 1.0)
#: The rule: the takeover stays where it wins by this much at this round trip.
KEEP_FACTOR, KEEP_AT = 1.2, 0.25
#: The wire modes: the value of INTURN_REDIS_WIRE in the workers' environment.
TAKEOVER, PUBLIC = "takeover", "public"
WIRE = {TAKEOVER: "fast", PUBLIC: "public"}
REFERENCE = "reference"


@dataclass(frozen=True)
class Entry:
    """A column of a scenario: a contender of bench/mp_contenders.py, in a wire mode."""

    column: str
    contender: str
    #: TAKEOVER or PUBLIC (inturn's), or None (a reference, which is not inturn).
    wire: str | None = None

    def env(self) -> dict[str, str]:
        return {"INTURN_REDIS_WIRE": WIRE[self.wire]} if self.wire else {}


def _inturn(contender: str) -> tuple[Entry, Entry]:
    return Entry(TAKEOVER, contender, TAKEOVER), Entry(PUBLIC, contender, PUBLIC)


SCENARIOS: tuple[tuple[Scenario, tuple[Entry, ...]], ...] = (
    (
        Scenario("n1", "one process, uncontended, async with", 0.0, kind="redis", workers=1),
        (*_inturn("inturn-redis"), Entry(REFERENCE, "redis-py-async-lock")),
    ),
    (
        Scenario("n2", "one process, uncontended, sync with", 0.0, kind="redis", workers=1),
        (*_inturn("inturn-redis-sync"), Entry(REFERENCE, "redis-py-lock-lease")),
    ),
    (
        Scenario("n3", "4 processes on one key, async with", 0.0, kind="redis", workers=4),
        _inturn("inturn-redis"),
    ),
    (
        Scenario("n4", "8 processes on one key, async with", 0.0, kind="redis", workers=8),
        _inturn("inturn-redis"),
    ),
    (
        Scenario(
            "n5", "8 processes on one key, 1 ms outside, async with", 0.001, kind="redis", workers=8
        ),
        _inturn("inturn-redis"),
    ),
)
#: Scenarios whose turns do not ride the takeover: a thread's calls block on connections of
#: their own (redis-py's sync Connection) since issue 30; only the subscription that hands a
#: busy key's grant over does, which an uncontended turn never needs. They are measured
#: against their reference, and left out of the rule.
UNWIRED = frozenset({"n2"})
#: What each scenario's reference is, for the table.
REFERENCES = {"n1": "redis-py asyncio Lock", "n2": "redis-py r.lock(...)"}


def _rotated(items: Sequence[Entry], by: int) -> list[Entry]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def rtt_label(rtt_ms: float) -> str:
    return "direct" if rtt_ms == 0 else f"{rtt_ms:g} ms"


# What the workers import: inturn from the PYTHONPATH given, in the wire mode asked for.

_CHECK = """
import asyncio, json, sys
import inturn
from inturn.backends.redis import RedisBackend, _takeover, _wire

seen = []
for cls in (_wire._TakenOver, _wire._Public):
    def counted(self, *args, _init=cls.__init__, _name=cls.__name__, **kwargs):
        seen.append(_name)
        _init(self, *args, **kwargs)
    cls.__init__ = counted

async def turn():
    queue = inturn.KeyedQueue(backend=RedisBackend.from_url(sys.argv[1], namespace="rtt-check"))
    async with queue.keyed("k"):
        pass
    await queue.aclose()

asyncio.run(turn())
print(json.dumps({"inturn": inturn.__file__, "enabled": _takeover.ENABLED,
                  "carriers": sorted(set(seen))}))
"""


def wire_check(url: str, wire: str) -> dict[str, Any]:
    """Where a worker's inturn comes from, and which carriers its connections get.

    A process with the workers' environment takes one turn and says: the
    file of its ``inturn``, whether the takeover is enabled, and the classes
    of carrier its connections were given (patched in that process only).
    """
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, url],
        cwd=ROOT,
        env=worker_env({"INTURN_REDIS_WIRE": WIRE[wire]}),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {wire} wire check failed:\n{out.stderr}")
    if out.stderr.strip():
        print(f"[bench] rtt: the {wire} wire check said:\n{out.stderr}", file=sys.stderr)
    answer: dict[str, Any] = json.loads(out.stdout)
    answer["stderr"] = out.stderr
    return answer


# The run.


def measure(settings: Settings, log: Log, pings: int = 300) -> dict[str, Any]:
    """Every scenario's contenders at every round trip, interleaved; medians and ratios."""
    runs: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    paths: dict[str, dict[str, Any]] = {}
    links: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        url = stack.enter_context(redis_server(log))
        if url is None:
            raise SystemExit("bench.rtt needs a Redis server: redis-server on PATH")
        for wire in (TAKEOVER, PUBLIC):
            paths[wire] = wire_check(url, wire)
            log(
                f"rtt: {wire}: inturn from {paths[wire]['inturn']}, carriers "
                f"{', '.join(paths[wire]['carriers'])}"
            )
        direct_before = ping_ms(url, pings)
        urls: dict[float, str] = {}
        proxies: dict[float, Delayed] = {}
        for rtt in RTTS:
            if rtt == 0:
                urls[rtt] = url
                continue
            proxy = stack.enter_context(delayed(url, rtt, pings=pings))
            proxies[rtt], urls[rtt] = proxy, proxy.url
            log(
                f"rtt: proxy for {rtt:g} ms: achieved {proxy.achieved_ms:.3f} ms (PING "
                f"{proxy.ping_ms:.3f} ms through it, {proxy.direct_ms:.3f} ms direct, "
                f"{proxy.zero_ms:.3f} ms through it at delay 0; told {proxy.set_ms:.3f} ms)"
            )
        for repeat in range(settings.repeats):
            log(f"rtt: repeat {repeat + 1}/{settings.repeats}")
            for rtt in RTTS:
                for scenario, entries in SCENARIOS:
                    for entry in _rotated(entries, repeat):
                        result = run_once(
                            entry.contender, scenario, settings, urls[rtt], env=entry.env()
                        )
                        runs[rtt_label(rtt)][scenario.name][entry.column].append(result)
        direct_after = ping_ms(url, pings)
        for rtt in RTTS:
            after = ping_ms(urls[rtt], pings) if rtt else direct_after
            proxy = proxies.get(rtt)
            links[rtt_label(rtt)] = {
                "target_ms": rtt,
                **(proxy.as_dict() if proxy else {"direct_ms": direct_before}),
                "direct_after_ms": direct_after,
                "ping_after_ms": after,
                "achieved_after_ms": after - direct_after,
            }
    return {
        "machine": machine(),
        "settings": asdict(settings),
        "wire": paths,
        "links": links,
        "runs": runs,
        "medians": {
            rtt: {
                scenario: {column: _median(samples) for column, samples in by_column.items()}
                for scenario, by_column in by_scenario.items()
            }
            for rtt, by_scenario in runs.items()
        },
    }


def _median(samples: list[dict[str, float]]) -> dict[str, float]:
    return {metric: statistics.median(run[metric] for run in samples) for metric in samples[0]}


def _pair_ratios(by_column: dict[str, list[dict[str, float]]]) -> list[float]:
    """takeover / public ops/s of each repeat (the two ran in the same repeat)."""
    return [
        ratio(fast["ops_per_s"], slow["ops_per_s"])
        for fast, slow in zip(by_column[TAKEOVER], by_column[PUBLIC], strict=True)
    ]


def _us(values: dict[str, float] | None) -> str:
    if values is None or not values["ops_per_s"]:
        return "-"
    return f"{1e6 / values['ops_per_s']:,.0f} ({values['ops_per_s']:,.0f}/s)"


def report(result: dict[str, Any]) -> str:
    """The Markdown of a measure() result."""
    settings = Settings(**result["settings"])
    lines = [
        f"## Round trips: {result['machine']}, {settings.seconds:g} s runs, "
        f"median of {settings.repeats}\n",
        "| round trip | wanted (ms) | achieved (ms) | after the run (ms) | PING (ms) "
        "| PING direct (ms) | proxy told (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, link in result["links"].items():
        if link["target_ms"] == 0:
            lines.append(
                f"| {label} | 0 | 0 | 0 | {link['direct_ms']:.3f} | {link['direct_ms']:.3f} | - |"
            )
            continue
        lines.append(
            f"| {label} | {link['target_ms']:g} | {link['achieved_ms']:.3f} | "
            f"{link['achieved_after_ms']:.3f} | {link['ping_ms']:.3f} | {link['direct_ms']:.3f} "
            f"| {link['set_ms']:.3f} |"
        )
    lines += [
        "\nµs per turn (turns per second), median; n3 to n5: turns of the key, all processes"
        " together. Ratio: takeover / public turns per second (above 1: the takeover is"
        " faster), and the range of the repeats' paired ratios.\n",
        "| scenario | round trip | takeover | public | takeover / public | repeats' ratios "
        "| reference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lost = []
    for scenario, _ in SCENARIOS:
        for label, by_scenario in result["medians"].items():
            values = by_scenario.get(scenario.name)
            if not values:
                continue
            fast, slow = values.get(TAKEOVER), values.get(PUBLIC)
            quotient = ratio(fast["ops_per_s"], slow["ops_per_s"]) if fast and slow else None
            pairs = _pair_ratios(result["runs"][label][scenario.name])
            reference = values.get(REFERENCE)
            ref = f"{_us(reference)} {REFERENCES[scenario.name]}" if reference else "-"
            lines.append(
                f"| ({scenario.name}) {scenario.title} | {label} | {_us(fast)} | {_us(slow)} | "
                f"{quotient:.2f}x | {min(pairs):.2f}-{max(pairs):.2f}x | {ref} |"
            )
            lost += [
                f"({scenario.name}) {label} {column}: {run['lost_updates']:.0f}"
                for column, samples in result["runs"][label][scenario.name].items()
                for run in samples
                if run["lost_updates"]
            ]
    lines.append(
        f"\nThe rule: the takeover stays where it wins by {KEEP_FACTOR:g}x at {KEEP_AT:g} ms.\n"
    )
    for scenario, _ in SCENARIOS:
        values = result["medians"].get(rtt_label(KEEP_AT), {}).get(scenario.name, {})
        if TAKEOVER in values and PUBLIC in values and scenario.name not in UNWIRED:
            quotient = ratio(values[TAKEOVER]["ops_per_s"], values[PUBLIC]["ops_per_s"])
            verdict = "PASS" if check(quotient, KEEP_FACTOR, at_most=False) else "MISS"
            lines.append(
                f"- {verdict} ({scenario.name}) takeover / public at {KEEP_AT:g} ms >= "
                f"{KEEP_FACTOR:g}x: {quotient:.2f}x"
            )
    for wire, seen in result["wire"].items():
        lines.append(
            f"\nWire check ({wire}): inturn from {seen['inturn']}, takeover enabled: "
            f"{seen['enabled']}, carriers made: {', '.join(seen['carriers'])}"
        )
    if lost:
        lines.append("\nLOST UPDATES (two holders at once!): " + "; ".join(lost))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rtt", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per contender (median; default 5, 1 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="0.4 s runs, 1 repeat: a smoke test")
    parser.add_argument("--seconds", type=float, default=None, help="wall time of each run")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    options = parser.parse_args(argv)
    settings = Settings(
        workers=1,
        seconds=0.4 if options.quick else 1.5,
        repeats=options.repeats or (1 if options.quick else 5),
        contenders=[],
        kinds=["redis"],
    )
    if options.seconds is not None:
        settings.seconds = options.seconds

    started = time.perf_counter()
    result = measure(settings, log, pings=100 if options.quick else 300)
    print(report(result))
    log(f"rtt: done in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
