"""A/B in one process: `full` and `piecewise` over Inductor pieces with the residual-add pass off and on.

Demo decoder (12 x 1024, bf16), decode 1, 8 and 64, captured alone: 200-call median wall time (two
rounds), GPU kernel time, kernels and device-to-device copies a step (torch.profiler), max error
against eager; reduce-overhead of the same step alongside.

    PYTHONPATH=. python3 benchmarks/gpu_residual_adds.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.demo_model import DemoConfig, DemoDecoder, attention_kernel_into, demo_inputs, random_batch

try:
    from benchmarks.timing import per_call_us, per_step_on_gpu, reduce_overhead_warmed
except ImportError:  # run as a script from benchmarks/
    from timing import per_call_us, per_step_on_gpu, reduce_overhead_warmed  # type: ignore[no-redef]

SIZES = (1, 8, 64)


class Off(CustomGraphPass):
    """A post pass that does nothing: with it set, the pieces compile without cgregistry's own."""

    def __call__(self, graph: object) -> None:
        pass

    def uuid(self) -> str:
        return "off"


def main() -> None:
    cfg = DemoConfig.for_device("cuda")
    model = DemoDecoder(cfg, "cuda", seed=0, attention=cg.eager_break(attention_kernel_into))
    gen = torch.Generator().manual_seed(0)

    def step(input_ids: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return model(None, input_ids, req_idx, seq_lens)

    def registry(strategy: str, with_pass: bool) -> cg.GraphRegistry:
        reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), backend="cuda")
        compiled = reg.compile(step, inductor=True)
        with inductor_config.patch({} if with_pass else {"post_grad_custom_post_pass": Off()}):
            reg.capture([(B.decode(n), strategy) for n in sorted(SIZES, reverse=True)], progress=False)
        return reg

    regs = {f"{s}_{'on' if on else 'off'}": registry(s, on) for s in ("full", "piecewise") for on in (False, True)}
    ro, _ = reduce_overhead_warmed(step, cfg, SIZES, gen)
    for n in SIZES:
        batch = B.decode(n)
        inputs = random_batch(cfg, batch, "cuda", gen)
        with torch.inference_mode():
            want = model(batch, **inputs).float()
            runs: dict[str, Callable[[], torch.Tensor]] = {k: (lambda r=r: r.run(batch, **inputs)) for k, r in regs.items()}
            runs["ro"] = lambda: ro(**inputs)
            errors = {k: (fn().float() - want).abs().max().item() for k, fn in runs.items()}
            for round_ in range(2):
                for k, fn in runs.items():
                    us = per_call_us(fn, 200)
                    gpu, kernels, copies = per_step_on_gpu(fn) if round_ == 0 else (float("nan"),) * 3
                    print(f"batch {n:3d} round {round_} {k:14s} wall {us:8.1f} us  gpu {gpu:8.1f} us  kernels {kernels:6.1f} "
                          f"copies {copies:5.1f} err {errors[k]:.3f}", flush=True)


if __name__ == "__main__":
    main()
