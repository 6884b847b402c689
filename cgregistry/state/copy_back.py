"""Turning a replaced parameter back into an in-place update: its new values copied into the memory the graphs read,
and the parameter pointed at that memory, so every graph stays valid and nothing is captured again.

Only where that is the same computation and changes nothing else: the new tensor has the old one's shape, strides,
dtype, device, storage offset and plain tensor type; the parameters moved share memory with one another (tied
embeddings, views of one fused weight) exactly as the old ones did, and none takes memory another still reads; and no
tensor outside the registry (a ``state_dict()`` snapshot, a drafter sharing the parameter, a view, a storage object, a
cpu tensor shared with another process) still uses the old memory, counted by its storage's references and, for a
live old parameter object, Python's.  Anything else is left where it is, with the reason, and the graphs reading it
are captured again as before.  CUDA memory handed to another process through IPC cannot be seen from here.
"""

from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

__all__ = ["GraphHeld", "Move", "copy_back", "tensors_in"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WALK_LIMIT = 1_000_000  # objects looked at in a graph's own structures (a recorded cpu graph: its ops' arguments)


@attrs.frozen(slots=True)
class Move:
    """A watched parameter found elsewhere than its graphs read it: ``old`` aliases the memory they read (kept alive
    by their entries), ``new`` is the tensor the module holds now, ``was`` the parameter object the graphs were captured
    with where it is still alive."""

    name: str
    old: torch.Tensor
    new: torch.Tensor
    owner: object = None  # the module holding it (its other watchers are told once it is pointed elsewhere)
    was: torch.Tensor | None = None


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _refusal(move: Move) -> str | None:
    """Why ``move.new`` cannot take ``move.old``'s memory, judged on the two tensors alone, or None."""
    old, new = move.old, move.new
    if type(new) not in _PLAIN:
        return f"{move.name} is now a {type(new).__name__}, not a plain tensor"
    for what, was, now in (("shape", tuple(old.shape), tuple(new.shape)), ("dtype", old.dtype, new.dtype),
                           ("device", old.device, new.device)):
        if was != now:
            return f"{move.name} changed {what} from {was} to {now}"
    if old.layout is not torch.strided or new.layout is not torch.strided:
        return f"{move.name} is not a strided tensor"
    if old.stride() != new.stride() or old.storage_offset() != new.storage_offset():
        return (f"{move.name} changed its layout: strides {list(old.stride())} offset {old.storage_offset()} to "
                f"{list(new.stride())} offset {new.storage_offset()}")
    if any(stride == 0 and size > 1 for stride, size in zip(old.stride(), old.shape)):
        return f"{move.name} has elements that share memory (a stride of 0): it cannot be written element by element"
    if old.device.type == "cpu" and old.untyped_storage().is_shared():
        return f"{move.name}: the memory the graphs read is shared with other processes, which would see it change"
    if move.was is not None and move.was is not move.new and _storage(move.was) != _storage(old):
        return f"{move.name}: the parameter the graphs were captured with was itself given other memory since"
    return None


def _sharing_refusals(moves: list[Move], refused: Mapping[str, str], others: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The moves whose memory is shared differently from the old memory's sharing, or whose copy would write memory a
    tensor left where it is still reads (an unmoved one in ``others``, or a refused move's new tensor), or whose new
    values sit in memory another move writes (a swap, a chain): refused until none is left, since each refusal leaves
    one more tensor where it is."""
    old_storages = {_storage(m.old) for m in moves}
    refused = dict(refused)
    found: dict[str, str] = {}
    while True:
        movable = [m for m in moves if m.name not in refused]
        staying = {**others, **{m.name: m.new for m in moves if m.name in refused}}
        pairs = [(m.name, _storage(m.old), _storage(m.new)) for m in movable]
        touched = {s for _, o, n in pairs for s in (o, n)}
        pairs += [(name, _storage(t), _storage(t)) for name, t in staying.items() if _storage(t) in touched]
        forward: dict[int, set[int]] = {}
        backward: dict[int, set[int]] = {}
        for _, o, n in pairs:
            forward.setdefault(o, set()).add(n)
            backward.setdefault(n, set()).add(o)
        new = {}
        for m, (_, o, n) in zip(movable, pairs):
            if n in old_storages:
                new[m.name] = f"{m.name} now uses memory the graphs read for another parameter"
            elif len(forward[o]) > 1 or len(backward[n]) > 1:
                sharing = sorted(name for name, o2, n2 in pairs if (o2 == o or n2 == n) and name != m.name)
                new[m.name] = f"{m.name} shares memory with {', '.join(sharing)} differently than before"
        if not new:
            return found
        refused.update(new)
        found.update(new)


@attrs.frozen(slots=True)
class GraphHeld:
    """The tensors the registry's graph objects refer to, and how many references to each they make."""

    tensors: list[torch.Tensor]
    references: dict[int, int]  # id(tensor) -> references from the graph objects' containers and slots
    complete: bool = True  # False: the walk stopped at its limit, and what it counted is not all the graphs hold


def tensors_in(graphs: Iterable[Any]) -> GraphHeld:
    """The tensors the registry's graph objects refer to (the cpu emulator's recorded ops hold the tensors they ran on;
    a CUDA graph holds addresses only): containers and the package's own objects are looked into, each once."""
    found: dict[int, torch.Tensor] = {}
    references: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(graphs)
    while stack and len(seen) < _WALK_LIMIT:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            children: Iterable[Any] = obj
        elif isinstance(obj, dict):
            children = itertools.chain(obj.keys(), obj.values())
        elif type(obj).__module__.startswith("cgregistry."):
            slots = [getattr(obj, name, None) for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
            children = [*slots, *getattr(obj, "__dict__", {}).values()]
        else:
            continue
        for child in children:
            if isinstance(child, torch.Tensor):
                found[id(child)] = child
                references[id(child)] = references.get(id(child), 0) + 1
                base = child._base  # a view the graph holds keeps its base alive (a weight read as w.t())
                while base is not None and id(base) not in found:
                    found[id(base)] = base
                    references[id(base)] = references.get(id(base), 0) + 1  # the view's own hold on it
                    base = base._base
            elif not isinstance(child, (str, bytes, int, float, type(None))):
                stack.append(child)
    return GraphHeld(list(found.values()), references, complete=not stack)


def _held_elsewhere(moves: list[Move], every: list[Move], graphs: GraphHeld) -> dict[str, str]:
    """The moves whose replaced parameter object is still alive and referred to by more than the registry's graph
    objects (another module's parameters, a variable, a list: a drafter sharing the target's embedding): the storage
    count cannot see it where the registry's own cpu graphs hold that same object."""
    refused = {}
    by_moves = collections.Counter(id(m.was) for m in every if m.was is not None)  # ``every``: all the moves (tied: one object)
    for m in moves:
        if m.was is None or m.was is m.new:
            continue
        # Python's references to it: getrefcount's own argument, the moves' slots, the graphs' (and their list's)
        by_graphs = graphs.references.get(id(m.was), 0)
        extra = sys.getrefcount(m.was) - 1 - by_moves[id(m.was)] - by_graphs - (1 if by_graphs else 0)
        if extra > 0:
            refused[m.name] = (f"{m.name}: the parameter object it replaced is still referred to elsewhere (another "
                               "module, a variable, a container), and copying into its memory would change it too")
    return refused


def _used_elsewhere(moves: list[Move], ours: Iterable[torch.Tensor]) -> dict[str, str]:
    """The moves whose old memory a tensor outside ``ours`` (the entries' aliases, the tensors their graph objects hold)
    still uses: its storage counts more references than those (and the one Python storage object counting them)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return {m.name: f"{m.name}: this torch cannot tell whether other tensors use the old memory" for m in moves}
    by_storage: dict[int, set[int]] = {}
    for t in ours:
        by_storage.setdefault(_storage(t), set()).add(id(t))
    probe = torch.empty(1)  # a storage object only this function refers to: the Python references that come with one
    probe_storage = probe.untyped_storage()
    plain = sys.getrefcount(probe_storage)
    refused = {}
    for m in moves:
        storage = m.old.untyped_storage()  # one Python object per storage: an engine's own reference to it counts here
        others = count(storage._cdata) - 1 - len(by_storage.get(storage.data_ptr(), ())) + sys.getrefcount(storage) - plain
        if others > 0:
            refused[m.name] = (f"{m.name}: {others} other reference{'s' if others > 1 else ''} to the memory the graphs "
                               "read (a state_dict snapshot, a view, another module or registry, a storage object) "
                               "would see it change")
    return refused


def _read_beside(moves: list[Move], beside: Iterable[torch.Tensor]) -> dict[str, str]:
    """The moves whose new memory another registry's graphs read (captured or refreshed there since the update):
    pointing the parameter away would leave those stale; this registry captures again instead, so both settle there."""
    theirs = {_storage(t) for t in beside}
    return {m.name: f"{m.name}: another registry's graphs read it where it is now; captured again here instead"
            for m in moves if _storage(m.new) in theirs}


def copy_back(moves: list[Move], others: Mapping[str, torch.Tensor], aliases: Iterable[torch.Tensor],
              graphs: GraphHeld, beside: Iterable[torch.Tensor] = ()) -> tuple[list[str], list[str]]:
    """Copy each movable ``new`` into its ``old`` memory and point it there (``new.data``: the module keeps the object it
    was given); the names done, and a reason for each left alone.  ``others``: the watched tensors that did not move;
    ``aliases`` and ``graphs``: what the registry itself holds (the entries' aliases, its graph objects' tensors);
    ``beside``: the aliases other registries' entries hold (their graphs read that memory as this one's do)."""
    beside = list(beside)
    if not graphs.complete:
        return [], [f"nothing copied back: the registry's graphs hold more than {_WALK_LIMIT:,} objects, too many to "
                    "count their references to the old memory"]
    refused = {m.name: why for m in moves if (why := _refusal(m)) is not None}
    refused.update(_read_beside([m for m in moves if m.name not in refused], beside))
    refused.update(_used_elsewhere([m for m in moves if m.name not in refused], [*aliases, *graphs.tensors, *beside]))
    refused.update(_held_elsewhere([m for m in moves if m.name not in refused], moves, graphs))
    refused.update(_sharing_refusals(moves, refused, others))
    movable = [m for m in moves if m.name not in refused]
    if not movable:
        return [], list(refused.values())
    _synchronize(movable)
    copied = []
    with torch.inference_mode():  # an inference tensor takes an in-place write only here; autograd records nothing
        for m in movable:
            try:
                m.old.copy_(m.new)
            except RuntimeError as exc:  # its old memory is read by nothing but the graphs, which are captured again
                refused[m.name] = f"{m.name} could not be copied into the memory the graphs read: {exc}"
            else:
                copied.append(m)
    failed = {_storage(m.old) for m in movable if m.name in refused}  # tied to a failed copy: left with it, still tied
    done = []
    for m in copied:
        if _storage(m.old) in failed:
            refused[m.name] = f"{m.name} shares its memory with a parameter that could not be copied back"
            continue
        try:
            m.new.data = m.old  # its values are in the old memory: each parameter done is a finished in-place update
        except RuntimeError as exc:  # left where it is: the graphs reading it are captured again
            refused[m.name] = f"{m.name} could not be pointed at the memory the graphs read: {exc}"
        else:
            done.append(m.name)
    _synchronize(movable)
    return done, list(refused.values())


def _synchronize(moves: list[Move]) -> None:
    """Wait for the calling thread's stream on the devices ``moves`` live on: the replays it queued read the old values
    to their end, and, the copies done, the next replay on any stream reads the new ones.  (The caller waited for the
    whole device before it stopped ``run()``; a device-wide wait here would wait for a capture thread standing aside.)"""
    for device in {m.old.device for m in moves if m.old.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
