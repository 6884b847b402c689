"""Background capture: a capture thread that takes queued keys one at a time while the engine serves, and the
serving thread's side of it (installing what it finished between steps, waiting for it).

The capture thread only captures, through the capture job's one capture sequence and under the
registry's capture context.  What it finishes waits, as a record (``Captured``, ``TaskDone``),
until the serving thread installs it between two steps (at the start of ``run()``, and in
``wait_captured()``, ``capture()``, ``release()`` and ``clear()``), so the entries and routes the
hot path reads only ever change on the thread that runs it.

Progress under a busy serving loop: an engine whose eager step is host-bound calls ``run()``
back to back, so a thread that only ran between steps would never run.  A step whose batch no
live graph serves, but a key being captured would, moves that key to the front of the queue and
runs eagerly, unless the key is in flight and expected within ``WAIT_SHARE`` of an eager step (the
capture thread's own time for that key, against recent eager steps): then it waits for it (for no
longer) and replays it.  The capture gets on under any loop through the share a step's start hands it (below).
Once graphs serve, a replay leaves the GIL free
while the GPU works, which is when the capture thread takes the rest.

Serving first: every torch op releases the GIL and takes it back, so a step's host work beside a capture
thread running the model waits for the GIL at each op (figures in docs/background.md).  So the capture thread steps
aside while ``run()`` is in progress and not waiting for it: it waits at its next Python call or return (a profile
function on that thread; or before its next torch op, a torch function mode: ``STAND_ASIDE_BY``) until the turn is
back (at most ``PAUSE_LIMIT_S`` at a stretch, then it runs beside the rest of that run()), and takes the GIL while
the serving thread waits for the GPU or builds the next batch.  Under ``run()`` called back to back it would get
little, so a step's start hands it the share it is owed (``CAPTURE_SHARE`` of the time it stood aside, less what it
had between steps): the capture gets on, and a step waits for it a bounded share rather than beside it (two threads
trading the GIL at every op made steps up to 9x slower).  The interpreter's switch interval is also shortened while it
runs (``SWITCH_INTERVAL_S``) so the serving thread gets the GIL back quickly outside ``run()``.
"""

from __future__ import annotations

import atexit
import gc
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode

from cgregistry.capture.job import BACKGROUND, CaptureJob, FrozenHeap
from cgregistry.store.catalog import Catalog, Entry, Pair
from cgregistry.key.descriptor import BatchDescriptor
from cgregistry.hooks.events import Events
from cgregistry.warn import warn
from cgregistry.errors import CaptureError

__all__ = ["CAPTURE_SHARE", "EAGER_STEPS_BEFORE_WAIT", "PAUSE_LIMIT_S", "POLL_MAX_S", "SHARE_MAX_S", "SHARE_MIN_S", "STAND_ASIDE_BY", "STILL_S", "SWITCH_INTERVAL_S", "WAIT_LIMIT_S", "WAIT_SHARE", "BackgroundCapture", "Captured", "TaskDone", "background_order"]

# The interpreter's switch interval while a capture thread runs (CPython's default is 5 ms): how long the serving
# thread may wait for the GIL when the capture thread holds it.  None leaves the interval alone.
SWITCH_INTERVAL_S: float | None = 2e-4
# The longest a step waits for the key being captured that would serve it; past it the step runs eagerly, and
# steps do not wait again while the same capture is in flight (a slow compile, say).
WAIT_LIMIT_S = 0.5
# A step waits for the key in flight when it expects it within this share of an eager step's time (a replay after
# the wait costs something too), and for no longer: then it runs eagerly (at most 1 + WAIT_SHARE eager steps in all).
WAIT_SHARE = 0.5
# Steps that run eagerly beside the capture of their key, while the capture thread finishes nothing, before one waits
# for it whatever the wait would cost (at most WAIT_LIMIT_S).  None: never (the share below keeps the capture going).
EAGER_STEPS_BEFORE_WAIT: int | None = None
# The longest the capture thread stands aside at a stretch while run() is in progress (a run() that waits on something
# this thread must do without standing still); then it runs beside the serving thread for the rest of that run() and at
# least a tenth of this.  None: it never stands aside.
PAUSE_LIMIT_S: float | None = 0.5
# How long the serving thread's frame stands still (blocked on a lock the standing capture thread may hold, or in a
# long call) before the capture thread goes on for a millisecond: longer than a step's own waits for the GPU, which
# would otherwise hand the capture thread the GIL just before the step goes on.
STILL_S = 2e-3
# The longest the capture thread sleeps between looks at the turn while it stands aside (from 50 us, doubling): each
# look takes the GIL from the serving thread, whose next op then waits for it.
POLL_MAX_S = 1e-3
# What the capture thread is owed for standing aside: this share of the time it stood aside, less the time it had
# between steps; a step's start waits while it takes what it is owed (at most SHARE_MAX_S at once, and only once it is
# owed SHARE_MIN_S), so under run() called back to back a step costs at most about 1 + CAPTURE_SHARE of itself.
CAPTURE_SHARE = 0.25
SHARE_MIN_S = 1e-3
SHARE_MAX_S = 0.025
# How the capture thread finds the moments to stand aside: "profile" (a profile function on that thread: at each Python
# call and return), or "torch_function" (a torch function mode on that thread: before each torch op).  From Python 3.12
# a profile function on one thread makes every thread's Python run instrumented, the serving thread's included; the
# mode spares that, but Python between torch ops (a dynamo compile included) runs beside run(), torch's nn fast paths
# (TransformerEncoderLayer, MultiheadAttention) are off while a mode is active, so a background capture records other
# kernels than a foreground one, and a compiled frame guards on the mode stack (it compiles again on that thread).
STAND_ASIDE_BY = "profile"



@attrs.frozen(slots=True)
class Captured:
    """A key the capture thread finished: its entry, or the ``CaptureError`` that stopped it, and the capture context
    it ran under (installed only while the registry's is still that one)."""

    pair: Pair
    entry: Entry | None
    error: BaseException | None
    context: Any = None


@attrs.frozen(slots=True)
class TaskDone:
    """A task the capture thread ran (a refit): its result or error, for ``on_done`` on the serving thread."""

    result: Any
    error: BaseException | None
    on_done: Callable[[Any, BaseException | None], None]


@attrs.frozen(slots=True)
class _Task:
    run: Callable[[], Any]
    on_done: Callable[[Any, BaseException | None], None]
    first: bool = False  # ahead of every key, a step's own included, and run before the heap is frozen


_instances: weakref.WeakSet[BackgroundCapture] = weakref.WeakSet()
_switch_lock = threading.Lock()
# capture threads running, the interval before the first lowered it, and the interval as read back once lowered
# (the interpreter keeps it in microseconds: 2e-4 reads back as 0.00019999999999999998)
_switch_state: list[Any] = [0, None, None]


def background_order(pairs: Iterable[Pair]) -> list[Pair]:
    """Capture order beside a serving thread: the largest key of each kind first, so that every batch a kind
    can serve gets a graph soon (padded, but a padded replay beats an eager step), mixed kinds before uniform
    ones (a mixed key covers uniform batches too, and a new request's first step is a prefill); then the others
    from the smallest up, so the padding of the small, frequent batches falls first."""

    def size(pair: Pair) -> tuple[int, int]:
        return (pair[0].num_tokens, pair[0].num_reqs or 0)

    pairs = list(pairs)
    largest: dict[tuple, Pair] = {}
    for pair in pairs:
        key, strategy = pair
        kind = (strategy, key.kind, key.num_active_loras)
        if kind not in largest or size(pair) > size(largest[kind]):
            largest[kind] = pair
    first = sorted(largest.values(), key=lambda pair: (pair[0].uniform, size(pair)))
    chosen = set(first)
    return first + sorted((p for p in pairs if p not in chosen), key=size)


class BackgroundCapture:
    """One registry's capture thread (started when there is work, ended when there is none) and its results."""

    def __init__(self, job: CaptureJob, catalog: Catalog, events: Events, name: str, pacer: Any = None) -> None:
        self._job = job  # captures each key (capture_key) and holds the registry's capture context
        self._pacer = pacer  # the backend's step pacer (cuda), or None
        self._catalog = catalog
        self._events = events
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Pair, Any] | _Task] = deque()  # (pair, capture context) or a task
        self._thread: threading.Thread | None = None
        self._in_flight: Pair | _Task | None = None
        self._flight_context: Any = None  # the capture context the key in flight runs under
        self._flight_stale = False  # the key in flight was counted as stale (its context is no longer the registry's)
        self._dropped: set[Pair] = set()  # in flight but no longer wanted: its result is discarded
        self._ready: deque[Captured | TaskDone] = deque()  # filled by the capture thread, emptied by the serving thread
        self._started = 0  # items the capture thread began
        self._gave_up = -1  # the item in flight when a step last waited in vain (steps do not wait on it again)
        self._finished = 0  # items the capture thread finished
        self._finished_seen = 0  # ... when a step last ran eagerly instead of waiting
        self._unwaited = 0  # steps that ran eagerly instead of waiting since the capture thread last finished an item
        self._flight_began = 0.0  # when the item in flight began (time.monotonic)
        self._aside = 0.0  # seconds the capture thread stood aside for run(), in all
        self._aside_since: float | None = None  # when the stand in progress began
        self._aside_at_flight = 0.0  # self._aside when the item in flight began
        self._owed_from = (time.monotonic(), 0.0)  # (when, self._aside then): what the capture thread is owed since
        self._ran: deque[tuple[Pair, float]] = deque(maxlen=32)  # the capture thread's own seconds for the keys it finished lately
        self._took: dict[Pair, float] = {}  # the capture thread's own seconds for each key, at its last capture of it
        self._frozen: FrozenHeap | None = None  # the heap frozen while the thread has work
        self._unreached: list[weakref.ref[Any]] = []  # what a task dropped that a cycle keeps, under the frozen heap
        self.eager_s: float | None = None  # a recent eager step's seconds beside a capture (moving average)
        self.active = False  # work queued or in flight, or results not installed: run() installs between steps
        self._stopped = False  # the registry is gone: the capture thread takes nothing more
        self._serving: list[None] | None = None  # the server's turn: empty while a run() is in progress
        self.waiting: list[None] = []  # non-empty while the serving side waits for the capture thread
        self._nudge = threading.Event()  # set while share() waits: wakes the capture thread from a stand at once
        self.runs = 0  # run() calls begun while the capture thread had work
        self.holding: list[None] = []  # non-empty while the capture thread holds a lock run() takes
        self.serving_thread: int | None = None  # the thread of the latest run(), watched while standing aside
        _instances.add(self)

    def serve_first(self, turn: list[None]) -> None:
        """Step aside for the ``run()`` whose turn is ``turn`` (a list holding one item while no run() is in progress)."""
        self._serving = turn

    # ---------------------------------------------------------------- reading

    @property
    def busy(self) -> bool:
        """Work queued or in flight (a task included)."""
        return bool(self._queue) or self._in_flight is not None

    @property
    def settled(self) -> bool:
        """Nothing queued, in flight, or finished and not installed yet."""
        with self._cond:
            return not self.busy and not self._ready

    def queued(self) -> list[Pair]:
        """Keys waiting or being captured now, in capture order."""
        with self._cond:
            flight = self._in_flight
            head = [flight] if isinstance(flight, tuple) and flight not in self._dropped else []
            return head + [item[0] for item in self._queue if isinstance(item, tuple)]

    def capturing(self) -> list[Pair]:
        """Keys queued, in flight, or finished and not installed yet (not served by a graph yet; one whose capture
        failed is listed until the install moves it to ``failures()``: never in neither)."""
        return self.queued() + [r.pair for r in list(self._ready) if isinstance(r, Captured)]

    def refuse_on_capture_thread(self, call: str) -> None:
        """``call`` from a hook or the step running on the capture thread would wait for that thread itself."""
        if self._job.on_capture_thread():
            raise RuntimeError(
                f"{call} on registry {self._name!r} from its own capture thread (a hook or the step called it while "
                "capturing) would wait for itself"
            )

    # ---------------------------------------------------------------- the serving thread's side

    def submit(self, pairs: Iterable[Pair], context: Any, *, ordered: bool = False) -> None:
        """Queue keys not already queued or in flight, in ``background_order`` (as given with ``ordered``), under
        ``context`` (the registry's capture context now, ``CaptureJob.current()``); start the thread if it is idle.
        Lazy keys among them are the capture thread's from now on (no longer pending).

        Each capture starts under the registry's capture context of that moment.  One in flight under another
        context than ``context`` is never installed: it is dropped (``stats().stale_captures``) and queued again if
        still wanted."""
        pairs = list(pairs) if ordered else background_order(pairs)
        with self._cond:
            known = {item[0] for item in self._queue if isinstance(item, tuple)}
            flight = self._in_flight if isinstance(self._in_flight, tuple) else None
            if flight is not None and self._flight_context != context and flight not in known:
                if flight not in self._dropped or flight in pairs:  # still wanted, or wanted again
                    self._queue.append((flight, context))
                    known.add(flight)
                    if not self._flight_stale:  # counted once per capture
                        self._catalog.counters.stale_captures += 1
                        self._flight_stale = True
                self._dropped.add(flight)
            for pair in pairs:
                if pair == flight and pair in self._dropped and pair not in known:
                    self._dropped.discard(pair)  # wanted again, under the same context: the capture in flight is kept
                elif pair != flight and pair not in known:
                    self._queue.append((pair, context))
                    known.add(pair)
            self._start()
        self._catalog.unplan(pairs)
        self._catalog.set_capturing(self.capturing())

    def submit_task(self, task: Callable[[], Any], on_done: Callable[[Any, BaseException | None], None], *,
                    first: bool = False) -> None:
        """Run ``task()`` on the capture thread after what is queued; ``on_done(result, error)`` runs on the serving
        thread when it is installed (never, if the task is cancelled).  ``first``: before every key (a step's own key
        moved to the front included) and, where the heap is not frozen yet, before it is (a ``gc.collect()`` in it
        then reaches what the engine dropped)."""
        with self._cond:
            if first:
                self._queue.insert(self._first_tasks(), _Task(task, on_done, first=True))
            else:
                self._queue.append(_Task(task, on_done))
            self._start()

    def collect_when_thawed(self, refs: list[weakref.ref[Any]]) -> None:
        """From a task on the capture thread: ``refs`` point at objects it dropped that a reference cycle keeps alive,
        collected now, or once the heap frozen for this thread's work is thawed (a collection does not reach it)."""
        if self._frozen is None:
            gc.collect()
        else:
            self._unreached.extend(refs)

    def _first_tasks(self) -> int:
        """How many tasks queued with ``first`` lead the queue (under the condition's lock)."""
        n = 0
        while n < len(self._queue) and isinstance(self._queue[n], _Task) and self._queue[n].first:  # type: ignore[union-attr]
            n += 1
        return n

    def discard(self, pairs: Iterable[Pair]) -> None:
        """Forget these keys: unqueued, and the one in flight (if among them) never installed."""
        drop = set(pairs)
        with self._cond:
            self._queue = deque(item for item in self._queue if not (isinstance(item, tuple) and item[0] in drop))
            if self._in_flight in drop:
                self._dropped.add(self._in_flight)  # type: ignore[arg-type]
            self._ready = deque(r for r in self._ready if not (isinstance(r, Captured) and r.pair in drop))
        self._catalog.set_capturing(self.capturing())

    def cancel(self) -> int:
        """Drop everything queued, finished or in flight (tasks too: their ``on_done`` never runs), wait for the capture
        in flight to end, and return how many keys were dropped."""
        with self._cond:
            dropped = len(self.capturing())
            self._queue.clear()
            if isinstance(self._in_flight, tuple):
                self._dropped.add(self._in_flight)
        self.wait()
        with self._cond:
            self._ready.clear()
        self._catalog.set_capturing(())
        self.active = False
        return dropped

    def stop(self) -> None:
        """The registry was collected: the capture thread takes nothing more and ends after the capture in flight.

        Takes no lock (it runs as the registry's finalizer, on whichever thread dropped it, perhaps inside a lock)."""
        self._stopped = True

    def install(self) -> None:
        """Between steps, on the serving thread: finished entries go live, failures are kept, tasks' results handed on.

        A key captured under another capture context than the registry's now, or reading watched weights at other
        addresses than they have now (replaced while it was captured), is never installed: it is dropped
        (``stats().stale_captures``) and queued again under the current one."""
        tasks = []
        stale: list[Pair] = []
        context = self._job.context
        watch = self._job.watch
        # read once (entries captured since the last change share it), in the context every capture reads it in
        current = self._job.in_recorded_context(watch.seen) if self._ready else {}
        while self._ready:
            done = self._ready.popleft()
            if isinstance(done, TaskDone):
                tasks.append(done)  # handed on once the routes are rebuilt: their hooks see the routes as they are
            elif done.context != context or (done.entry is not None and not watch.reads_current(done.entry.weights, current)):
                # captured under another context, or reading weights a refresh() has since replaced
                if done.pair not in self._catalog.entries:  # else captured in the foreground meanwhile
                    stale.append(done.pair)
            elif done.entry is None:
                self._catalog.fail_capture(done.pair, done.error)  # type: ignore[arg-type]
                warn(
                    f"cgregistry: background {done.error}; the key is dropped and its batches go to the next best "
                    "key (or run eagerly); reg.failures() keeps the error")
            elif done.pair not in self._catalog.entries:  # else captured in the foreground meanwhile
                self._events.evicted(self._catalog.add(done.entry, background=True))
        if stale:
            self._catalog.counters.stale_captures += len(stale)
            if context is not None:
                self.submit(stale, context, ordered=True)
        self._catalog.set_capturing(self.capturing())
        for task in tasks:
            task.on_done(task.result, task.error)
        if not self.busy and not self._ready:
            self.active = False
            self._job.handover.drop()  # what no capture claimed

    def pace(self) -> None:
        """At the start of a step while the capture thread works: keep the serving thread at most a few steps ahead of
        the device (``CudaBackend.step_pacer``), so that the capture's own launches do not wait behind queued steps."""
        if self._pacer is not None and self.busy:
            self.waiting.append(None)  # waiting for the device: the capture thread may take the GIL
            try:
                self._pacer.step()
            finally:
                self.waiting.pop()

    def share(self) -> None:
        """At the start of a step while the capture thread works: let it take what it is owed for standing aside
        (``CAPTURE_SHARE`` of that time, less the time it had between steps), at most ``SHARE_MAX_S``, before the
        step."""
        if self._serving is None or PAUSE_LIMIT_S is None or not self.busy:
            return
        now = time.monotonic()
        since, aside_then = self._owed_from
        stood = self._aside_total(now) - aside_then
        owed = min(CAPTURE_SHARE * stood - (now - since - stood), SHARE_MAX_S)
        if not owed >= SHARE_MIN_S:  # (a NaN setting owes nothing)
            if not owed > 0:  # it had its share between steps: nothing carries over
                self._owed_from = (now, self._aside_total(now))
            return
        self.waiting.append(None)  # the capture thread does not stand aside while this waits
        try:
            self._nudge.set()
            with self._cond:
                self._cond.wait_for(lambda: not self.busy, owed)
        finally:
            self.waiting.pop()
            self._nudge.clear()
        now = time.monotonic()
        self._owed_from = (now, self._aside_total(now))

    def _aside_total(self, now: float) -> float:
        """Seconds the capture thread has stood aside, in all, the stand in progress included."""
        since = self._aside_since
        return self._aside + (now - since if since is not None else 0.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight (True), or ``timeout`` seconds pass (False); installs nothing."""
        self.waiting.append(None)
        try:
            with self._cond:
                return self._cond.wait_for(lambda: not self.busy, timeout)
        finally:
            self.waiting.pop()

    def await_cover(self, actual: BatchDescriptor, exclude: Sequence[str] | frozenset[str]) -> bool:
        """For a step no live graph serves: move the key that would serve ``actual`` (its strategy not in ``exclude``,
        within the padding cap) to the front of the queue, and wait for it (then install what finished) when it is in
        flight and expected within ``WAIT_SHARE`` of an eager step (for no longer), or once
        ``EAGER_STEPS_BEFORE_WAIT`` steps (if set) ran eagerly while the capture thread finished nothing (at most
        ``WAIT_LIMIT_S``).  False without
        waiting otherwise, when no such key is queued, or when a step already waited in vain while the capture in
        flight now ran."""
        cap = self._catalog.cap
        with self._cond:
            if self._gave_up == self._started:
                return False
            flight = self._in_flight if isinstance(self._in_flight, tuple) and self._in_flight not in self._dropped else None
            covering = [
                p for p in ([flight] if flight else []) + [i[0] for i in self._queue if isinstance(i, tuple)]
                if p[1] not in exclude and cap.serves(p[0], actual)
            ]
            if not covering:
                return False
            target = flight if flight in covering else min(covering, key=lambda p: (p[0].num_tokens, p[0].num_reqs or 0))
            if target is not flight:
                at = next(i for i, item in enumerate(self._queue) if isinstance(item, tuple) and item[0] == target)
                item = self._queue[at]
                del self._queue[at]
                self._queue.insert(self._first_tasks(), item)
            if self._finished != self._finished_seen:  # the capture got on since the last step that did not wait
                self._finished_seen, self._unwaited = self._finished, 0
            limit = WAIT_LIMIT_S
            if target is flight and self._done_before_eager(target):
                # Expected within WAIT_SHARE of an eager step: past that the estimate was wrong, and the step runs
                # eagerly (a wrong estimate costs WAIT_SHARE of an eager step more, not WAIT_LIMIT_S).
                limit = min(WAIT_LIMIT_S, WAIT_SHARE * self.eager_s)  # type: ignore[operator]
            elif EAGER_STEPS_BEFORE_WAIT is None or self._unwaited < EAGER_STEPS_BEFORE_WAIT:
                self._unwaited += 1
                return False
            self._unwaited = 0
            self.waiting.append(None)
            try:
                done = self._cond.wait_for(lambda: self._in_flight != target and not self._queued(target), limit)
            finally:
                self.waiting.pop()
            if not done:
                self._gave_up = self._started
        self.install()
        return done

    def saw_eager(self, seconds: float) -> None:
        """A step ran eagerly beside the capture, in ``seconds``: what waiting for a key is weighed against."""
        self.eager_s = seconds if self.eager_s is None else 0.8 * self.eager_s + 0.2 * seconds

    def _done_before_eager(self, pair: Pair) -> bool:
        """Whether the key in flight is expected to be captured within ``WAIT_SHARE`` of an eager step: what its capture
        is expected to take (``_expected``) less what the capture thread has run of it (standing aside not counted).
        False while either is unknown."""
        if self.eager_s is None:
            return False
        typical = self._expected(pair)
        if typical is None:
            return False
        now = time.monotonic()
        aside = self._aside_total(now) - self._aside_at_flight
        return typical - (now - self._flight_began - aside) <= WAIT_SHARE * self.eager_s

    def _expected(self, pair: Pair) -> float | None:
        """The capture thread's own seconds for ``pair``: its time at its last capture of the key; else the key's last
        foreground capture time, scaled as the keys the thread finished lately were against theirs; else the median of
        those keys, or of the registry's keys of its strategy.  Keys differ tenfold (a 512-token mixed key against a
        decode key), so a key's own time comes first.  None while nothing is known."""
        own = self._took.get(pair)
        if own is not None:
            return own
        foreground = self._catalog.took
        if pair in foreground:
            slower = [seconds / foreground[p] for p, seconds in self._ran if foreground.get(p)]
            return foreground[pair] * (statistics.median(slower) if slower else 1.0)
        if self._ran:
            return statistics.median(seconds for _, seconds in self._ran)
        seconds = [e.capture_seconds for (_, strategy), e in list(self._catalog.entries.items()) if strategy == pair[1]]
        return statistics.median(seconds) if seconds else None

    # ---------------------------------------------------------------- the capture thread

    def _queued(self, pair: Pair) -> bool:
        return any(isinstance(item, tuple) and item[0] == pair for item in self._queue)

    def _start(self) -> None:
        """Start the capture thread if there is work and none runs (under the condition's lock)."""
        if self._queue:
            self.active = True
            if self._thread is None:
                self._owed_from = (time.monotonic(), self._aside)
                self._thread = threading.Thread(target=self._loop, name=f"cgregistry-capture-{self._name}", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        self._job.mark_capture_thread(True)
        _shorten_switch_interval()
        undo = None
        try:
            if self._serving is not None and PAUSE_LIMIT_S is not None:
                undo = _stand_aside_on(self.step_aside_hook(self._serving, PAUSE_LIMIT_S))  # this thread's only
            while True:
                self.holding.append(None)  # the serving thread takes this lock in run(): never stand aside holding it
                try:
                    with self._cond:
                        if self._stopped:
                            self._queue.clear()
                        if not self._queue:
                            self._thread = None
                            self._cond.notify_all()
                            return
                        item = self._queue[0]  # in flight before it leaves the queue: no moment reads as neither
                        self._in_flight = item if isinstance(item, _Task) else item[0]
                        self._queue.popleft()
                        if self._frozen is None and not (isinstance(item, _Task) and item.first):  # (FrozenHeap)
                            self._frozen = FrozenHeap()
                            self._frozen.__enter__()
                        if isinstance(item, tuple) and self._job.context is not None:
                            item = (item[0], self._job.context)  # the registry's capture context as the capture starts
                        self._flight_context = None if isinstance(item, _Task) else item[1]
                        self._flight_stale = False
                        self._started += 1
                        self._flight_began, self._aside_at_flight = time.monotonic(), self._aside
                finally:
                    self.holding.pop()
                self._finish(item, *self._run(item))
                if self._unreached and self._frozen is None:  # thawed: a collection reaches them now
                    unreached, self._unreached = self._unreached, []
                    if any(ref() is not None for ref in unreached):
                        gc.collect()
        finally:
            with self._cond:
                self._thaw()
            if undo is not None:
                undo()
            _restore_switch_interval()
            self._job.mark_capture_thread(False)

    def step_aside_hook(self, turn: list[None], limit: float) -> Callable[[Any, str, Any], None]:
        """The capture thread's stand-aside check (``_stand_aside_on``: at each Python call and return, or before each
        torch op): it waits while a run() is in progress and not waiting for this thread, at most ``limit`` seconds at a
        stretch; then this thread runs beside the serving one for the rest of that run() and at least a tenth of
        ``limit``.  While it stands aside it watches the serving thread's frame: when that does not move for
        ``STILL_S`` (blocked on a lock this thread holds, say, in the step's own code, a logging handler or an
        import), it goes on for a millisecond instead of stalling that run()."""
        waiting, holding, nap, clock, frames = self.waiting, self.holding, self._nudge.wait, time.monotonic, sys._current_frames
        free: list[Any] = [None, 0.0]  # the run() the stand ran out in, and the least time this thread then runs

        def step_aside(frame: Any, event: str, arg: Any) -> None:
            if turn or waiting or holding:
                if not holding:
                    free[0] = None
                return
            if free[0] is not None:
                if free[0] == self.runs or clock() < free[1]:
                    return
                free[0] = None
            now = clock()
            end = now + limit
            self._aside_since = now
            seen, moved, pause = None, now, 5e-5
            try:
                while not turn and not waiting:
                    if clock() > end:
                        free[0], free[1] = self.runs, clock() + limit / 10
                        return
                    nap(pause)  # each look takes the GIL: soon after a short run(), seldom in a long one
                    pause = min(2 * pause, POLL_MAX_S)
                    frame = frames().get(self.serving_thread)
                    if frame is None:  # no run() thread to watch (not known, or gone): the limit alone bounds the stand
                        continue
                    at = (id(frame), frame.f_lasti)
                    if at != seen:
                        seen, moved = at, clock()
                        continue
                    if clock() - moved >= STILL_S:  # the serving thread is not running Python: blocked (on a lock this
                        free[0], free[1] = -1, clock() + 1e-3  # thread may hold) or in a long call; go on a while
                        return
            finally:
                self._aside += clock() - now
                self._aside_since = None

        return step_aside

    def _run(self, item: tuple[Pair, Any] | _Task) -> tuple[Any, BaseException | None]:
        try:
            if isinstance(item, _Task):
                return item.run(), None
            return self._job.capture_key(item[0], item[1], BACKGROUND), None
        except BaseException as exc:  # reported to the serving thread, never lost in this one
            return None, exc

    def _finish(self, item: tuple[Pair, Any] | _Task, result: Any, error: BaseException | None) -> None:
        self.holding.append(None)
        try:
            self._finish_holding(item, result, error)
        finally:
            self.holding.pop()

    def _finish_holding(self, item: tuple[Pair, Any] | _Task, result: Any, error: BaseException | None) -> None:
        with self._cond:
            if isinstance(item, _Task):
                self._ready.append(TaskDone(result, error, item.on_done))
            elif item[0] in self._dropped:
                self._dropped.discard(item[0])
            else:
                if error is None:  # the capture thread's own time for a key: what waiting for one costs
                    ran = time.monotonic() - self._flight_began - (self._aside - self._aside_at_flight)
                    self._ran.append((item[0], ran))
                    self._took[item[0]] = ran
                elif not isinstance(error, CaptureError):
                    error = CaptureError(item[0][0], item[0][1], error)
                self._ready.append(Captured(item[0], result, error, item[1]))
            self._in_flight = self._flight_context = None
            self._finished += 1
            if not self._queue:  # no work left: thawed before a wait for it returns (an engine may freeze its heap next)
                self._thaw()
            self._cond.notify_all()

    def _thaw(self) -> None:
        """The heap as it was before this thread's work (under the condition's lock)."""
        if self._frozen is not None:
            self._frozen.__exit__()
            self._frozen = None


class _StandAsideMode(TorchFunctionMode):
    """Runs the capture thread's stand-aside check before each torch op on that thread (a torch function mode is the
    thread's own: the serving thread's ops never see it).  Not while dynamo traces (the check is no op of the step)."""

    def __init__(self, check: Callable[[Any, str, Any], None]) -> None:
        super().__init__()
        self._check = check

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not torch.compiler.is_compiling():
            self._check(None, "call", None)
        return func(*args, **(kwargs or {}))


def _stand_aside_on(check: Callable[[Any, str, Any], None]) -> Callable[[], None] | None:
    """Have ``check`` run on this thread as ``STAND_ASIDE_BY`` says; what undoes it, or None where nothing was set (a
    profile function the engine set on its threads is left alone: the thread then does not stand aside).  An unknown
    setting is warned about and taken as "profile": the capture thread never dies of it."""
    how = STAND_ASIDE_BY
    if how not in ("profile", "torch_function"):
        warn(f"cgregistry: cgregistry.capture.background.STAND_ASIDE_BY={how!r}; expected 'profile' or "
             "'torch_function': the capture thread stands aside by a profile function")
        how = "profile"
    if how == "torch_function":
        mode = _StandAsideMode(check)
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)
    if sys.getprofile() is not None:
        return None
    sys.setprofile(check)
    return lambda: sys.setprofile(None)


def _shorten_switch_interval() -> None:
    with _switch_lock:
        _switch_state[0] += 1
        if _switch_state[0] == 1 and SWITCH_INTERVAL_S is not None and SWITCH_INTERVAL_S < sys.getswitchinterval():
            _switch_state[1] = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            _switch_state[2] = sys.getswitchinterval()


def _restore_switch_interval() -> None:
    with _switch_lock:
        _switch_state[0] -= 1
        if _switch_state[0] == 0 and _switch_state[1] is not None:
            if sys.getswitchinterval() == _switch_state[2]:  # unless someone else changed it meanwhile
                sys.setswitchinterval(_switch_state[1])
            _switch_state[1] = _switch_state[2] = None


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, drop queued captures and let the one in flight finish (no capture left open)."""
    deadline = time.monotonic() + 60
    for background in list(_instances):
        background.stop()
        with background._cond:
            background._queue.clear()
        background.wait(timeout=max(0.0, deadline - time.monotonic()))
