"""Scenario (w3), bench/latest_across.py: a burst on one busy key spread over 8 processes.

Counts only, never timings: the quick scenario, once, on this tree's inturn
(marker ``bench``: out of the default run, CI runs it once, on the newest
Python); the table's test, on made-up figures, runs with the others.
"""

from __future__ import annotations

import asyncio

import pytest
from bench import latest_across as w3


@pytest.mark.bench
def test_a_burst_spread_over_8_processes_runs_once_across_them_and_8_times_without() -> None:
    sizes = w3.Sizes(quick=True)
    sizes.bursts = 2
    # every burst of across=processes and of one process is checked to run 1 work (else
    # bench.scenarios.Verification)
    rows = asyncio.run(w3.measure(sizes, 1, lambda message: None))
    assert rows[w3.RUNS] == {w3.ACROSS: 1, w3.EACH: 8, w3.ONE: 1}


def test_the_table_shows_runs_as_they_are_and_times_beside_their_ratio_to_one_process() -> None:
    rows = {
        w3.RUNS: {w3.ACROSS: 1.0, w3.EACH: 8.0, w3.ONE: 1.0},
        w3.TIME: {w3.ACROSS: 30.0, w3.EACH: 20.0, w3.ONE: 25.0},
    }
    text = w3.report(rows, 3, "a machine")
    assert "| (w3) works run after the holder, 1,000 calls | 1 | 8 | 1 |" in text
    assert "30.0 (1.20x) | 20.0 (0.80x) | 25.0 (1.00x)" in text
    assert "- PASS (w3) across=processes, 8 processes: 1,000 calls run 1 work" in text
    assert "- PASS (w3) across=processes, 8 processes: <= 1.2x the time" in text
    rows[w3.TIME][w3.ACROSS] = 31.0
    assert "- MISS (w3) across=processes, 8 processes: <= 1.2x the time" in w3.report(rows, 3, "m")
