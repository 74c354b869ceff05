"""The Prometheus recipe (examples/prometheus_metrics.py) against prometheus_client itself."""

from __future__ import annotations

import asyncio
import sys
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from inturn import KeyedQueue

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
from prometheus_metrics import QueueCollector


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What Prometheus would read from the exporter: sample -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_scrape_from_the_exporter_s_thread_shows_what_runs_waits_and_ended() -> None:
    shop = KeyedQueue(name="shop", max_running=2)
    plain = KeyedQueue()  # unnamed, and untimed
    registry = CollectorRegistry()
    registry.register(QueueCollector(shop, plain))
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    release = asyncio.Event()
    running = 0
    both = asyncio.Event()

    async def hold() -> None:
        nonlocal running
        running += 1
        if running == 2:
            both.set()
        await release.wait()

    async def fail() -> None:
        raise ValueError("no")

    try:
        tasks = [asyncio.create_task(shop.run(key, hold)) for key in ("a", "b", "a", "c")]
        await both.wait()  # a and b run; a's second waits in a's line, c for a slot
        seen = await asyncio.to_thread(scrape, port)  # the exporter's thread reads stats()
        assert seen[("inturn_queue_running", (("queue", "shop"),))] == 2
        assert seen[("inturn_queue_waiting", (("queue", "shop"),))] == 2
        assert seen[("inturn_queue_running", (("queue", "unnamed"),))] == 0
        release.set()
        await asyncio.gather(*tasks)
        await asyncio.gather(shop.run("a", fail), return_exceptions=True)
        await plain.run("x", lambda: None)
        seen = await asyncio.to_thread(scrape, port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    shop_stats = shop.stats()
    completed = (("outcome", "completed"), ("queue", "shop"))
    assert seen[("inturn_turns_total", completed)] == shop_stats.completed == 4
    assert seen[("inturn_turns_total", (("outcome", "failed"), ("queue", "shop")))] == 1
    assert seen[("inturn_turn_hold_seconds_total", (("queue", "shop"),))] > 0
    assert seen[("inturn_turns_total", (("outcome", "completed"), ("queue", "unnamed")))] == 1
    # an untimed queue has no seconds to show, rather than a false 0
    assert ("inturn_turn_hold_seconds_total", (("queue", "unnamed"),)) not in seen
    assert seen[("inturn_queue_running", (("queue", "shop"),))] == 0


async def test_works_replaced_by_newer_ones_are_counted_apart_from_turns() -> None:
    docs = KeyedQueue(name="docs", pending="latest")
    registry = CollectorRegistry()
    registry.register(QueueCollector(docs))
    release = asyncio.Event()

    async def render(draft: int) -> int:
        if draft == 0:
            await release.wait()
        return draft

    calls = [asyncio.create_task(docs.run("doc-1", render, n)) for n in range(5)]
    await asyncio.sleep(0)  # 0 renders; 1 to 4 each take the waiting one's place
    release.set()
    assert await asyncio.gather(*calls) == [0, 4, 4, 4, 4]
    sample = registry.get_sample_value
    assert sample("inturn_superseded_total", {"queue": "docs"}) == 3
    assert sample("inturn_turns_total", {"queue": "docs", "outcome": "completed"}) == 2
