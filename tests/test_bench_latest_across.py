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
@pytest.mark.parametrize("backend", list(w3.BACKENDS))
def test_a_burst_spread_over_8_processes_runs_once_across_them_and_8_times_without(
    backend: str,
) -> None:
    if (missing := w3.missing(backend)) is not None:
        unavailable(f"{w3.BACKENDS[backend]} ({missing})")
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
    w3.RUNS[w3.POSTGRES]: {w3.ACROSS: 1.0, w3.EACH: 8.0, w3.ONE: 1.0},
    w3.TIME[w3.POSTGRES]: {w3.ACROSS: 44.0, w3.EACH: 30.0, w3.ONE: 40.0},
}


def test_the_table_shows_runs_as_they_are_and_times_beside_their_ratio_to_one_process() -> None:
    rows = {label: dict(values) for label, values in ROWS.items()}
    text = w3.report(rows, 3, "a machine")
    assert "| (w3) file: works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "| (w3) Redis: works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "| (w3) PostgreSQL: works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "30.0 (1.20x) | 20.0 (0.80x) | 25.0 (1.00x)" in text
    assert "50.0 (1.25x) | 30.0 (0.75x) | 40.0 (1.00x)" in text  # Redis's, to Redis's one
    assert "44.0 (1.10x) | 30.0 (0.75x) | 40.0 (1.00x)" in text
    assert "- PASS (w3) file: across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- PASS (w3) file: across=processes, 8 processes: <= 1.2x the time" in text
    assert "- PASS (w3) Redis: across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- MISS (w3) Redis: across=processes, 8 processes: <= 1.2x the time" in text
    assert "- PASS (w3) PostgreSQL: across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- PASS (w3) PostgreSQL: across=processes, 8 processes: <= 1.2x the time" in text
    rows[w3.TIME[w3.FILE]][w3.ACROSS] = 31.0
    assert "- MISS (w3) file: across=processes, 8 processes: <= 1.2x the time" in w3.report(
        rows, 3, "m"
    )


@pytest.mark.parametrize(
    ("backend", "check", "why"),
    [
        (w3.REDIS, "redis_missing", "no redis-server on PATH"),
        (w3.POSTGRES, "postgres_missing", "no initdb on PATH"),
    ],
)
def test_a_run_without_a_server_says_so_and_skips_its_targets(
    monkeypatch: pytest.MonkeyPatch, backend: str, check: str, why: str
) -> None:
    monkeypatch.setattr(w3, check, lambda: why)
    shown = w3.BACKENDS[backend]
    rows = {label: values for label, values in ROWS.items() if f" {shown}:" not in label}
    text = w3.report(rows, 3, "a machine")
    assert f"| (w3) {shown}" not in text
    assert f"No {shown} rows: {why}." in text
    assert f"- SKIP (w3) {shown}: across=processes, 8 processes: <= 1.2x the time" in text
    assert "- PASS (w3) file: across=processes, 8 processes: <= 1.2x the time" in text
    for other, other_shown in w3.BACKENDS.items():
        if other != backend:
            assert f"| (w3) {other_shown}: works run after the holder" in text
            assert f"No {other_shown} rows" not in text


def test_the_servers_are_a_table_and_each_backend_s_rows_are_its_own() -> None:
    assert set(w3.SERVED) | {w3.FILE} == set(w3.BACKENDS)
    assert len(set(w3.RUNS.values()) | set(w3.TIME.values())) == 2 * len(w3.BACKENDS)
