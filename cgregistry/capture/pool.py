"""GraphPool: the memory pool graphs are captured into, the graphs alive in it, and the lock that lets one capture at
a time into it.  Registries given one GraphPool (a drafter beside its target) share their graphs' memory: their
graphs never replay at once, so what one step's graph holds between kernels the other may reuse."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from cgregistry.contracts.protocols import Backend
from cgregistry.messages import warn

__all__ = ["GraphPool", "keep_pool"]


class GraphPool:
    """A pool shared by every registry given it (``GraphRegistry(..., pool=other.pool)``); ``lock`` is held for each
    capture into it, whichever registry and thread captures.

    On a backend that keeps pools usable (cuda: ``keep_pool``) a keeper holds the pool past its graphs, so keys captured
    again after a weight update reuse the dropped graphs' memory.  The keeper is let go, and the pool renewed (its
    memory goes back at ``empty_cache()`` once its graphs are gone), when memory is released (``clear()``, ``sleep()``,
    the last ``release()``) while no sharing registry holds a graph; an unkept pool is renewed once all its graphs died.
    Sharing registries capture on the pool's own streams (the allocator reuses a pool's free blocks only on their
    stream), and an output of any is valid until the next replay of any (their graphs' memory overlaps).
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.device = backend.device()
        self.lock = threading.Lock()
        self.handle: Any = backend.new_pool()
        # What keeps the handle's pool usable with no graph in it: made now (a memory estimate before the first capture
        # then measures a process that holds it, as the capture will), and after a renewal at the next capture.
        self._keeper: Any = keep_pool(backend, self.handle)
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()  # entries alive whose graphs are in this handle
        self._used = False  # a graph was captured into this handle
        self._left = (0, 0)  # (device_bytes, memory_bytes) of dropped entries whose memory the kept pool still holds
        self._left_lock = threading.Lock()
        self._holder = threading.local()  # .name: the registry whose capture holds the lock on this thread
        self._sharers: weakref.WeakSet[Any] = weakref.WeakSet()  # each registry's capture job (its holds_graphs())
        self.registries: weakref.WeakSet[Any] = weakref.WeakSet()  # the registries that capture into it, alive
        # Debug mode's stale-output clock, one for the registries in debug mode that capture into it (their outputs are
        # valid until the next replay of any of them); made by the first.
        self.debug_clock: Any = None

    @property
    def live_graphs(self) -> int:
        """Graphs alive in the pool, of every registry sharing it."""
        return len(self._graphs)

    @property
    def kept(self) -> bool:
        """Whether a keeper holds the pool (its memory stays for the next captures once its graphs died)."""
        return self._keeper is not None

    def renew(self) -> None:
        self.handle = self.backend.new_pool()
        self._let_go()
        self._graphs = weakref.WeakSet()
        self._used = False

    def _let_go(self) -> None:
        self._keeper = None
        with self._left_lock:
            self._left = (0, 0)

    def left_by(self, entries: list[Any]) -> None:
        """``entries`` in this pool were dropped to be captured again: while a keeper holds the pool, what they
        accounted for stays in it, for the next capture into it to account for (``end``)."""
        if self._keeper is None:
            return
        with self._left_lock:
            device, memory = self._left
            for entry in entries:
                device, memory = device + entry.device_bytes, memory + entry.memory_bytes
            self._left = (device, memory)

    def share(self, sharer: Any) -> None:
        """``sharer`` (a registry's capture job, which says whether it ``holds_graphs()``) captures into this pool."""
        self._sharers.add(sharer)

    def renew_if_unused(self, release: bool = False) -> bool:
        """When no registry sharing the pool holds or is capturing a graph: to ``release`` its memory, let its keeper
        go (a capture in progress holds the pool itself); and, unless a keeper holds it or a capture holds the lock, a
        fresh handle (the old pool's memory goes back once its graphs are collected)."""
        if self._keeper is not None and not release:
            return False
        if any(sharer.holds_graphs() for sharer in list(self._sharers)):
            return False
        self._let_go()
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.renew()
        finally:
            self.lock.release()
        return True

    @property
    def used(self) -> bool:
        """Whether a graph was captured into the current handle (a pool never used has nothing to renew)."""
        return self._used

    def begin(self, registry: str, key: Any, strategy: str) -> None:
        """Hold the lock for one capture of ``key`` [``strategy``] by ``registry`` on this thread, into ``handle`` (a fresh
        one if every graph captured into the current one died; kept from now on, where the backend keeps pools, by a
        keeper made on this thread); refused on a thread whose capture holds it already."""
        if self.holder() is not None:
            self.refuse_if_held(f"a capture of {key} [{strategy}]", registry)
        self.lock.acquire()
        try:
            if self._used and not self._graphs and self._keeper is None:  # every graph in it died, and nothing kept it
                self.renew()
            if self._keeper is None:
                self._keeper = keep_pool(self.backend, self.handle)
        except BaseException:
            self.lock.release()
            raise
        self._holder.name = registry

    def end(self, entry: Any = None) -> None:
        """The capture begun on this thread is over; ``entry``, if given, was captured into ``handle`` and accounts for
        what dropped entries left in the kept pool (it took little new memory, yet holds as much): the first capture
        into a pool accounts for the pool, whichever key it is."""
        if entry is not None:
            self._graphs.add(entry)
            self._used = True
            with self._left_lock:
                left, self._left = self._left, (0, 0)
            entry.device_bytes = max(entry.device_bytes, left[0])
            entry.memory_bytes = max(entry.memory_bytes, left[1])
        self._holder.name = None
        self.lock.release()

    def recover(self) -> None:
        """After a failed capture into the pool: what the backend says the pool can still be used as (a new handle,
        kept at its first capture, where the old one takes no more captures; the old one's graphs hold it)."""
        handle = self.backend.recover_pool(self.handle)
        if handle is not self.handle:
            self.handle = handle
            self._let_go()

    def holder(self) -> str | None:
        """The registry whose capture holds the lock on this thread, if any (a capture asked for from inside it would
        wait for itself)."""
        return getattr(self._holder, "name", None)

    def refuse_if_held(self, call: str, registry: str) -> None:
        """``call`` on ``registry`` waits for the lock: refused on a thread whose capture (of any registry sharing the
        pool) holds it, from a hook or the step, where it would wait for itself."""
        holder = self.holder()
        if holder is not None:
            inside = "one of its captures" if holder == registry else f"a capture of registry {holder!r}, which shares its pool,"
            raise RuntimeError(
                f"{call} on registry {registry!r} from inside {inside} on the same thread (a hook or the step asked for "
                "it, through run(), capture() or a wait) would wait for itself: refused")

    def __repr__(self) -> str:
        return f"GraphPool({self.backend.name}, {self.live_graphs} live graphs)"


_unkept: weakref.WeakSet[Any] = weakref.WeakSet()  # backends that failed to keep a pool (warned once each)


def keep_pool(backend: Backend, handle: Any) -> Any:
    """What keeps ``handle``'s pool taking captures once its graphs died (``backend.keep_pool``, made on this thread),
    or None where the backend keeps no pool, or failed to (warned once: keys captured again then take new memory)."""
    keep = getattr(backend, "keep_pool", None)
    if keep is None:
        return None
    try:
        return keep(handle)
    except Exception as exc:
        if backend not in _unkept:
            _unkept.add(backend)
            warn(f"cgregistry: the {backend.name} backend could not keep a graph pool usable ({exc}); keys captured "
                 "again after a weight update take new memory while the dropped graphs' stays cached until "
                 "empty_cache()")
        return None
