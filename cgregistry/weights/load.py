"""Loading weights in place: a state dict, or ``(name, tensor)`` pairs as a trainer streams them, copied into the
parameters and buffers a module holds now.  Graphs read the addresses they were captured with; a copy keeps them, so
every graph computes with the new values and none is captured again (a load by assignment moves them: ``refresh()``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = ["load_in_place"]


def load_in_place(module: nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """Copy ``weights`` into ``module``'s parameters and buffers by name (tied names included: one copy, of the value
    given first); the names loaded.  Every pair is checked before anything is written: ``ValueError`` names each name
    it does not hold or gets twice, each shape, dtype or device that differs (a cpu source is copied over), each target
    in memory torch did not allocate.  Works under ``inference_mode`` and ``no_grad``; the copies go on the current
    stream, after the replays queued on it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_in_place() loads into an nn.Module, got {module!r}")
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    targets: dict[str, torch.Tensor] = {}
    for table in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        targets.update((name, tensor) for name, tensor in table if tensor is not None)
    problems: list[str] = []
    seen: dict[str, torch.Tensor] = {}
    chosen: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # target tensor -> (name, target, source)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"load_in_place() takes a state dict or (name, tensor) pairs, got an item {item!r}")
        name, source = item
        if name in seen:
            problems.append(f"{name}: given twice")
            continue
        seen[name] = source
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: no such parameter or buffer")
            continue
        why = _mismatch(source, target) or _foreign(target)
        if why:
            problems.append(f"{name}: {why}")
            continue
        chosen.setdefault(id(target), (name, target, source))  # a tied tensor's later names: copied once, the first
    if problems:
        known = ", ".join(list(targets)[:6]) + (", ..." if len(targets) > 6 else "")
        raise ValueError(f"load_in_place() into {type(module).__name__} refused, nothing written: {'; '.join(problems)} "
                         f"(it holds {len(targets)} parameters and buffers: {known})")
    with torch.no_grad():
        for _, target, source in chosen.values():
            target.copy_(source)
    return tuple(seen)


def _mismatch(source: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why ``source`` cannot be copied into ``target`` as it is (None: it can)."""
    if source.shape != target.shape:
        return f"shape {list(source.shape)}, expected {list(target.shape)}"
    if source.dtype != target.dtype:
        return f"dtype {source.dtype}, expected {target.dtype}"
    if source.device != target.device and source.device.type != "cpu":
        return f"device {source.device}, expected {target.device} (or the cpu)"
    if source.is_sparse or source.layout != torch.strided:
        return f"layout {source.layout}, expected a dense tensor"
    return None


def _foreign(target: torch.Tensor) -> str | None:
    """Why the loader will not write into ``target``'s memory: memory torch did not allocate for it (a numpy or
    memory-mapped array loaded zero-copy: writing would change the file on disk, or fault on a read-only mapping)."""
    if not target.untyped_storage().resizable():
        return ("its memory is not torch's own (a numpy or memory-mapped array loaded without a copy, say): writing "
                "there would change that array or fault; give the module memory of its own first (module.to(...), a "
                "copy of its state)")
    return None

