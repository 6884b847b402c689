"""GraphPool: the memory pool graphs are captured into, the graphs alive in it, and the lock that lets one capture at
a time into it.  Registries given one GraphPool (a drafter beside its target) share their graphs' memory: their
graphs never replay at once, so what one step's graph holds between kernels the other may reuse."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from cgregistry.contracts.protocols import Backend

__all__ = ["GraphPool"]


class GraphPool:
    """A pool shared by every registry given it (``GraphRegistry(..., pool=other.pool)``).

    On a backend that keeps pools usable (cuda: ``new_kept_pool``) the pool outlives its graphs: a key captured again
    after a weight update or a wake reuses what the dropped graphs held, instead of taking new memory while theirs
    stays cached.  It is renewed (a fresh pool; the old one's memory goes back at ``empty_cache()`` once its graphs
    are gone) when memory is to be released (``clear()``, ``sleep()``), or, on a backend that does not keep pools
    (whose pool takes no capture once its graphs all died), when none is alive; in both cases only while no graph of
    any registry sharing it is alive.  Registries sharing a pool capture on one backend object (its capture
    streams: the caching allocator reuses a pool's free blocks only on the stream they came from), and an output of
    any of them is valid until the next replay of any of them (their graphs' memory overlaps).  ``lock`` is held for each capture into it, whichever registry and
    thread captures."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.device = backend.device()
        self.lock = threading.Lock()
        self.handle: Any = None
        self._keeper: Any = None  # what keeps the handle's pool usable with no graph in it (None: nothing does)
        self._fresh()
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()  # entries alive whose graphs are in this handle
        self._used = False  # a graph was captured into this handle
        self._holder = threading.local()  # .name: the registry whose capture holds the lock on this thread
        self._sharers: weakref.WeakSet[Any] = weakref.WeakSet()  # each registry's capture job (its holds_graphs())

    @property
    def live_graphs(self) -> int:
        """Graphs alive in the pool, of every registry sharing it."""
        return len(self._graphs)

    def for_capture(self) -> Any:
        """The handle the next capture goes into: a fresh one if every graph captured into the current one died and
        nothing keeps its pool usable."""
        if self._used and not self._graphs and self._keeper is None:
            self.renew()
        return self.handle

    def renew(self) -> None:
        self._fresh()
        self._graphs = weakref.WeakSet()
        self._used = False

    def _fresh(self) -> None:
        kept = getattr(self.backend, "new_kept_pool", None)
        self.handle, self._keeper = kept() if kept is not None else (self.backend.new_pool(), None)

    def share(self, sharer: Any) -> None:
        """``sharer`` (a registry's capture job, which says whether it ``holds_graphs()``) captures into this pool."""
        self._sharers.add(sharer)

    def renew_if_unused(self, release: bool = False) -> bool:
        """A fresh handle (the old pool's memory goes back once its graphs are collected) when no registry sharing the
        pool holds or is capturing a graph, and no capture holds the lock; a pool kept usable only to ``release`` its
        memory (else the next captures reuse it)."""
        if self._keeper is not None and not release:
            return False
        if any(sharer.holds_graphs() for sharer in list(self._sharers)) or not self.lock.acquire(blocking=False):
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
        one if every graph captured into the current one died); refused on a thread whose capture holds it already."""
        if self.holder() is not None:
            self.refuse_if_held(f"a capture of {key} [{strategy}]", registry)
        self.lock.acquire()
        try:
            self.for_capture()
        except BaseException:
            self.lock.release()
            raise
        self._holder.name = registry

    def end(self, entry: Any = None) -> None:
        """The capture begun on this thread is over; ``entry``, if given, was captured into ``handle``."""
        if entry is not None:
            self.add(entry)
        self._holder.name = None
        self.lock.release()

    def recover(self) -> None:
        """After a failed capture into the pool: what the backend says the pool can still be used as (a fresh pool,
        kept like the old one, where the backend says the old one takes no more captures)."""
        handle = self.backend.recover_pool(self.handle)
        if handle is not self.handle:
            if self._keeper is not None:
                self._fresh()
            else:
                self.handle = handle

    def add(self, entry: Any) -> None:
        """``entry``'s graph was captured into the current handle."""
        self._graphs.add(entry)
        self._used = True

    def holder(self) -> str | None:
        """The registry whose capture holds the lock on this thread, if any (a capture asked for from inside it would
        wait for itself)."""
        return getattr(self._holder, "name", None)

    def hold(self, name: str | None) -> None:
        self._holder.name = name

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
