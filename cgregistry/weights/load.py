"""Loading weights in place: a state dict or streamed ``(name, tensor)`` pairs copied into a module's parameters and
buffers.  A copy keeps the addresses graphs read, so none is captured again (a load by assignment moves them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = ["load_in_place"]


def load_in_place(module: nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """Copy ``weights`` into ``module``'s parameters and buffers by name, on the current stream; the names loaded.
    Checked before anything is written: ``ValueError`` names each unknown or repeated name, differing shape, dtype or
    device (a cpu source is fine), target it may not write (file-mapped memory, an inference tensor outside
    ``inference_mode``), and two values for one tied tensor."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_in_place() loads into an nn.Module, got {module!r}")
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    targets: dict[str, torch.Tensor] = {}
    for table in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        targets.update((name, tensor) for name, tensor in table if tensor is not None)
    mapped = _file_mappings() if any(t.device.type == "cpu" for t in targets.values()) else []
    problems: list[str] = []
    seen: dict[str, torch.Tensor] = {}
    chosen: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}  # target tensor -> (name, target, source)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"load_in_place() takes a state dict or (name, tensor) pairs, got an item {item!r}")
        name, source = item
        target = targets.get(name)
        why = ("given twice" if name in seen else "no such parameter or buffer" if target is None
               else _mismatch(source, target) or _unwritable(target, mapped))
        seen.setdefault(name, source)
        tied = chosen.setdefault(id(target), (name, target, source)) if not why else None
        if tied is not None and tied[2] is not source and not torch.equal(tied[2], source.to(tied[2].device)):
            why = f"tied to {tied[0]} (one tensor), but given another value"
        if why:
            problems.append(f"{name}: {why}")
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


def _unwritable(target: torch.Tensor, mapped: list[tuple[int, int, str, str]]) -> str | None:
    """Why the loader will not write into ``target``: an inference tensor outside ``inference_mode`` (torch refuses
    it), or memory mapped from a file (``np.memmap``, ``torch.load(mmap=True)``, shared memory): writing would change
    the file, and what other processes read, or fault on a read-only mapping."""
    if target.is_inference() and not torch.is_inference_mode_enabled():
        return "an inference tensor (made under inference_mode): load under torch.inference_mode()"
    start = target.data_ptr()
    for low, high, perms, path in mapped if target.device.type == "cpu" and target.numel() else ():
        if low <= start < high and (perms[3] == "s" or "w" not in perms):
            return (f"its memory is mapped from {path} ({'read-only' if 'w' not in perms else 'shared'}): writing there "
                    "would change that file or fault; give the module memory of its own first (a copy of its state)")
    return None


def _file_mappings() -> list[tuple[int, int, str, str]]:
    """The process's file-backed memory mappings (start, end, permissions, file), from ``/proc/self/maps`` where the
    system has it (Linux); elsewhere none are known."""
    try:
        with open("/proc/self/maps") as maps:
            rows = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    return [(int(row[0].partition("-")[0], 16), int(row[0].partition("-")[2], 16), row[1], row[5].strip()) for row in rows
            if len(row) == 6 and row[4] != "0" and not row[5].startswith("[")]
