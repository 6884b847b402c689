"""Child process for test_cublas_workspace: graphs captured, cuBLAS's workspaces cleared by someone else, replay.

``python -m tests.cublas_workspace_worker SCENARIO [--unprotected]``; exits 0 when every replay matches eager
and the memory that took over the old workspaces is untouched; a fault ends the process (the test sees it).
"""

from __future__ import annotations

import sys

import torch

import cgregistry as cg
from cgregistry.backends import cuda as cuda_backend

B = cg.BatchDescriptor


def main() -> int:
    scenario = sys.argv[1]
    if "--unprotected" in sys.argv:  # what the backend did before it cleared workspaces around captures
        cuda_backend.clear_cublas_workspaces = lambda: None
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().half()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return layers(x)

    ro = torch.compile(lambda x: layers(x) * 2, mode="reduce-overhead", dynamic=True)
    if scenario == "reduce-overhead-first":  # its warm-ups and recordings before the registry exists
        with torch.inference_mode():
            for n in (200, 64, 24, 8):
                for _ in range(3):
                    ro(torch.randn(n, 1024, device="cuda", dtype=torch.float16))
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((256, 1024), torch.float16)}, backend="cuda")
    strategy = "breakable" if scenario == "breakable" else "full"
    sizes = (256, 64, 8, 1)
    with torch.inference_mode():
        reg.capture([(B(n, n) if strategy == "full" else B(n), strategy) for n in sizes])
        if scenario.startswith("reduce-overhead"):
            for n in (32, 16, 200):
                for _ in range(3):
                    ro(torch.randn(n, 1024, device="cuda", dtype=torch.float16))
        else:
            torch._C._cuda_clearCublasWorkspaces()  # what reduce-overhead's warm-up and recording do
        filler = [torch.full((1 << 22,), 7.0, device="cuda") for _ in range(64)]  # takes the freed blocks
        torch.cuda.synchronize()
        bad = 0
        for _ in range(3):
            for n in sizes:
                x = torch.randn(n, 1024, device="cuda", dtype=torch.float16)
                if scenario.startswith("reduce-overhead"):
                    ro(x)  # reduce-overhead keeps running between the registry's replays
                got = reg.run(B(n, n), x=x).float()
                want = layers(x).float()
                bad += int(not torch.allclose(got, want, atol=2e-2, rtol=2e-2))
        torch.cuda.synchronize()
        touched = sum(int(not f.eq(7.0).all()) for f in filler)
    print(f"{scenario}: {bad} wrong replays, {touched} filler tensors overwritten")
    return 1 if bad or touched else 0


if __name__ == "__main__":
    sys.exit(main())
