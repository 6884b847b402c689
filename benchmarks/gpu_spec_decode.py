"""Speculative decoding with graphs on the GPU (examples/hf_spec_decode.py): a Llama-3.2-1B-shaped target and a
2-layer drafter (its first layers, perturbed), bf16, one process, requests shaped by the bundled trace.

Reports, side by side: decode tokens/s of plain decoding with graphs, of the speculative loop with the drafter's k
passes in one replay (``unrolled``), with one replay per pass (``chained``), and of the same loop eagerly; the
acceptance rate and the share of rounds served by graphs; one k-pass drafter replay against k one-pass replays; the
drafter's capture time against the target's; the device memory both plans take in one shared pool against each
alone and against a pool each (growth of used memory over the capture, from a clean device).  Prefill runs eagerly
in every loop and is not timed.  Tokens are compared with plain decoding's (bf16: a verify batch of another shape
may round a near-tie the other way; the CPU tests check losslessness exactly in float32).

    PYTHONPATH=. python3 benchmarks/gpu_spec_decode.py
    PYTHONPATH=. python3 benchmarks/gpu_spec_decode.py --requests 64 --max-new 64 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import cgregistry as cg
from cgregistry.plan.workload import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_spec_decode as sd  # noqa: E402

try:
    from benchmarks.timing import clean_device, used_device_bytes
except ImportError:  # run as a script from benchmarks/
    from timing import clean_device, used_device_bytes  # type: ignore[no-redef]


def memory_rows(target, drafter, shape, schedule) -> list[str]:  # type: ignore[no-untyped-def]
    """Capture growth for each configuration, from a clean device."""
    plan = cg.CapturePlan.build(max_num_seqs=shape.max_num_seqs, max_num_tokens=shape.max_num_tokens, mode="full_decode_only",
                                spec_depths=sd.plan_depths(schedule, skip=(2,)))
    rows, sizes = [], {}
    configurations = (("warm-up (not reported)", "both", False), ("target (verify) alone", "verify", False),
                      ("drafter alone", "draft", False), ("both, a pool each", "both", False), ("both, one shared pool", "both", True))
    for label, which, shared in configurations:
        clean_device()
        before = used_device_bytes()
        regs: list[cg.GraphRegistry] = []
        with torch.inference_mode():
            if which in ("verify", "both"):
                regs.append(cg.GraphRegistry(sd.make_verify_step(target), sd.verify_inputs(shape), backend="cuda", name="verify"))
            if which in ("draft", "both"):
                pool = regs[0].pool if shared else None
                regs.append(cg.GraphRegistry(sd.make_draft_step(drafter), sd.draft_inputs(shape), backend="cuda",
                                             output_axis="reqs", name="draft", pool=pool))
            for reg in regs:
                reg.capture(plan)
        sizes[label] = used_device_bytes() - before
        if label.startswith("warm-up"):  # kernels loaded, cuBLAS handles, the allocator's first blocks
            del regs
            continue
        rows.append(f"  {label:<24} {sizes[label] / 2**20:9.1f} MiB   ({sum(len(r) for r in regs)} graphs)")
        del regs
    larger = max(sizes["target (verify) alone"], sizes["drafter alone"])
    rows.append(f"  shared / larger alone   {sizes['both, one shared pool'] / larger:9.2f}x   "
                f"(a pool each: {sizes['both, a pool each'] / larger:.2f}x)")
    return rows


def draft_replay_rows(draft: cg.GraphRegistry, shape, k: int = 3, iters: int = 200) -> list[str]:  # type: ignore[no-untyped-def]
    """One k-pass replay against a 2-token pass and k - 1 one-token passes, inputs prebuilt (the chained form's
    feeding of each draft into the next pass stays on the device)."""
    rows = []
    width, block = shape.max_blocks_per_req, shape.block_size
    for n in (1, 8, shape.max_num_seqs):
        table = torch.stack([1 + i * width + torch.arange(width) for i in range(n)]).cuda()
        base = torch.full((n,), 16, dtype=torch.long)

        def inputs(first: int, count: int) -> dict[str, torch.Tensor]:
            pos = (base[:, None] + first + torch.arange(count)).reshape(-1)
            req = torch.arange(n).repeat_interleave(count)
            slots = table.cpu()[req, pos // block] * block + pos % block
            return dict(last_tokens=torch.randint(0, 1000, (n, 2)).cuda(), positions=pos.cuda(), slot_mapping=slots.cuda(),
                        block_table=table)

        unrolled = (cg.BatchDescriptor.decode(n, k), inputs(0, k + 1))
        chained = [(cg.BatchDescriptor.decode(n, 1), inputs(0, 2))] + [(cg.BatchDescriptor.decode(n), inputs(j, 1)) for j in range(2, k + 1)]
        times: dict[str, list[float]] = {"unrolled": [], "chained": []}
        with torch.inference_mode():
            for _ in range(20):  # warm
                draft.run(unrolled[0], **unrolled[1])
                for batch, x in chained:
                    draft.run(batch, **x)
            for _ in range(5):
                for label, calls in (("unrolled", [unrolled]), ("chained", chained)):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(iters):
                        for batch, x in calls:
                            draft.run(batch, **x)
                    torch.cuda.synchronize()
                    times[label].append((time.perf_counter() - started) / iters * 1e6)
        u, c = statistics.median(times["unrolled"]), statistics.median(times["chained"])
        rows.append(f"  {n:3} requests, k={k}: one {k}-pass replay {u:8.1f} us, {k} replays {c:8.1f} us ({c / u:.2f}x)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama-3.2-1b")
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.0, help="the drafter's layer weights perturbed by this many stds")
    parser.add_argument("--damp", type=float, default=0.05, help="the target's layers after the drafter's scaled by this")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda")
    r = args.max_num_seqs
    schedule = SchedulerConfig(max_num_seqs=r, spec_schedule=sd.depth_schedule(r))
    shape = sd.engine_shape(r, 3, args.max_prompt + args.max_new + 4, block_size=16)
    target = sd.hf.build_model(args.config, device, shape)
    sd.damp_later_layers(target, args.drafter_layers, args.damp)
    drafter = sd.build_drafter(target, shape, args.drafter_layers, args.noise)
    print(f"# PYTHONPATH=. python3 benchmarks/gpu_spec_decode.py {' '.join(sys.argv[1:])}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; target {args.config} "
          f"({sum(p.numel() for p in target.parameters()) / 1e9:.2f} B parameters), drafter {args.drafter_layers} layers; "
          f"(its layers, noise {args.noise}; the target's later layers damped by {args.damp}); schedule "
          f"{dict(schedule.spec_schedule)}; depth 2 served by the depth-3 graphs")
    print("memory of the plans (growth of used device memory over the capture):")
    for row in memory_rows(target, drafter, shape, schedule):
        print(row)
    clean_device()
    verify, draft, verify_s, draft_s = sd.registries(target, drafter, shape, schedule, "cuda", skip=(2,))
    print(f"capture: verify {len(verify)} graphs in {verify_s:.2f} s, draft {len(draft)} graphs in {draft_s:.2f} s "
          f"(drafter / target {draft_s / verify_s:.2f}x)")
    reference = None
    results = {}
    for label, spec, form in (("plain decode, graphs", False, "unrolled"), ("spec, unrolled drafts, graphs", True, "unrolled"),
                              ("spec, chained drafts, graphs", True, "chained"), ("spec, eager", True, "eager")):
        plain = SchedulerConfig(max_num_seqs=r, spec_depth=0)
        engine = sd.SpecEngine(target, drafter, shape, schedule if spec else plain, verify, draft, form)
        requests = sd.requests_from_trace(args.requests, target.config.vocab_size, args.max_prompt, args.max_new)
        engine.generate(requests[: min(len(requests), r)])  # warm: the first prefills and rounds
        result = engine.generate(sd.requests_from_trace(args.requests, target.config.vocab_size, args.max_prompt, args.max_new))
        tokens = [q.tokens for q in result.requests]
        reference = tokens if reference is None else reference
        same = sum(a == b for a, b in zip(tokens, reference))
        results[label] = result.generated / result.seconds
        print(f"{result.summary(label)}; {same}/{len(tokens)} requests' tokens equal plain decoding's")
    base = results["plain decode, graphs"]
    eager = results["spec, eager"]
    for label, rate in results.items():
        print(f"  {label:<32} {rate:9.0f} tokens/s   {rate / base:5.2f}x plain with graphs   {rate / eager:5.2f}x spec eager")
    print("drafter replays (k drafts per request):")
    for row in draft_replay_rows(draft, shape):
        print(row)


if __name__ == "__main__":
    main()
