"""Metrics of inturn's queues through the OpenTelemetry API: ``pip install "inturn[otel]"``.

::

    from inturn import KeyedQueue, default_queue
    from inturn.otel import instrument

    shop = KeyedQueue(name="shop", max_running=32)
    instrument(shop, default_queue)  # instrument() alone: the default queue

This module depends on ``opentelemetry-api`` only: the application sets up
the SDK (its ``MeterProvider``, readers and exporters) as for any other
instrumented library, and until it does, every record is a no-op. Importing
:mod:`inturn` never imports OpenTelemetry.

Instruments, on the meter ``inturn``:

| name | kind | unit | what |
|---|---|---|---|
| `inturn.turn.wait.duration` | histogram | s | asking for a turn to its start (line, grant, slot) |
| `inturn.turn.hold.duration` | histogram | s | a turn's start to its end |
| `inturn.turn.timeouts` | counter | {turn} | not reached within `timeout`, or cut by `max_hold` |
| `inturn.turn.refused` | counter | {turn} | refused by `max_pending` (`QueueFull`) |
| `inturn.turn.lease_lost` | counter | {turn} | the work returned, its lease lost (`LeaseLost`) |
| `inturn.turn.errors` | counter | {turn} | the work raised, or the backend could not grant |
| `inturn.turn.superseded` | counter | {turn} | never ran: newer work took its place |
| `inturn.queue.waiting` | gauge | {turn} | turns waiting now, for a key or a slot |
| `inturn.queue.running` | gauge | {turn} | work running now |

Every instrument carries ``inturn.queue.name``: the queue's ``name=`` (or
``"unnamed"``). The histograms and counters also carry
``code.function.name``, the ``module.qualname`` of the function the turn
runs (a decorated function, or what ``run()``, ``run_sync()`` or
``submit()`` was given), left out for a ``keyed()`` block outside any of
those. Keys are never an attribute: there are as many as the application
has rows or accounts, which no metrics backend can store. The gauges read
:meth:`~inturn.KeyedQueue.stats` when the reader collects.

An instrumented queue takes each of its turns through the general, timed
path (about 9 µs an uncontended turn, against 0.8 µs), and the SDK adds its
own cost per record (about 8.5 µs on a 2-core VM, two records a turn); a
queue that is not instrumented pays nothing (see
:meth:`~inturn.KeyedQueue.observe`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import final

try:
    from opentelemetry import metrics
    from opentelemetry.metrics import (
        CallbackOptions,
        Counter,
        Histogram,
        MeterProvider,
        Observation,
    )
except ImportError as error:  # pragma: no cover - depends on the install (tested in a subprocess)
    raise ImportError(
        "inturn: inturn.otel needs the OpenTelemetry API (opentelemetry-api>=1.30), "
        "which could not be imported: pip install 'inturn[otel]'"
    ) from error

from . import KeyedQueue, LeaseLost, QueueFull, Superseded, __version__, default_queue
from ._describe import describe

__all__ = ("instrument", "uninstrument")

#: Bucket boundaries for the durations, in seconds: from a hand-off within a
#: process (tens of microseconds) to a line that waits for minutes.
_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

Attributes = Mapping[str, str]


@final
class _Instruments:
    """One meter provider's instruments, shared by every queue instrumented with it."""

    def __init__(self, provider: MeterProvider | None) -> None:
        meter = metrics.get_meter("inturn", __version__, meter_provider=provider)

        def seconds(name: str, description: str) -> Histogram:
            return meter.create_histogram(
                name,
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=_BUCKETS,
            )

        def turns(name: str, description: str) -> Counter:
            return meter.create_counter(name, unit="{turn}", description=description)

        self.wait = seconds("inturn.turn.wait.duration", "Time from asking for a turn to its start")
        self.hold = seconds("inturn.turn.hold.duration", "Time from a turn's start to its end")
        self.timeouts = turns(
            "inturn.turn.timeouts",
            "Turns not reached within their timeout, and work cut by max_hold",
        )
        self.refused = turns(
            "inturn.turn.refused", "Work refused at once by max_pending (QueueFull)"
        )
        self.lease_lost = turns(
            "inturn.turn.lease_lost",
            "Work that returned, but whose turn the backend could not vouch for",
        )
        self.errors = turns(
            "inturn.turn.errors", "Work that raised, and turns the backend could not grant"
        )
        self.superseded = turns(
            "inturn.turn.superseded", "Work that never ran: newer work for its key took its place"
        )
        #: The queues instrumented with this provider, and their attributes.
        self.queues: weakref.WeakKeyDictionary[KeyedQueue, Attributes] = weakref.WeakKeyDictionary()
        meter.create_observable_gauge(
            "inturn.queue.waiting",
            callbacks=[self._waiting],
            unit="{turn}",
            description="Turns waiting now, for a key or a running slot",
        )
        meter.create_observable_gauge(
            "inturn.queue.running",
            callbacks=[self._running],
            unit="{turn}",
            description="Work running now",
        )

    def _instrumented(self) -> list[tuple[KeyedQueue, Attributes]]:
        """The queues and their attributes now (read in the exporter's thread: see _QUEUES)."""
        with _QUEUES:
            return list(self.queues.items())

    def _waiting(self, options: CallbackOptions) -> Iterable[Observation]:
        for queue, attributes in self._instrumented():
            stats = queue.stats()
            yield Observation(sum(stats.waiting.values()) + stats.waiting_for_slot, attributes)

    def _running(self, options: CallbackOptions) -> Iterable[Observation]:
        for queue, attributes in self._instrumented():
            yield Observation(queue.stats().running, attributes)


@final
class _Metrics:
    """The observer of one queue: records each turn to the instruments (see inturn.Observer)."""

    __slots__ = ("_by_function", "_instruments")

    def __init__(self, instruments: _Instruments, base: Attributes) -> None:
        self._instruments = instruments
        # function -> its attributes: as many as the functions that take turns (None: base)
        self._by_function: dict[str | None, Attributes] = {None: base}

    def _attributes(self, function: str | None) -> Attributes:
        attributes = self._by_function.get(function)
        if attributes is None:
            attributes = {**self._by_function[None], "code.function.name": str(function)}
            self._by_function[function] = attributes
        return attributes

    def started(self, waited: float, function: str | None) -> None:
        self._instruments.wait.record(waited, self._attributes(function))

    def ended(
        self, held: float | None, error: BaseException | None, cut: bool, function: str | None
    ) -> None:
        instruments = self._instruments
        attributes = self._attributes(function)
        if held is not None:
            instruments.hold.record(held, attributes)
        if error is None:
            return
        if cut:
            instruments.timeouts.add(1, attributes)
        elif isinstance(error, LeaseLost):
            instruments.lease_lost.add(1, attributes)
        elif isinstance(error, Exception):
            instruments.errors.add(1, attributes)
        # (a cancelled or interrupted turn is neither)

    def missed(self, error: BaseException, function: str | None) -> None:
        instruments = self._instruments
        attributes = self._attributes(function)
        if isinstance(error, QueueFull):
            instruments.refused.add(1, attributes)
        elif isinstance(error, Superseded):
            instruments.superseded.add(1, attributes)
        elif isinstance(error, TimeoutError):
            instruments.timeouts.add(1, attributes)
        elif isinstance(error, Exception):
            instruments.errors.add(1, attributes)


#: Each meter provider's instruments (None: the global provider's), made once, under _LOCK.
_INSTRUMENTS: dict[MeterProvider | None, _Instruments] = {}
_LOCK = threading.Lock()
#: Held to change or read which queues an _Instruments has (after _LOCK, if both), and
#: never while calling OpenTelemetry: its collection calls the gauges' callbacks,
#: which take it, while holding a lock that making instruments takes too.
_QUEUES = threading.Lock()


def instrument(*queues: KeyedQueue, meter_provider: MeterProvider | None = None) -> None:
    """Record the turns of ``queues`` (none given: the default queue) to OpenTelemetry.

    From now on, each turn's wait and hold, and each timeout, refusal, lost
    lease and error, are recorded to the instruments listed in this
    module's docstring, on the meter ``inturn`` of ``meter_provider`` (by
    default the global one, ``opentelemetry.metrics.get_meter_provider()``,
    which an application may set before or after this call). A turn already
    running is not recorded, or only its end (an error, say), without its
    hold time. Instrumenting a queue again moves it to ``meter_provider``.

    :raises TypeError: something other than a :class:`~inturn.KeyedQueue` was given.
    """
    chosen = queues or (default_queue,)
    for queue in chosen:
        if not isinstance(queue, KeyedQueue):
            raise TypeError(f"inturn: instrument() takes KeyedQueue objects, got {describe(queue)}")
    with _LOCK:
        instruments = _INSTRUMENTS.get(meter_provider)
        if instruments is None:
            instruments = _INSTRUMENTS[meter_provider] = _Instruments(meter_provider)
    for queue in chosen:
        base = {"inturn.queue.name": queue.name or "unnamed"}
        with _LOCK, _QUEUES:
            for other in _INSTRUMENTS.values():
                other.queues.pop(queue, None)
            instruments.queues[queue] = base
        queue.observe(_Metrics(instruments, base))


def uninstrument(*queues: KeyedQueue) -> None:
    """Stop recording the turns of ``queues`` (none given: the default queue)."""
    for queue in queues or (default_queue,):
        queue.observe(None)
        with _LOCK, _QUEUES:
            for instruments in _INSTRUMENTS.values():
                instruments.queues.pop(queue, None)
