"""Turning a replaced parameter back into an in-place update: its new values copied into the memory the graphs read,
and the parameter pointed at that memory, so every graph stays valid and nothing is captured again.

Only where that is the same computation: the new tensor has the old one's shape, strides, dtype, device, storage
offset and plain tensor type, and the parameters moved share memory with one another (tied embeddings, views of one
fused weight) exactly as the old ones did.  Anything else is left where it is, with the reason, and the graphs reading
it are captured again as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

__all__ = ["Move", "copy_back"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@attrs.frozen(slots=True)
class Move:
    """A watched parameter found elsewhere than its graphs read it: ``old`` aliases the memory they read (kept alive
    by their entries), ``new`` is the tensor the module holds now."""

    name: str
    old: torch.Tensor
    new: torch.Tensor
    owner: object = None  # the module holding it (its other watchers are told once it is pointed elsewhere)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _refusal(move: Move) -> str | None:
    """Why ``move.new`` cannot take ``move.old``'s memory, or None."""
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
    if _storage(old) == _storage(new):
        return f"{move.name} moved within the memory the graphs read"
    return None


def _alias_refusals(moves: list[Move], others: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The moves whose memory is shared differently from the old memory's sharing: each old storage must map to one new
    storage and back, and a storage an unmoved tensor (``others``) uses must stay with it."""
    pairs = [(m.name, _storage(m.old), _storage(m.new)) for m in moves]
    touched = {s for _, o, n in pairs for s in (o, n)}
    pairs += [(name, _storage(t), _storage(t)) for name, t in others.items() if _storage(t) in touched]
    forward: dict[int, set[int]] = {}
    backward: dict[int, set[int]] = {}
    for _, o, n in pairs:
        forward.setdefault(o, set()).add(n)
        backward.setdefault(n, set()).add(o)
    refused = {}
    for m, (_, o, n) in zip(moves, pairs):
        if len(forward[o]) > 1 or len(backward[n]) > 1:
            sharing = sorted(name for name, o2, n2 in pairs if o2 == o or n2 == n)
            refused[m.name] = f"{m.name} shares memory with {', '.join(x for x in sharing if x != m.name)} differently than before"
    return refused


def _synchronize(moves: list[Move]) -> None:
    """Wait for every stream of the devices ``moves`` live on: a replay in flight on any stream reads the old values to
    its end, and the next one, on any stream, reads the new ones."""
    for device in {m.old.device for m in moves if m.old.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def copy_back(moves: list[Move], others: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy each movable ``new`` into its ``old`` memory and point it there (``new.data``: the module keeps the object it
    was given); the names done, and a reason for each left alone."""
    refused = {m.name: why for m in moves if (why := _refusal(m)) is not None}
    refused.update(_alias_refusals([m for m in moves if m.name not in refused], others))
    movable = [m for m in moves if m.name not in refused]
    if not movable:
        return [], list(refused.values())
    _synchronize(movable)
    with torch.inference_mode():  # an inference tensor takes an in-place write only here; autograd records nothing
        for m in movable:
            m.old.copy_(m.new)
    done = []
    for m in movable:
        try:
            m.new.data = m.old  # its values are in the old memory: each parameter done is a finished in-place update
        except RuntimeError as exc:  # left where it is: the graphs reading it are captured again
            refused[m.name] = f"{m.name} could not be pointed at the memory the graphs read: {exc}"
        else:
            done.append(m.name)
    _synchronize(movable)
    return done, list(refused.values())
