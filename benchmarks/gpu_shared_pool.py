"""Device memory of a target and a drafter registry, in one graph pool against one pool each (CUDA).

Target: the demo decoder at GPU size (12 x 1024, bf16); drafter: the same shape with 2 layers. Both capture the
``full`` plan of one engine (max_num_seqs 64, max_num_tokens 512). Each configuration is measured from a clean
device (graphs dropped, gc, empty_cache) as the growth of used memory (``mem_get_info``) over the capture, and
checked against eager on a few batches. The drafter issue's bar: both in one pool at most 1.15x the larger alone.
First, as the process's first graphs, ``cg.estimate_pool_memory`` of the pair is judged against the pair's capture.

    PYTHONPATH=. python3 benchmarks/gpu_shared_pool.py
"""

from __future__ import annotations

import time

import torch

import cgregistry as cg
from cgregistry.demo_model import DemoConfig, DemoDecoder, demo_inputs, random_batch

try:
    from benchmarks.timing import clean_device, used_device_bytes
except ImportError:  # run as a script from benchmarks/
    from timing import clean_device, used_device_bytes  # type: ignore[no-redef]


def main() -> None:
    target_cfg = DemoConfig(max_num_seqs=64, max_num_tokens=512)
    draft_cfg = DemoConfig(layers=2, max_num_seqs=64, max_num_tokens=512)
    target_model, draft_model = DemoDecoder(target_cfg, "cuda"), DemoDecoder(draft_cfg, "cuda")
    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=512, max_capture_size=512, mode="full")

    def registries(shared: bool, which: str) -> list[tuple[cg.GraphRegistry, DemoDecoder, DemoConfig]]:
        out: list[tuple[cg.GraphRegistry, DemoDecoder, DemoConfig]] = []
        if which in ("target", "both"):
            out.append((cg.GraphRegistry(target_model, demo_inputs(target_cfg), backend="cuda", name="target"), target_model, target_cfg))
        if which in ("drafter", "both"):
            pool = out[0][0].pool if shared and out else None
            drafter = cg.GraphRegistry(draft_model, demo_inputs(draft_cfg), backend="cuda", name="drafter", pool=pool)
            out.append((drafter, draft_model, draft_cfg))
        return out

    with torch.inference_mode():
        # The engine's recipe for the pair, as the process's first graphs: estimate both plans in the shared pool, then
        # capture them; the prediction is judged against the growth of used memory over the capture.
        regs = registries(True, "both")
        clean_device()
        t = time.perf_counter()
        pair = cg.estimate_pool_memory([(reg, plan) for reg, _, _ in regs])
        pair_s = time.perf_counter() - t
        alone = {reg.name: reg.estimate_memory(plan).capture_bytes for reg, _, _ in regs}
        clean_device()
        before = used_device_bytes()
        t = time.perf_counter()
        for reg, _, _ in regs:
            reg.capture(plan)
        capture_s = time.perf_counter() - t
        pair_taken = used_device_bytes() - before
        del regs
        clean_device()
        results, errors = {}, {}
        for label, shared, which in (("target alone", False, "target"), ("drafter alone", False, "drafter"),
                                     ("both, one pool each", False, "both"), ("both, one shared pool", True, "both")):
            clean_device()
            before = used_device_bytes()
            regs = registries(shared, which)
            for reg, _, _ in regs:
                reg.capture(plan)
            results[label] = used_device_bytes() - before
            worst = 0.0
            for reg, model, cfg in regs:
                for n in (1, 7, 64):  # 7 is padded to the 8-request key: bf16 GEMMs of another shape round differently
                    batch = cg.BatchDescriptor.decode(n)
                    inputs = random_batch(cfg, batch, "cuda")
                    got, want = reg.run(batch, **inputs).float(), model(batch, **inputs).float()
                    worst = max(worst, (got - want).abs().max().item())
            errors[label] = worst
            del regs
            clean_device()
    mib = 2**20
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {len(plan)} full graphs each")
    for label, value in results.items():
        print(f"  {label:24s} {value / mib:8.1f} MiB   max |logit - eager| {errors[label]:.3g}")
    print(f"  pair estimate (cold)     {pair.capture_bytes / mib:8.1f} MiB   predicted; the capture took {pair_taken / mib:.1f} MiB "
          f"({pair.capture_bytes / pair_taken:.3f}x); target part {pair['target'].capture_bytes / mib:.1f} MiB, drafter part "
          f"{pair['drafter'].capture_bytes / mib:.1f} MiB (alone {alone['drafter'] / mib:.1f} MiB); estimate {pair_s:.2f} s, "
          f"capture {capture_s:.2f} s")
    larger = max(results["target alone"], results["drafter alone"])
    print(f"  shared / larger alone    {results['both, one shared pool'] / larger:8.2f}x   (separate: "
          f"{results['both, one pool each'] / larger:.2f}x)")


if __name__ == "__main__":
    main()
