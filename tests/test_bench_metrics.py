"""The multi-process benchmark's metrics (bench/mp_metrics.py), on records made by hand."""

from __future__ import annotations

import pytest
from bench.mp_metrics import METRICS, measure_run


def records(worker: int, cpu_ns: int) -> dict[str, list[int]]:
    """Two ops of one worker, a microsecond apart, and its CPU time over them."""
    base = 1_000_000 * (worker + 1)
    return {
        "arrivals": [base, base + 2_000],
        "grants": [base + 100, base + 2_100],
        "releases": [base + 1_000, base + 3_000],
        "cpu_ns": [cpu_ns],
    }


def test_cpu_per_op_is_every_workers_cpu_time_over_every_op() -> None:
    run = measure_run([records(0, 30_000), records(1, 50_000)], start_ns=0, counter=4)
    assert run["cpu_us_per_op"] == pytest.approx((30_000 + 50_000) / 4 / 1e3)
    assert set(run) == set(METRICS)


def test_records_without_cpu_time_count_none() -> None:
    old = records(0, 0)
    del old["cpu_ns"]  # a worker's records as they were before cpu_ns
    assert measure_run([old], start_ns=0, counter=2)["cpu_us_per_op"] == 0.0
