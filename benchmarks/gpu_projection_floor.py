"""How fast can one decode step's projections be? The Llama-3.2-1B layer's four matmuls at one and eight rows: cuBLAS
(``F.linear``) against a hand-written Triton product in which each program reads a band of the weight's rows over the
whole inner dimension, over 36 configurations, µs a call inside a CUDA graph of 64 calls (no launch overhead).

It bounds what kernel choice can give the HF Llama step at batch 1 (benchmarks/gpu_hf_llama.py --inductor --fused):
a layer's fused q/k/v, o, fused gate/up and down projections, times 16 layers, plus the LM head, against the 2x
weights-read target.

    PYTHONPATH=. python3 benchmarks/gpu_projection_floor.py
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.runtime.errors

sys.path.insert(0, str(Path(__file__).parent))
from gpu_hf_llama import HBM_BYTES_PER_S  # noqa: E402

SHAPES = {"q/k/v (fused)": (3072, 2048), "o": (2048, 2048), "gate/up (fused)": (16384, 2048), "down": (2048, 8192)}
LM_HEAD = (32000, 2048)
LAYERS = 16
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
           for n, k, w, s in itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4, 6))]


@triton.jit
def band_matmul_kernel(x_ptr, w_ptr, out_ptr, rows, n, inner, x_stride, w_stride, out_stride,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out = x @ w.T`` for at most 16 rows of ``x``: one program per ``BLOCK_N`` output columns, over all of ``inner``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for first in range(0, inner, BLOCK_K):
        ks = first + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r[:, None] * x_stride + ks[None, :], mask=(r < rows)[:, None], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * w_stride + ks[None, :], mask=(cols < n)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + r[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(r < rows)[:, None] & (cols < n)[None, :])


def band_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, BLOCK_N: int, BLOCK_K: int, num_warps: int,
                num_stages: int) -> None:
    n, inner = w.shape
    band_matmul_kernel[(triton.cdiv(n, BLOCK_N),)](x, w, out, x.shape[0], n, inner, x.stride(0), w.stride(0), out.stride(0),
                                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages)


def in_graph_us(fn: Callable[[], object], calls: int = 64) -> float:
    """Best of five: µs a call of ``fn`` recorded ``calls`` times in one CUDA graph, replayed twice."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (2 * calls))
    return best


def main() -> None:
    device = torch.device("cuda")
    card = next((name for name in HBM_BYTES_PER_S if name in torch.cuda.get_device_name()), None)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; bf16")
    print(f"{'rows':>4} {'shape (N x K)':>16} {'layer part':>16} {'cuBLAS us':>9} {'TB/s':>5} {'best band us':>12}  best configuration")
    per_layer = {1: [0.0, 0.0], 8: [0.0, 0.0]}
    for rows in (1, 8):
        for part, (n, inner) in SHAPES.items():
            w = torch.randn(n, inner, device=device, dtype=torch.bfloat16)
            x = torch.randn(rows, inner, device=device, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
            cublas = in_graph_us(lambda: torch.nn.functional.linear(x, w))
            timed = []
            for config in CONFIGS:
                try:
                    band_matmul(x, w, out, **config)
                except triton.runtime.errors.OutOfResources:  # too many stages of too large a band for shared memory
                    continue
                torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)
                timed.append((in_graph_us(lambda: band_matmul(x, w, out, **config)), config))
            best, config = min(timed, key=lambda item: item[0])
            per_layer[rows][0] += cublas
            per_layer[rows][1] += best
            print(f"{rows:4d} {f'{n} x {inner}':>16} {part:>16} {cublas:9.2f} {n * inner * 2 / cublas / 1e6:5.2f} {best:12.2f}  {config}")
    w = torch.randn(*LM_HEAD, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, LM_HEAD[1], device=device, dtype=torch.bfloat16)
    head = in_graph_us(lambda: torch.nn.functional.linear(x, w))
    cublas_layer, band_layer = per_layer[1]
    print(f"one row: a layer's projections {cublas_layer:.1f} us in cuBLAS, {band_layer:.1f} us at best in bands "
          f"(each shape's own best configuration); {LAYERS} layers and the LM head ({head:.1f} us): "
          f"{LAYERS * min(cublas_layer, band_layer) + head:.0f} us")
    if card:
        weights = sum(n * k for n, k in SHAPES.values()) * 2 * LAYERS + 2 * LM_HEAD[0] * LM_HEAD[1] * 2  # the embedding too
        print(f"the benchmark's 2x weights-read budget on the {card}: {2 * weights / HBM_BYTES_PER_S[card] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
