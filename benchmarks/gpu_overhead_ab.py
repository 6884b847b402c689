"""Host cost of ``reg.run()`` for several checkouts in one process, their samples interleaved.

Separate processes on a shared host differ by more than the change being measured (a bare
``graph.replay()`` took 2.5 us in one process and 4.1 us in the next on the same H200), so
each checkout's package is imported in turn into this one process (``sys.modules`` purged
between), its registries built, and then every case is sampled once per round (200 calls,
the GPU drained after each), the order rotated round by round.  Cases, on a one-kernel
graph: a bare replay (torch's ``CUDAGraph.replay``, what an engine calls), the same replay through the C++ method
(what the cuda backend binds, ``direct_replay``), a replay plus ``detach()`` (the fresh output view ``run()`` hands out),
the hand-written copy + replay + slice, and for each checkout ``run()`` with no inputs (on one
descriptor object, and on a descriptor built each step with ``BatchDescriptor.decode`` as an
engine's loop builds one), with one input, and with no inputs on a registry whose capture ran
in the background (where the checkout has background capture).  Public API only:

    python3 benchmarks/gpu_overhead_ab.py OLD_CHECKOUT .       # each argument holds a cgregistry/ package
    taskset -c 5 python3 benchmarks/gpu_overhead_ab.py OLD .   # one core: steadier still
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from types import ModuleType

import torch

try:
    from benchmarks.timing import copy_replay_slice, doubling_graph
except ImportError:  # run as a script from benchmarks/
    from timing import copy_replay_slice, doubling_graph  # type: ignore[no-redef]

CALLS = 200  # calls per sample: few enough not to fill the launch queue
N = 8  # the batch's rows


def load(tree: str) -> ModuleType:
    """The cgregistry package under ``tree``, imported afresh (objects built from an earlier one keep working)."""
    for name in [m for m in sys.modules if m == "cgregistry" or m.startswith("cgregistry.")]:
        del sys.modules[name]
    root = os.path.abspath(tree)
    sys.path.insert(0, root)
    try:
        cg = importlib.import_module("cgregistry")
    finally:
        sys.path.remove(root)
    if not cg.__file__.startswith(root):
        raise SystemExit(f"{tree!r} holds no cgregistry package (imported {cg.__file__})")
    return cg


def checkout_cases(tree: str, held: torch.Tensor, live: torch.Tensor) -> dict[str, Callable[[], object]]:
    """``run()`` of ``tree``'s registries: no inputs, one input, no inputs after a background capture."""
    cg = load(tree)
    batch = cg.BatchDescriptor.decode(N)
    plain = cg.GraphRegistry(lambda b: held * 2, {}, backend="cuda")
    plain.capture([(batch, "full")], progress=False)
    one = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((64, 256), torch.float32)}, backend="cuda")
    one.capture([(batch, "full")], progress=False)
    background = cg.GraphRegistry(lambda b: held * 2, {}, backend="cuda")
    try:
        background.capture([(batch, "full")], progress=False, background=True)
        background.wait_captured()
    except TypeError:  # a checkout without background capture
        background = None
    with torch.inference_mode():
        if not (torch.equal(plain.run(batch), held * 2) and torch.equal(one.run(batch, x=live), live * 2)):
            raise SystemExit(f"{tree}: run() gave a wrong result")
        if background is not None and not torch.equal(background.run(batch), held * 2):
            raise SystemExit(f"{tree}: run() after a background capture gave a wrong result")
    decode = cg.BatchDescriptor.decode
    cases: dict[str, Callable[[], object]] = {
        f"{tree}: no inputs": lambda: plain.run(batch),
        f"{tree}: no inputs, descriptor built each step": lambda: plain.run(decode(N)),  # what an engine's loop does
        f"{tree}: one input": lambda: one.run(batch, x=live),
    }
    if background is not None:
        cases[f"{tree}: no inputs, after background"] = lambda: background.run(batch)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="directories that each hold a cgregistry package")
    parser.add_argument("--rounds", type=int, default=600)
    args = parser.parse_args()
    live = torch.randn(N, 256, device="cuda")
    held = torch.randn(N, 256, device="cuda")
    graph, static, out = doubling_graph(N)

    hand = copy_replay_slice(graph, static, out, live)

    def replay_and_detach() -> torch.Tensor:
        graph.replay()
        return out.detach()

    cpp_replay = types.MethodType(torch._C._CUDAGraph.replay, graph)  # torch's Python wrapper skipped, as cuda.py does
    cases: dict[str, Callable[[], object]] = {
        "bare replay": graph.replay, "bare C++ replay": cpp_replay, "replay + detach": replay_and_detach,
        "hand copy+replay+slice": hand,
    }
    for tree in args.trees:
        cases.update(checkout_cases(tree, held, live))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    items = list(cases.items())
    with torch.inference_mode():
        for _, fn in items:
            for _ in range(CALLS):
                fn()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            k = r % len(items)
            for name, fn in items[k:] + items[:k]:
                start = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
                torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds of {CALLS} calls, cases interleaved, order rotated")
    print(f"{'host us per call':44} {'median':>7} {'p10':>7} {'min':>7} {'over (med)':>10} {'over (min)':>10}")
    for name, values in samples.items():
        ref = samples["hand copy+replay+slice" if name.endswith("one input") else "bare replay"]
        values = sorted(values)
        med = statistics.median(values)
        print(f"{name:44} {med:7.3f} {values[len(values) // 10]:7.3f} {values[0]:7.3f} "
              f"{med - statistics.median(ref):+10.3f} {values[0] - min(ref):+10.3f}")
    print("over: against a bare replay; a 'one input' row against the hand-written copy + replay + slice")


if __name__ == "__main__":
    main()
