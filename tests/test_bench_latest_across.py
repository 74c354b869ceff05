"""Scenario (w3), bench/latest_across.py: a burst on one busy key spread over 8 processes.

Counts only, never timings: the quick scenario, once on each backend, on
this tree's inturn (marker ``bench``: out of the default run, CI runs it
once, on the newest Python); the table's tests, on made-up figures, run
with the others.
"""

from __future__ import annotations

import asyncio

import pytest
from bench import latest_across as w3

from support.helpers import unavailable


@pytest.mark.bench
@pytest.mark.parametrize("backend", [w3.FILE, w3.REDIS])
def test_a_burst_spread_over_8_processes_runs_once_across_them_and_8_times_without(
    backend: str,
) -> None:
    if backend == w3.REDIS and (missing := w3.redis_missing()) is not None:
        unavailable(f"Redis ({missing})")
    sizes = w3.Sizes(quick=True)
    sizes.bursts = 2
    # every burst of across=processes and of one process is checked to run 1 work, and of
    # the 8 processes without across 1 to 8 (else bench.scenarios.Verification)
    rows = asyncio.run(w3.measure(sizes, 1, lambda message: None, (backend,)))
    assert rows.keys() == {w3.RUNS[backend], w3.TIME[backend]}
    assert rows[w3.RUNS[backend]] == {w3.ACROSS: 1, w3.EACH: 8, w3.ONE: 1}


ROWS = {
    w3.RUNS[w3.FILE]: {w3.ACROSS: 1.0, w3.EACH: 8.0, w3.ONE: 1.0},
    w3.TIME[w3.FILE]: {w3.ACROSS: 30.0, w3.EACH: 20.0, w3.ONE: 25.0},
    w3.RUNS[w3.REDIS]: {w3.ACROSS: 1.0, w3.EACH: 8.0, w3.ONE: 1.0},
    w3.TIME[w3.REDIS]: {w3.ACROSS: 50.0, w3.EACH: 30.0, w3.ONE: 40.0},
}


def test_the_table_shows_runs_as_they_are_and_times_beside_their_ratio_to_one_process() -> None:
    rows = {label: dict(values) for label, values in ROWS.items()}
    text = w3.report(rows, 3, "a machine")
    assert "| (w3) file: works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "| (w3) Redis: works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "30.0 (1.20x) | 20.0 (0.80x) | 25.0 (1.00x)" in text
    assert "50.0 (1.25x) | 30.0 (0.75x) | 40.0 (1.00x)" in text  # Redis's, to Redis's one
    assert "- PASS (w3) file: across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- PASS (w3) file: across=processes, 8 processes: <= 1.2x the time" in text
    assert "- PASS (w3) Redis: across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- MISS (w3) Redis: across=processes, 8 processes: <= 1.2x the time" in text
    rows[w3.TIME[w3.FILE]][w3.ACROSS] = 31.0
    assert "- MISS (w3) file: across=processes, 8 processes: <= 1.2x the time" in w3.report(
        rows, 3, "m"
    )


def test_a_run_without_redis_says_so_and_skips_its_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(w3, "redis_missing", lambda: "no redis-server on PATH")
    rows = {label: values for label, values in ROWS.items() if "Redis" not in label}
    text = w3.report(rows, 3, "a machine")
    assert "| (w3) Redis" not in text
    assert "No Redis rows: no redis-server on PATH." in text
    assert "- SKIP (w3) Redis: across=processes, 8 processes: <= 1.2x the time" in text
    assert "- PASS (w3) file: across=processes, 8 processes: <= 1.2x the time" in text
