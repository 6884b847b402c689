"""GPU benchmark of the `full` strategy, one process, printing a table of times and ratios.

1. Demo model (12 x 1024, bf16) at batch 1, 8, 64 (uniform decode): eager, a hand-written
   torch.cuda.CUDAGraph per size (copy in + replay, what engines write today), and
   reg.run() with the full strategy from a default 256-seq plan.
2. Registry overhead on a one-kernel graph: bare graph.replay(), hand-written copy +
   replay + slice, reg.run().
3. Pool memory of the whole plan against the largest single graph.

Run on a CUDA machine: PYTHONPATH=. python3 benchmarks/gpu_full.py [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch

try:
    from benchmarks.timing import per_call_us, static_graph
except ImportError:  # run as a script from benchmarks/
    from timing import per_call_us, static_graph  # type: ignore[no-redef]


def hand_written_graph(model: DemoDecoder, batch: B, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """What an engine writes by hand: static tensors for one size, capture, copy in + replay."""
    return static_graph(model, batch, inputs, torch.cuda.CUDAGraph(), torch.cuda.graph)


def bench_demo(rows: list[dict], iters: int) -> dict:
    cfg = DemoConfig.for_device("cuda")
    model = DemoDecoder(cfg, "cuda")
    reg = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    plan = cg.CapturePlan.build(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, mode="full")
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    reg.capture(plan, progress=False)
    capture_s = time.perf_counter() - t0
    plan_device_bytes = free_before - torch.cuda.mem_get_info()[0]
    gen = torch.Generator().manual_seed(0)
    for n in (1, 8, 64):
        batch = B.decode(n)
        inputs = random_batch(cfg, batch, "cuda", gen)
        with torch.inference_mode():
            want = model(batch, **inputs)
            got = reg.run(batch, **inputs).clone()
            hand = hand_written_graph(model, batch, inputs)
            hand_out = hand().clone()
            err = max((got.float() - want.float()).abs().max().item(), (hand_out.float() - want.float()).abs().max().item())
            eager_us = per_call_us(lambda: model(batch, **inputs), iters)
            hand_us = per_call_us(hand, iters)
            reg_us = per_call_us(lambda: reg.run(batch, **inputs), iters)
        del hand
        rows.append({"case": f"demo batch {n}", "eager_us": eager_us, "hand_graph_us": hand_us, "reg_run_us": reg_us, "reg_over_hand": reg_us / hand_us, "eager_over_reg": eager_us / reg_us, "max_abs_err": err})
    return {"graphs": len(reg), "capture_s": capture_s, "plan_pool_bytes": reg.memory_bytes(), "plan_device_bytes": plan_device_bytes, "model": model, "cfg": cfg, "plan": plan}


def bench_largest_only(model: DemoDecoder, cfg: DemoConfig, plan: cg.CapturePlan) -> dict:
    reg = cg.GraphRegistry(model, demo_inputs(cfg), backend="cuda")
    free_before = torch.cuda.mem_get_info()[0]
    reg.capture(cg.CapturePlan(plan.entries[:1]), progress=False)
    return {"largest_key": str(plan.entries[0].descriptor), "largest_pool_bytes": reg.memory_bytes(), "largest_device_bytes": free_before - torch.cuda.mem_get_info()[0]}


def bench_one_kernel(rows: list[dict], iters: int) -> None:
    n = 8

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((64, 256), torch.float32)}, backend="cuda")
    reg.capture([(B.decode(n), "full")], progress=False)
    live = torch.randn(n, 256, device="cuda")
    batch = B.decode(n)

    static = torch.zeros(n, 256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(batch, static)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = step(batch, static)

    def hand() -> torch.Tensor:
        static[:n].copy_(live)
        graph.replay()
        return out[:n]

    with torch.inference_mode():
        assert torch.equal(reg.run(batch, x=live), hand())

    # No inputs at all: reg.run() against graph.replay() is the registry's own cost.
    held = torch.randn(n, 256, device="cuda")
    bare_reg = cg.GraphRegistry(lambda b: held * 2, {}, backend="cuda")
    bare_reg.capture([(batch, "full")], progress=False)
    assert torch.equal(bare_reg.run(batch), held * 2)
    no_input_us = per_call_us(lambda: bare_reg.run(batch), iters)
    bare = per_call_us(graph.replay, iters)
    hand_us = per_call_us(hand, iters)
    reg_us = per_call_us(lambda: reg.run(batch, x=live), iters)
    copy_us = per_call_us(lambda: static[:n].copy_(live), iters)
    rows.append({"case": "one kernel", "bare_replay_us": bare, "reg_run_no_inputs_us": no_input_us, "reg_no_inputs_minus_replay_us": no_input_us - bare, "copy_us": copy_us, "hand_graph_us": hand_us, "reg_run_us": reg_us, "reg_minus_hand_us": reg_us - hand_us, "reg_minus_copy_and_replay_us": reg_us - bare - copy_us})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    rows: list[dict] = []
    bench_one_kernel(rows, args.iters * 20)
    demo = bench_demo(rows, args.iters)
    model, cfg, plan = demo.pop("model"), demo.pop("cfg"), demo.pop("plan")
    gc.collect()
    largest = bench_largest_only(model, cfg, plan)
    mem = {**demo, **largest, "pool_ratio": demo["plan_pool_bytes"] / max(largest["largest_pool_bytes"], 1)}

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':16} {'eager us':>10} {'hand graph us':>14} {'reg.run us':>11} {'reg/hand':>9} {'eager/reg':>10} {'max err':>9}")
    for r in rows:
        if r["case"].startswith("demo"):
            print(f"{r['case']:16} {r['eager_us']:10.1f} {r['hand_graph_us']:14.1f} {r['reg_run_us']:11.1f} {r['reg_over_hand']:9.3f} {r['eager_over_reg']:10.2f} {r['max_abs_err']:9.2g}")
    k = next(r for r in rows if r["case"] == "one kernel")
    print(f"one-kernel graph: bare replay {k['bare_replay_us']:.2f} us, copy {k['copy_us']:.2f} us, hand copy+replay+slice {k['hand_graph_us']:.2f} us, reg.run {k['reg_run_us']:.2f} us")
    print(f"registry overhead: {k['reg_minus_hand_us']:+.2f} us vs hand-written, {k['reg_minus_copy_and_replay_us']:+.2f} us vs bare copy + replay")
    print(f"no inputs: reg.run {k['reg_run_no_inputs_us']:.2f} us vs bare replay {k['bare_replay_us']:.2f} us: overhead {k['reg_no_inputs_minus_replay_us']:+.2f} us")
    print(f"plan: {mem['graphs']} graphs captured in {mem['capture_s']:.1f} s; pool {mem['plan_pool_bytes'] / 2**20:.1f} MiB (device {mem['plan_device_bytes'] / 2**20:.1f} MiB)")
    print(f"largest graph alone {mem['largest_key']}: pool {mem['largest_pool_bytes'] / 2**20:.1f} MiB (device {mem['largest_device_bytes'] / 2**20:.1f} MiB); whole plan / largest = {mem['pool_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "memory": mem}, fh, indent=2)


if __name__ == "__main__":
    main()
