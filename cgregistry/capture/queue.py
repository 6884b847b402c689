"""Pending captures: keys (and refits) waiting to be captured on the registry's owner thread, between its steps.

A key's capture is two pieces, its warm-up and its recording (the entry live as it ends); a refit is one.  ``run()``
takes pieces before its step within ``capture_budget`` (seconds a step may spend on them; None: an eager step's measured
time; 0: none while serving), ``capture_pending(seconds)`` in idle time the engine offers.  A piece is never cut short:
one starts while time is left and it is expected to fit (its own last time, else the median of recent pieces of its
phase); a step always starts one, so the capture gets on under any loop.  The key a step's batch needs goes to the
front.  Everything happens on the calling thread, in the call.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from cgregistry.capture.job import CaptureJob, Warmed
from cgregistry.errors import CaptureError
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.store.catalog import Catalog, Pair
from cgregistry.messages import warn

__all__ = ["PendingCaptures", "Task", "capture_order"]

WARM_UP, RECORD, TASK = "warm-up", "record", "task"  # the phases a piece runs, for their expected seconds


def _size(pair: Pair) -> tuple[int, int]:
    return (pair[0].num_tokens, pair[0].num_reqs or 0)


def capture_order(pairs: Iterable[Pair]) -> list[Pair]:
    """Capture order while serving: the largest key of each family (strategy, form, LoRA count) first, so every batch
    gets a graph soon (a padded replay beats an eager step), mixed families before uniform ones (a mixed key covers
    uniform batches too, and a new request's first step is a prefill); then the rest from the smallest up."""
    pairs = list(pairs)
    largest: dict[tuple[Any, ...], Pair] = {}
    for pair in pairs:
        key, strategy = pair
        family = (strategy, key.form, key.num_active_loras)
        if family not in largest or _size(pair) > _size(largest[family]):
            largest[family] = pair
    first = sorted(largest.values(), key=lambda pair: (pair[0].uniform, _size(pair)))
    chosen = set(first)
    return first + sorted((p for p in pairs if p not in chosen), key=_size)


@attrs.frozen(slots=True)
class Task:
    """Work run as one piece among the keys (a refit): ``run()``, then ``on_done(result, error)``."""

    run: Callable[[], Any]
    on_done: Callable[[Any, BaseException | None], None]


class PendingCaptures:
    """One registry's keys and tasks waiting for the owner thread's time, and the pieces that take them."""

    def __init__(self, job: CaptureJob, catalog: Catalog, name: str, budget: float | None = None) -> None:
        self._job = job
        self._catalog = catalog
        self._name = name
        self.budget = budget  # seconds of pieces a run() may take before its step; None: an eager step's; 0: none
        self._queue: deque[Pair | Task] = deque()
        self._warmed: Warmed | None = None  # the key whose warm-up ran: its recording is the next piece
        self.busy = False  # something is pending (a plain attribute: run() reads it at every step)
        self.eager_s: float | None = None  # recent eager steps' seconds (a moving average): the budget when none is set
        self._took: dict[tuple[Pair | None, str], float] = {}  # each key's pieces' seconds at their last run
        self._recent: dict[str, deque[float]] = {phase: deque(maxlen=16) for phase in (WARM_UP, RECORD, TASK)}
        self.idle = threading.Condition()  # notified when nothing is left: a wait_captured() on another thread

    # ---------------------------------------------------------------- what is pending

    def queued(self) -> list[Pair]:
        """Keys pending capture, in the order their pieces run (the one warmed up already first)."""
        head = [self._warmed.pair] if self._warmed is not None else []
        return head + [item for item in self._queue if type(item) is tuple]

    def submit(self, pairs: Iterable[Pair], *, ordered: bool = False) -> None:
        """Queue keys not pending yet, in ``capture_order`` (as given with ``ordered``).  Lazy keys among them are
        pending from now on (no longer lazy)."""
        pairs = list(pairs) if ordered else capture_order(pairs)
        known = set(self.queued())
        for pair in pairs:
            if pair not in known:
                self._queue.append(pair)
                known.add(pair)
        self._catalog.unplan(pairs)
        self._changed()

    def submit_task(self, run: Callable[[], Any], on_done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``run()`` as a piece after what is queued, then ``on_done(result, error)`` (never, if it is cancelled)."""
        self._queue.append(Task(run, on_done))
        self._changed()

    def discard(self, pairs: Iterable[Pair]) -> None:
        """Forget these keys, the one warmed up included."""
        drop = set(pairs)
        self._queue = deque(item for item in self._queue if not (type(item) is tuple and item in drop))
        if self._warmed is not None and self._warmed.pair in drop:
            self._warmed = None
        self._changed()

    def cancel(self) -> int:
        """Drop every key and task; how many keys were dropped."""
        dropped = len(self.queued())
        self._queue.clear()
        self._warmed = None
        self._changed()
        return dropped

    def to_front(self, actual: BatchDescriptor, exclude: frozenset[str] = frozenset()) -> None:
        """``actual``'s batch has no graph: unless the next key to be captured serves it (its strategy not in
        ``exclude``, within the padding cap), the smallest pending key that does is captured next (after the key warmed
        up already, whose recording is the next piece)."""
        cap = self._catalog.cap

        def serves(pair: Pair | Task) -> bool:
            return type(pair) is tuple and pair[1] not in exclude and cap.serves(pair[0], actual)

        warmed = self._warmed
        if (warmed is not None and serves(warmed.pair)) or (warmed is None and self._queue and serves(self._queue[0])):
            return
        covering = [p for p in self._queue if serves(p)]
        if covering:
            target = min(covering, key=_size)
            self._queue.remove(target)
            self._queue.appendleft(target)

    def saw_eager(self, seconds: float) -> None:
        """An eager step took ``seconds``: what a step may spend on pieces when no budget is set."""
        self.eager_s = seconds if self.eager_s is None else 0.8 * self.eager_s + 0.2 * seconds

    def wait(self, timeout: float | None) -> bool:
        """On another thread than the owner: block until nothing is pending (True) or ``timeout`` seconds pass."""
        with self.idle:
            return self.idle.wait_for(lambda: not self.busy, timeout)

    # ---------------------------------------------------------------- pieces

    def before_step(self) -> bool:
        """Pieces inside ``run()``, before its step: at least one, then more while the budget allows (None: an eager
        step's time; 0: none).  Whether a capture piece ran (buffers reset, pool written)."""
        budget = self.budget
        if budget is None:
            budget = self.eager_s or 0.0
        elif budget == 0:
            return False
        return self.work(budget, first=True)

    def work(self, seconds: float, first: bool = False) -> bool:
        """Run pieces for up to ``seconds``, each only while time is left and it is expected to fit (or nothing is known
        of it); ``first``: the first starts whatever it may take.  Whether a capture piece ran."""
        began = time.perf_counter()
        touched = False
        while self.busy:
            if not first:
                left = seconds - (time.perf_counter() - began)
                expected = self._expected()
                if left <= 0 or (expected is not None and expected > left):
                    break
            first = False
            touched |= self._piece()
        return touched

    def _piece(self) -> bool:
        """The next piece: the warmed key's recording, a task, or the next key's warm-up.  A key whose capture fails
        is dropped (kept in ``failures()``, warned about); an interrupt leaves what it stopped pending.  Whether the
        piece captured (rather than ran a task)."""
        job, warmed = self._job, self._warmed
        started = time.perf_counter()
        if warmed is not None:
            if warmed.context != job.context:  # capture() recorded another context since its warm-up: warm up again
                self._warmed = None
                self._queue.appendleft(warmed.pair)
                self._catalog.counters.stale_captures += 1
                self._changed()
                return False
            try:
                job.record_graph(warmed, between_steps=True, queued=True)
            except CaptureError as exc:
                self._failed(warmed.pair, exc)
            except BaseException:  # an interrupt: the key is warmed up again, unless its entry went live already
                if warmed.pair in self._catalog.entries:
                    self._warmed = None
                    self._changed()
                raise
            self._warmed = None
            self._timed(warmed.pair, RECORD, started)
            self._changed()
            return True
        item = self._queue[0]
        if type(item) is Task:
            self._queue.popleft()
            self._changed()
            try:
                result, error = item.run(), None
            except Exception as exc:  # reported through on_done, never lost
                result, error = None, exc
            except BaseException:  # an interrupt: the task runs again as the next piece
                self._queue.appendleft(item)
                self._changed()
                raise
            self._timed(None, TASK, started)
            item.on_done(result, error)
            return False
        try:
            warmed = job.warm_up(item, job.current(), between_steps=True)
        except CaptureError as exc:
            self._failed(item, exc)
            warmed = None
        else:
            self._timed(item, WARM_UP, started)
        self._drop(item)
        self._warmed = warmed
        self._changed()
        if warmed is not None and warmed.skipped:  # no warm-up ran (warm_up_again=False): the recording is this piece
            return self._piece()
        return True

    def _drop(self, item: Pair) -> None:
        """``item``, just warmed up, leaves the queue (wherever it is now: the queue may have changed meanwhile)."""
        queue = self._queue
        if queue and queue[0] is item:
            queue.popleft()
        else:
            self._queue = deque(other for other in queue if other is not item)

    def _failed(self, pair: Pair, error: CaptureError) -> None:
        self._catalog.fail_capture(pair, error)
        warn(f"cgregistry: pending {error}; the key is dropped and its batches go to the next best key (or run "
             "eagerly); reg.failures() keeps the error")

    def _timed(self, pair: Pair | None, phase: str, started: float) -> None:
        seconds = time.perf_counter() - started
        self._took[(pair, phase)] = seconds
        self._recent[phase].append(seconds)

    def _expected(self) -> float | None:
        """Seconds the next piece is expected to take: its own last time, else the median of recent pieces of its
        phase; None while nothing is known."""
        if self._warmed is not None:
            pair, phase = self._warmed.pair, RECORD
        else:
            item = self._queue[0]
            pair, phase = (None, TASK) if type(item) is Task else (item, WARM_UP)
        own = self._took.get((pair, phase))
        if own is not None:
            return own
        recent = self._recent[phase]
        return statistics.median(recent) if recent else None

    def _changed(self) -> None:
        """What is pending changed: the flag run() reads, the keys the catalog lists as capturing, and a wait told."""
        self.busy = bool(self._queue) or self._warmed is not None
        self._catalog.set_capturing(self.queued())
        if not self.busy:
            with self.idle:
                self.idle.notify_all()
