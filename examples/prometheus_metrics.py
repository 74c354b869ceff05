"""Prometheus metrics from ``q.stats()``: a custom collector for prometheus_client.

Copy ``QueueCollector`` into your app and register it once::

    from prometheus_client import REGISTRY, start_http_server

    REGISTRY.register(QueueCollector(shop, inturn.default_queue))
    start_http_server(9100)  # or your framework's /metrics route

It reads each queue's :meth:`~inturn.KeyedQueue.stats` when Prometheus
scrapes, so it costs nothing between scrapes and needs no instrumentation
(``stats()`` is safe from the exporter's thread). It exports, labelled by
the queue's ``name=``, never by key:

- ``inturn_queue_running`` (gauge): work running now;
- ``inturn_queue_waiting`` (gauge): turns waiting now, for a key or a slot;
- ``inturn_turns_total{outcome=...}`` (counter): turns that ended, by
  outcome: ``completed``, ``failed``, ``timed_out``, ``cancelled``;
- ``inturn_superseded_total`` (counter): works that never ran because newer
  work for their key took their place (``pending="latest"``, ``debounce``);
- ``inturn_turn_wait_seconds_total`` and ``inturn_turn_hold_seconds_total``
  (counters): seconds waited and held, summed, for queues that time their
  turns (with ``max_running``, ``max_hold``, a backend, or observed); divide
  their rate by the turns' rate for the mean wait and hold.

Per-function histograms are what :mod:`inturn.otel` adds, through
OpenTelemetry (which also exports to Prometheus).

Run: python examples/prometheus_metrics.py
"""

from __future__ import annotations

import asyncio

# --8<-- [start:collector]
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inturn import KeyedQueue


class QueueCollector(Collector):
    """Exports the stats() of some queues to Prometheus, at each scrape."""

    def __init__(self, *queues: KeyedQueue) -> None:
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("inturn_queue_running", "Work running now", labels=["queue"])
        waiting = GaugeMetricFamily(
            "inturn_queue_waiting", "Turns waiting now, for a key or a slot", labels=["queue"]
        )
        turns = CounterMetricFamily(
            "inturn_turns", "Turns that ended, by outcome", labels=["queue", "outcome"]
        )
        superseded = CounterMetricFamily(
            "inturn_superseded", "Works replaced by newer work for their key", labels=["queue"]
        )
        waited = CounterMetricFamily(
            "inturn_turn_wait_seconds", "Seconds turns waited, summed", labels=["queue"]
        )
        held = CounterMetricFamily(
            "inturn_turn_hold_seconds", "Seconds turns were held, summed", labels=["queue"]
        )
        for queue in self.queues:
            stats = queue.stats()
            name = queue.name or "unnamed"
            running.add_metric([name], stats.running)
            waiting.add_metric([name], sum(stats.waiting.values()) + stats.waiting_for_slot)
            for outcome in ("completed", "failed", "timed_out", "cancelled"):
                turns.add_metric([name, outcome], getattr(stats, outcome))
            superseded.add_metric([name], stats.superseded)
            if stats.wait_time is not None and stats.hold_time is not None:
                waited.add_metric([name], stats.wait_time)
                held.add_metric([name], stats.hold_time)
        yield from (running, waiting, turns, superseded, waited, held)


# --8<-- [end:collector]


async def main() -> None:
    shop = KeyedQueue(name="shop", max_running=4)
    registry = CollectorRegistry()
    registry.register(QueueCollector(shop))

    async def take_stock(product: str) -> None:
        await asyncio.sleep(0)

    async def broken(product: str) -> None:
        raise ValueError(product)

    await asyncio.gather(*(shop.run(f"stock-{n % 3}", take_stock, str(n)) for n in range(30)))
    failed = await asyncio.gather(shop.run("stock-0", broken, "0"), return_exceptions=True)
    assert isinstance(failed[0], ValueError)

    print(generate_latest(registry).decode())
    sample = registry.get_sample_value
    assert sample("inturn_turns_total", {"queue": "shop", "outcome": "completed"}) == 30
    assert sample("inturn_turns_total", {"queue": "shop", "outcome": "failed"}) == 1
    assert sample("inturn_queue_running", {"queue": "shop"}) == 0
    print("the collector exported 30 completed turns and 1 failed, as stats() counts them")


if __name__ == "__main__":
    asyncio.run(main())
