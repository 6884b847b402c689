"""GPU benchmark of the `breakable` strategy against `full`, eager, and breakable-cuda-graphs 0.1.0.

One process; the demo model (12 x 1024, bf16) with one eager break per layer: the
attention kernel (scaled_dot_product_attention over the gathered cache), in its
out-argument form so both libraries run the same function; gathering and masking
stay in the graph segments. At batch 1, 8 and 64 (uniform decode):
  eager       the model run eagerly (breaks are plain calls)
  full        reg.run() with a full graph (the breaks run inline and are captured)
  breakable   reg.run() with cgregistry's breakable strategy (13 segments, 12 eager breaks)
  peer        breakable_cuda_graphs.BreakableCUDAGraph over the same model object (same
              weights and caches in memory) and breaks, with static buffers, copy in +
              replay, as its README shows

Run: PYTHONPATH=. python3 benchmarks/gpu_breakable.py   (needs `pip install 'cgregistry[bench]'`)
"""

from __future__ import annotations

import argparse
import json

import torch
from breakable_cuda_graphs import BreakableCUDAGraph, breakable_graph, no_graph

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import (
    DemoConfig,
    DemoDecoder,
    attention_kernel_into,
    demo_inputs,
    random_batch,
)

try:
    from benchmarks.timing import per_call_us, static_graph
except ImportError:  # run as a script from benchmarks/
    from timing import per_call_us, static_graph  # type: ignore[no-redef]

SIZES = (1, 8, 64)
PEER_BREAK = no_graph(attention_kernel_into)


def peer_graph(model: DemoDecoder, batch: B, inputs: dict[str, torch.Tensor]):  # noqa: ANN201
    """breakable-cuda-graphs used as its README shows: static buffers, side-stream warm-up, capture, replay.

    The same model object (same weights and caches in memory) as cgregistry's entries: only the
    break marker differs, and it matters at capture alone.
    """
    ours = [layer.core for layer in model.layers]
    for layer in model.layers:
        layer.core = PEER_BREAK
    try:
        return static_graph(model, batch, inputs, BreakableCUDAGraph(), breakable_graph)
    finally:
        for layer, core in zip(model.layers, ours):
            layer.core = core


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = DemoConfig.for_device("cuda")
    ours = DemoDecoder(cfg, "cuda", seed=0, attention=cg.eager_break(attention_kernel_into))
    inputs_spec = demo_inputs(cfg)
    full = cg.GraphRegistry(ours, inputs_spec, backend="cuda")
    full.capture([(B.decode(n), "full") for n in sorted(SIZES, reverse=True)], progress=False)
    breakable = cg.GraphRegistry(ours, inputs_spec, backend="cuda")
    breakable.capture([(B(n), "breakable") for n in sorted(SIZES, reverse=True)], progress=False)
    segments = {(e.segments, e.breaks) for e in breakable.entries()}
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        batch = B.decode(n)
        inputs = random_batch(cfg, batch, "cuda", gen)
        with torch.inference_mode():
            want = ours(batch, **inputs).float()
            peer = peer_graph(ours, batch, inputs)
            errors = {
                "full": (full.run(batch, **inputs).float() - want).abs().max().item(),
                "breakable": (breakable.run(batch, **inputs).float() - want).abs().max().item(),
                "peer": (peer().float() - want).abs().max().item(),
            }
            assert breakable.match(batch).strategy == "breakable" and full.match(batch).strategy == "full"
            t = {
                "eager": per_call_us(lambda: ours(batch, **inputs), args.iters),
                "full": per_call_us(lambda: full.run(batch, **inputs), args.iters),
                "breakable": per_call_us(lambda: breakable.run(batch, **inputs), args.iters),
                "peer": per_call_us(peer, args.iters),
            }
        rows.append({"batch": n, **{f"{k}_us": v for k, v in t.items()}, "breakable_over_full": t["breakable"] / t["full"],
                     "peer_over_breakable": t["peer"] / t["breakable"], "max_abs_err": max(errors.values())})
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; breakable entries: (segments, breaks) = {sorted(segments)}")
    print(f"{'batch':>5} {'eager us':>10} {'full us':>9} {'breakable us':>13} {'peer us':>9} {'brk/full':>9} {'peer/brk':>9} {'max err':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_us']:10.1f} {r['full_us']:9.1f} {r['breakable_us']:13.1f} {r['peer_us']:9.1f} "
              f"{r['breakable_over_full']:9.3f} {r['peer_over_breakable']:9.3f} {r['max_abs_err']:8.2g}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
