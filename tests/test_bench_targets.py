"""The benchmark's target lines can fail: a figure that is not a measure never PASSes.

No timing here: each test feeds made-up figures to the functions that check
the targets (bench/targets.py, and the tables of bench/run.py, bench/turns.py
and bench/multiproc.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from bench import flow, latest, multiproc, run, threads, turns
from bench.contenders import ALL
from bench.targets import INFO, MISS, PASS, SKIP, Target, check, evaluate, ratio

#: Figures that are not a measure of a cost, a count or a ratio of costs.
NOT_MEASURES = [None, math.nan, math.inf, -math.inf, -0.22, -20_315.0]
REF = "abc1234"


def test_a_value_that_is_not_a_measure_meets_no_limit() -> None:
    for value in NOT_MEASURES:
        assert not check(value, 1.2), value
        assert not check(value, -1e9, at_most=False), value
        assert not check(value, math.inf), value
    assert check(0.82, 1.2)
    assert not check(1.21, 1.2)
    assert check(99.5, 99.0, at_most=False)
    assert not check(98.9, 99.0, at_most=False)


def test_a_negative_value_meets_a_limit_only_where_the_quantity_can_be_negative() -> None:
    assert check(-473.0, 0.0, signed=True)  # memory that shrank between two waves
    assert not check(-473.0, 0.0)
    assert not check(math.nan, 0.0, signed=True)


def test_a_ratio_needs_two_positive_costs() -> None:
    assert ratio(4_666.0, 5_672.0) == pytest.approx(0.82, abs=0.01)
    # The issue's run: both costs above bare came out negative at 1,000 queued.
    for numerator, denominator in [
        (-23_399.0, -20_315.0),
        (5_000.0, -20_315.0),
        (-5_000.0, 20_315.0),
        (5_000.0, 0.0),
        (0.0, 5_000.0),
        (None, 5_000.0),
        (5_000.0, None),
        (math.nan, 5_000.0),
        (math.inf, 5_000.0),
    ]:
        assert math.isnan(ratio(numerator, denominator)), (numerator, denominator)


def _medians(names: list[str], sizes: run.Sizes) -> dict[str, dict[str, float]]:
    """Plausible medians of every in-process measure: bare cheapest, every cost positive."""
    keys = ["a", "b", "c", *(f"e{n}" for n in sizes.scaling)]
    keys += [f"d_{f}" for f in ("in_flight_bytes", "retained_bytes", "growth_bytes")]
    keys += ["d_keys_kept", "d_through_bytes"]
    medians: dict[str, dict[str, float]] = {}
    for key in keys:
        medians[key] = {name: 100.0 + 10.0 * i for i, name in enumerate(names)}
        medians[key][run.FLOOR] = 50.0
    medians["d_keys_kept"] = dict.fromkeys(names, 0.0)
    medians["d_through_bytes"] = dict.fromkeys(names, 0.0)
    return medians


def _flow_medians(sizes: flow.Sizes) -> dict[str, dict[str, float]]:
    return {
        f"{what} {label}": {name: 10.0 + i for i, name in enumerate(flow.NAMES)}
        for what in ("ns", "tasks", "bytes", "running")
        for label in flow.distributions(sizes)
    }


def _latest_medians(sizes: latest.Sizes) -> dict[str, dict[str, float]]:
    """Plausible medians of (w): every figure positive, pending=all the dearest."""
    names = [cls.name for cls in latest.ALL]
    medians: dict[str, dict[str, float]] = {}
    keys = [f"{what} {way}" for what in ("runs", "superseded", "us", "peak") for way in latest.WAYS]
    keys += [
        f"{what} {n}" for what in ("held", "idle", "unclaimed") for n in (sizes.small, sizes.burst)
    ]
    for key in keys:
        medians[key] = {name: 2.0 + i for i, name in enumerate(names)}
        medians[key][latest.BASELINE] = 1_001.0
    return medians


def _turn_medians(with_threads: bool = True) -> dict[str, float]:
    """Plausible medians of (u): each floor cheapest, every cost positive."""
    names = [cls.name for cls in turns.kinds(with_threads=with_threads)]
    medians = {name: 1_000.0 + 10.0 * i for i, name in enumerate(names)}
    for floor in (turns.FLOOR, turns.THREAD_FLOOR):
        if floor in medians:
            medians[floor] = 50.0
    return medians


def _run(before: str | None = REF) -> tuple[dict[str, dict[str, float]], list[str], list[Target]]:
    """A whole run's rows (in process, (g), (u), (w)), the contenders measured, and the targets."""
    sizes, flow_sizes = run.Sizes(quick=False), flow.Sizes(quick=False)
    names = [cls.name for cls in ALL]
    if before:
        names += [f"{name}@{before}" for name in ("inturn.run", "inturn.keyed", "@queue_by_key")]
    turn_medians = _turn_medians()
    latest_sizes = latest.Sizes(quick=False)
    rows = {
        **run.derive(_medians(names, sizes), sizes),
        **flow.derive(_flow_medians(flow_sizes), flow_sizes),
        **turns.derive(turn_medians),
        **latest.derive(_latest_medians(latest_sizes), latest_sizes),
    }
    measured = [*names, *flow.NAMES, *turn_medians, *(cls.name for cls in latest.ALL)]
    return rows, measured, run.target_table(sizes, flow_sizes, before)


def _loose(target: Target) -> Target:
    """The same target with a limit that any valid value meets, a target everywhere."""
    limit = math.inf if target.at_most else -math.inf
    return dataclasses.replace(target, limit=limit, since=None)


def _cells(rows: dict[str, dict[str, float]]) -> list[tuple[str, str]]:
    return [(label, name) for label, values in rows.items() for name in values]


def _with(rows: dict[str, dict[str, float]], label: str, name: str, value: Any) -> Any:
    """A copy of rows with one figure replaced (None: removed)."""
    changed = {row: dict(values) for row, values in rows.items()}
    if value is None:
        del changed[label][name]
    else:
        changed[label][name] = value
    return changed


def test_the_issues_e_figures_miss() -> None:
    """The run of issue 17: (e) came out negative, and its target printed PASS at -0.22."""
    rows, measured, table = _run()
    sizes = run.Sizes(quick=False)
    (target,) = [t for t in table if t.label.startswith("(e) inturn.run at")]
    for bad in (-0.22, math.nan, None):
        rows_bad = _with(rows, run.scaling_ratio_label(sizes), "inturn.run", bad)
        assert evaluate(target, rows_bad, measured)[0] == MISS
    # Two negative costs above bare in (a) divide to a positive 0.50: still a MISS.
    a = dict(rows)
    a[run.A] = {**rows[run.A], "inturn.run": -10_000.0, "handwritten": -20_000.0}
    for target in table:
        if target.label.startswith("(a)") and "inturn.run" in target.needs:
            assert evaluate(target, a, measured)[0] == MISS, target.label


def test_e_is_a_ratio_of_whole_costs_so_positive() -> None:
    """(e) subtracts no floor: positive timings give a positive ratio, whatever the noise."""
    sizes = run.Sizes(quick=False)
    names = [cls.name for cls in ALL]
    medians = _medians(names, sizes)
    first, last = sizes.scaling[0], sizes.scaling[-1]
    medians[f"e{first}"] = dict.fromkeys(names, 30_000.0)  # a slow run of every short queue
    medians[f"e{last}"] = dict.fromkeys(names, 5_000.0)
    rows = run.derive(medians, sizes)
    assert rows[run.scaling_ratio_label(sizes)] == dict.fromkeys(names, pytest.approx(1 / 6))
    assert rows[run.scaling_label(first)]["bare"] == 30_000.0
    assert sizes.scaling_runs(first) * first == sizes.scaling_runs(last) * last


def test_every_target_misses_when_a_figure_it_reads_is_not_a_measure() -> None:
    rows, measured, table = _run()
    assert len(table) == 42
    for target in map(_loose, table):
        verdict, _, good = evaluate(target, rows, measured)
        assert verdict == PASS, (target.label, good)
        read = 0
        for label, name in _cells(rows):
            for bad in NOT_MEASURES:
                if bad is not None and bad < 0 and target.signed:
                    continue  # a valid measure of a quantity that can be negative
                verdict, _, value = evaluate(target, _with(rows, label, name, bad), measured)
                if value != good:  # the target reads this figure
                    assert verdict == MISS, (target.label, label, name, bad, value)
                    read += 1
        assert read, f"{target.label}: no figure changes its value"


def test_a_target_skips_only_when_its_contenders_were_not_measured() -> None:
    rows, measured, table = _run(before=None)
    verdicts = {target.label: evaluate(target, rows, measured)[0] for target in table}
    skipped = [label for label, verdict in verdicts.items() if verdict == SKIP]
    assert len(skipped) == 9
    assert all("@--before" in label for label in skipped)
    # Measured, but its figures missing from the run: a MISS, not a SKIP.
    rows, measured, table = _run()
    for target in table:
        empty: dict[str, dict[str, float]] = {}
        assert evaluate(target, empty, measured)[0] == MISS, target.label


def test_a_number_reported_but_not_targeted_is_info_only_when_valid() -> None:
    rows, measured, table = _run()
    (target,) = [t for t in table if t.since is not None]
    assert evaluate(target, rows, measured, version=(3, 11))[0] == INFO
    assert evaluate(target, rows, measured, version=(3, 12))[0] in (PASS, MISS)
    bad = _with(rows, run.A, "inturn.run", -1.0)
    assert evaluate(target, bad, measured, version=(3, 11))[0] == MISS


def test_multiprocess_targets_miss_on_a_figure_that_is_not_a_measure() -> None:
    subject = {
        "ops_per_s": 1_000.0,
        "handoff_p50_us": 100.0,
        "arrival_order_pct": 100.0,
        "fairness": 1.0,
        "longest_wait_ms": 1.0,
    }
    others = {
        name: {**subject, "ops_per_s": 500.0} for name in ("redis-py-lock", "python-redis-lock")
    }

    def r1(**changed: float) -> dict[str, dict[str, dict[str, float]]]:
        return {"r1": {"inturn-redis": {**subject, **changed}, **others}}

    good = {label: (ok, value) for label, ok, value in multiproc.targets(r1())}
    assert len(good) == 6
    assert all(ok for ok, _ in good.values())
    read: set[str] = set()
    for metric in subject:
        for bad in (math.nan, -1.0, -math.inf):
            for label, ok, value in multiproc.targets(r1(**{metric: bad})):
                if value != good[label][1]:
                    assert ok is False, (metric, bad, label, value)
                    read.add(label)
    assert read == set(good)
    stalled = {"r1": {"inturn-redis": subject, **others, "redis-py-lock": {"ops_per_s": 0.0}}}
    (verdict,) = [ok for label, ok, _ in multiproc.targets(stalled) if "x redis-py-lock" in label]
    assert verdict is False


def test_threads_table_gives_ratios_of_costs_only_and_none_of_a_figure_that_is_not_one() -> None:
    sizes = threads.Sizes(quick=True)
    medians: dict[str, dict[str, float]] = {"t1": {}}
    for i, name in enumerate(threads.NAMES):
        medians["t1"][name] = 100.0 * (i + 1)  # bare cheapest
    costs = {name: 1_000.0 for name in threads.NAMES if name != threads.FLOOR}
    for metric, *_ in threads.T2_ROWS:
        medians[f"t2 {metric}"] = dict(costs)
    medians["t2 ns_per_turn"]["inturn keyed"] = 3_000.0
    medians["t2 handoff_p50_us"]["inturn keyed"] = math.nan
    rows = threads.derive(medians, sizes)
    assert rows[threads.T1][threads.BASELINE] == 100.0  # above bare
    text = threads.table(rows, sizes)
    turn_row = next(line for line in text.splitlines() if "(t2) ns/turn" in line)
    assert "(3.00x)" in turn_row
    handoff_row = next(line for line in text.splitlines() if "hand-off" in line)
    assert "nan |" in handoff_row  # shown as it is, with no ratio
    order_row = next(line for line in text.splitlines() if "arrival order" in line)
    assert "x)" not in order_row  # a share, not a cost


#: Issues 29 and 32: each shape's uncontended turn, at most this ratio to its hand-written lock.
#: Issue 45's targets: a turn that needs no setting against the named-call floor of
#: the one protocol (bench/floor.py), measured in the same run; the rest against
#: the hand-written lock.
ISSUE_45 = {
    ("inturn.run", "handwritten"): 0.6,
    ("inturn.keyed", "floor: named calls"): 1.3,
    ("@queue_by_key", "floor: named calls"): 1.3,
    ("inturn.run max_hold", "handwritten"): 3.0,
    ("inturn.run observed", "handwritten"): 3.0,
    ("inturn.run max_running=32 timeout", "handwritten"): 3.0,
    ("inturn.keyed 2 keys", "handwritten 2 keys"): 2.5,
    ("thread inturn keyed", "floor: named calls"): 1.3,
    ("thread inturn keyed 2 keys", "thread handwritten 2 keys"): 2.5,
    # issue 32: on KeyedQueue(pending="latest"), each at its own shape's target
    ("inturn.run pending=latest", "handwritten"): 0.6,
    ("inturn.keyed pending=latest", "floor: named calls"): 1.3,
    ("@queue_by_key pending=latest", "floor: named calls"): 1.3,
}


def test_each_shape_is_a_ratio_above_its_floor_to_its_own_yardstick() -> None:
    table = turns.target_table()
    assert {target.needs: target.limit for target in table} == ISSUE_45
    # Tasks' floor 100 ns, threads' 300 ns; every yardstick 1,000 ns above its
    # floor, but two keys 2,000 ns: each shape exactly at its limit. (A thread's
    # turn is held to the tasks' named-call floor: its own floor is a thread's.)
    medians = {turns.FLOOR: 100.0, turns.THREAD_FLOOR: 300.0}

    def floor(name: str) -> float:
        return 300.0 if name.startswith("thread") else 100.0

    for (name, baseline), limit in ISSUE_45.items():
        above = 2_000.0 if baseline.endswith("2 keys") else 1_000.0
        medians[baseline] = floor(baseline) + above
        medians[name] = floor(name) + limit * above
    rows = turns.derive(medians)
    assert turns.FLOOR not in rows[turns.ROW]
    assert turns.THREAD_FLOOR not in rows[turns.ROW]
    for target in table:
        verdict, _, value = evaluate(target, rows, list(medians))
        assert (verdict, value) == (PASS, f"{target.limit:.2f}"), target.label
        name = target.needs[0]
        worse = _with(rows, turns.ROW, name, rows[turns.ROW][name] + 20.0)
        assert evaluate(target, worse, list(medians))[0] == MISS, target.label
        # Below its floor by noise: no ratio, whatever the baseline's.
        below = _with(rows, turns.ROW, name, -5.0)
        assert evaluate(target, below, list(medians))[0] == MISS, target.label


def test_thread_shapes_skip_without_threads() -> None:
    medians = _turn_medians(with_threads=False)
    assert not any(name.startswith("thread") for name in medians)
    rows = turns.derive(medians)
    verdicts = {t.needs[0]: evaluate(t, rows, list(medians))[0] for t in turns.target_table()}
    assert {name for name, verdict in verdicts.items() if verdict == SKIP} == {
        "thread inturn keyed",
        "thread inturn keyed 2 keys",
    }
    text = turns.table(rows)
    assert "thread" not in text
    assert "<= 0.6x" in text


def test_turns_table_sets_each_shape_beside_its_own_at_the_earlier_revision() -> None:
    medians = _turn_medians()
    medians["handwritten"] = 1_050.0  # 1,000 above the floor
    medians["inturn.run"] = 650.0
    medians[f"inturn.run@{REF}"] = 550.0
    medians[f"inturn.keyed@{REF}"] = math.nan
    # No other shape timed at REF, as if that revision could take none of them.
    text = turns.table(turns.derive(medians), REF)
    head, _, *lines = text.splitlines()
    assert f"ratio at {REF}" in head
    run_line = next(line for line in lines if line.startswith("| `q.run(key, fn)`"))
    assert run_line.endswith("| 600 | 0.60x | <= 0.6x hand-written | 0.50x | 1.20x |")
    keyed_line = next(line for line in lines if "`async with q.keyed(key)`" in line)
    assert keyed_line.endswith("| - | - |")
    observed = next(line for line in lines if "observed" in line)
    assert observed.endswith("| - | - |")
    handwritten = next(line for line in lines if "asyncio.Lock" in line)
    assert handwritten.endswith("| 1,000 | 1.00x | - | - | - |")


def test_only_sync_selects_the_sync_scenarios_and_their_contenders() -> None:
    kinds = multiproc.GROUPS["sync"]
    chosen = [scenario for scenario in multiproc.SCENARIOS if scenario.kind in kinds]
    assert [scenario.name for scenario in chosen] == ["s1", "s2", "s3", "s4", "s5", "s6"]
    assert [scenario.on_redis for scenario in chosen] == [False, False, True, True, False, False]
    assert [scenario.on_postgres for scenario in chosen] == [False] * 4 + [True] * 2
    names = list(multiproc.DEFAULT)
    assert multiproc._of_kind(names, "sync-file") == [
        "inturn-file",
        "inturn-file-sync",
        "filelock",
        "file-fifo-floor",
    ]
    assert multiproc._of_kind(names, "sync-redis") == [
        "inturn-redis",
        "inturn-redis-sync",
        "redis-py-lock-lease",
        "redis-fifo-floor",
    ]
    assert multiproc._of_kind(names, "sync-postgres") == [
        "inturn-postgres",
        "inturn-postgres-sync",
        "pg-advisory-lock-sync",
    ]
    assert "inturn-file-sync" not in multiproc._of_kind(names, "file")
    assert "redis-py-lock-lease" not in multiproc._of_kind(names, "redis")
    assert "redis-py-async-lock" in multiproc._of_kind(names, "redis")
    assert "pg-advisory-lock-sync" not in multiproc._of_kind(names, "postgres")


def test_only_all_postgres_selects_every_postgres_scenario() -> None:
    kinds = multiproc.GROUPS["all-postgres"]
    chosen = [scenario for scenario in multiproc.SCENARIOS if scenario.kind in kinds]
    assert [scenario.name for scenario in chosen] == ["p1", "p2", "p3", "s5", "s6"]
    assert all(scenario.on_postgres and not scenario.on_redis for scenario in chosen)
    names = list(multiproc.DEFAULT)
    assert multiproc._of_kind(names, "postgres") == ["inturn-postgres", "pg-advisory-lock"]


def test_postgres_targets_are_relative_to_the_hand_written_loop() -> None:
    loop = {
        "ops_per_s": 2_000.0,
        "handoff_p50_us": 300.0,
        "arrival_order_pct": 97.0,
        "fairness": 1.0,
        "longest_wait_ms": 5.0,
    }
    subject = {**loop, "ops_per_s": 1_900.0, "handoff_p50_us": 420.0, "arrival_order_pct": 96.5}

    def p1(**changed: float) -> dict[str, dict[str, dict[str, float]]]:
        return {"p1": {"inturn-postgres": {**subject, **changed}, "pg-advisory-lock": loop}}

    good = {label: ok for label, ok, _ in multiproc.targets(p1())}
    assert len(good) == 3
    assert all(good.values()), good
    missed = {
        "ops_per_s": 1_700.0,  # 0.85x
        "handoff_p50_us": 460.0,  # 1.53x
        "arrival_order_pct": 95.5,  # 1.5 points below
    }
    for metric, value in missed.items():
        verdicts = {label: ok for label, ok, _ in multiproc.targets(p1(**{metric: value}))}
        assert [label for label, ok in verdicts.items() if not ok] != [], metric
        assert sum(not ok for ok in verdicts.values()) == 1, (metric, verdicts)
        for bad in (math.nan, -1.0):
            verdicts = {label: ok for label, ok, _ in multiproc.targets(p1(**{metric: bad}))}
            assert sum(not ok for ok in verdicts.values()) == 1, (metric, bad, verdicts)
    alone = {"p1": {"inturn-postgres": subject}}
    assert [ok for _, ok, _ in multiproc.targets(alone)] == [None, None, None]
