"""Background capture: a thread that captures queued keys one at a time while the engine serves.

The worker only captures.  A finished capture (an entry, or its error) waits in ``ready``
until the serving thread installs it between two steps (the registry does so at the start
of ``run()`` and in ``wait_captured()``), so the entries and routes the hot path reads only
ever change on the thread that runs it.  Two things keep a step from waiting on a capture:
while a ``run()`` is in progress the worker pauses at its next Python call or return
(``quiet``), and while the worker has work the interpreter's switch interval is shortened,
so the serving thread gets the GIL back within a fraction of a millisecond between steps.
Knows nothing of the registry.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from cgregistry import runtime
from cgregistry.descriptor import BatchDescriptor
from cgregistry.entries import Entry

__all__ = ["PAUSE_LIMIT_S", "SWITCH_INTERVAL_S", "CaptureWorker", "Finished"]

Pair = tuple[BatchDescriptor, str]

# The interpreter's switch interval while a worker has work (CPython's default is 5 ms): how long the
# serving thread may wait for the GIL when the worker holds it.  None leaves the interval alone.
SWITCH_INTERVAL_S: float | None = 2e-4
# The longest the capture thread stays paused for one step.  A step may be waiting for something the
# paused thread holds (dynamo's compile lock, a logging or import lock, an engine's own lock); after this
# long the thread runs on until the step ends, so such a step waits for that, never forever.
PAUSE_LIMIT_S = 0.05

# (key, strategy), the entry or the error; for a task (``submit_task``): (None, its result, its error)
Finished = tuple["Pair | None", Any, "BaseException | None"]

_workers: weakref.WeakSet[CaptureWorker] = weakref.WeakSet()
_switch_lock = threading.Lock()
_switch_state: list[Any] = [0, None]  # capture threads running, the interval before the first lowered it


def _shorten_switch_interval() -> None:
    with _switch_lock:
        _switch_state[0] += 1
        if _switch_state[0] == 1 and SWITCH_INTERVAL_S is not None and SWITCH_INTERVAL_S < sys.getswitchinterval():
            _switch_state[1] = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)


def _restore_switch_interval() -> None:
    with _switch_lock:
        _switch_state[0] -= 1
        if _switch_state[0] == 0 and _switch_state[1] is not None:
            if sys.getswitchinterval() == SWITCH_INTERVAL_S:  # unless someone else changed it meanwhile
                sys.setswitchinterval(_switch_state[1])
            _switch_state[1] = None


class CaptureWorker:
    """Captures queued (key, strategy) pairs on one thread, started when there is work and ended when there is none."""

    def __init__(self, capture_one: Callable[[Pair, Any], Entry], name: str) -> None:
        self._capture_one = capture_one
        self._name = name
        self._queue: deque[tuple[Pair | None, Any]] = deque()  # (pair, payload), or (None, task)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._dropped: set[Pair] = set()
        self._tasks = 0  # tasks queued or running
        self.in_flight: Pair | None = None
        self.ready: deque[Finished] = deque()  # filled by the worker, emptied by the serving thread
        self.quiet = threading.Event()  # set while no run() is in progress: the worker may run Python
        self.quiet.set()
        self._steps = 0  # steps begun (step_started)
        self._released = -1  # the step during which the pause gave up (PAUSE_LIMIT_S)
        self.thread_id: int | None = None  # the capture thread's ident while it runs
        _workers.add(self)

    # ---------------------------------------------------------------- the serving thread's side

    def submit(self, pairs: Iterable[Pair], payload: Any) -> None:
        """Queue pairs not already queued or in flight; start the thread if it is not running."""
        with self._cond:
            known = {p for p, _ in self._queue} | ({self.in_flight} if self.in_flight else set())
            for pair in pairs:
                if pair == self.in_flight and pair in self._dropped:
                    self._dropped.discard(pair)  # wanted again: the capture in flight is kept after all
                    continue
                if pair not in known:
                    self._queue.append((pair, payload))
                    known.add(pair)
                    self._dropped.discard(pair)
            if self._queue and self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"cgregistry-capture-{self._name}", daemon=True)
                self._thread.start()

    def submit_task(self, task: Callable[[], Any]) -> None:
        """Run ``task()`` on the capture thread after what is queued (paused during steps like a capture);
        its result (or error) reaches ``ready`` as ``(None, result, error)``."""
        with self._cond:
            self._queue.append((None, task))
            self._tasks += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"cgregistry-capture-{self._name}", daemon=True)
                self._thread.start()

    def queued(self) -> list[Pair]:
        """Pairs waiting or being captured now, in capture order."""
        with self._cond:
            head = [self.in_flight] if self.in_flight is not None and self.in_flight not in self._dropped else []
            return head + [p for p, _ in self._queue if p is not None]

    @property
    def busy(self) -> bool:
        """Work queued or in flight (a task included)."""
        return bool(self._queue) or self.in_flight is not None or self._tasks > 0

    def discard(self, pairs: Iterable[Pair]) -> None:
        """Forget these pairs: unqueued, and the one in flight (if among them) never reaches ``ready``."""
        drop = set(pairs)
        with self._cond:
            self._queue = deque(item for item in self._queue if item[0] is None or item[0] not in drop)
            if self.in_flight in drop:
                self._dropped.add(self.in_flight)

    def cancel(self) -> None:
        """Drop everything queued and the capture in flight (it finishes, then is discarded)."""
        with self._cond:
            self._tasks -= sum(1 for pair, _ in self._queue if pair is None)
            self._queue.clear()
            if self.in_flight is not None:
                self._dropped.add(self.in_flight)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight (True), or ``timeout`` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.busy, timeout)

    # ---------------------------------------------------------------- the capture thread

    def step_started(self) -> None:
        """The serving thread begins a step: the capture thread pauses at its next Python call or return."""
        self._steps += 1
        self.quiet.clear()

    def step_ended(self) -> None:
        self.quiet.set()

    def _pause(self, frame: Any, event: str, arg: Any) -> None:
        """Profile function of the capture thread: wait while a step is running (a GIL-free wait), at most
        ``PAUSE_LIMIT_S`` per step."""
        if not self.quiet.is_set() and self._released != self._steps:
            if not self.quiet.wait(PAUSE_LIMIT_S):
                self._released = self._steps

    def _loop(self) -> None:
        self.thread_id = threading.get_ident()
        _shorten_switch_interval()
        runtime.background_gates.add(self.quiet)
        try:
            while True:
                with self._cond:
                    if not self._queue:
                        self.in_flight = None
                        self._thread = None
                        self._cond.notify_all()
                        return
                    pair, payload = self._queue.popleft()
                    self.in_flight = pair
                result: Any = None
                error: BaseException | None = None
                sys.setprofile(self._pause)
                try:
                    result = payload() if pair is None else self._capture_one(pair, payload)
                except BaseException as exc:  # reported to the serving thread, never lost in this one
                    error = exc
                finally:
                    sys.setprofile(None)
                with self._cond:
                    if pair is None:
                        self._tasks -= 1
                        self.ready.append((None, result, error))
                    elif pair in self._dropped:
                        self._dropped.discard(pair)
                    else:
                        self.ready.append((pair, result, error))
                    self.in_flight = None
                    self._cond.notify_all()
        finally:
            runtime.background_gates.discard(self.quiet)
            _restore_switch_interval()
            self.thread_id = None


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, drop queued captures and let the one in flight finish (no capture left open)."""
    for worker in list(_workers):
        worker.cancel()
        worker.quiet.set()
        worker.wait(timeout=60)
