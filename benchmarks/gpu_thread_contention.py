"""What another thread's CUDA work costs a host-bound eager step on the serving thread (no cgregistry involved).

A background capture runs beside a serving thread whose eager steps launch thousands of small kernels. This
serves 40 eager steps of a 288-layer toy decoder (about 2,000 launches each) beside one other thread at a time
doing one kind of work a capture does, and prints each step's median and p97 wall time and the serving thread's
CPU time (``time.thread_time``; a CUDA wait spins by default, so it includes waits on the device):

- ``instantiate``: ``cudaGraphInstantiate`` of the same decoder's graph in a loop (no GIL held); ``half duty``
  sleeps as long as each one took;
- ``capture``: capturing that graph again and again (Python under the GIL, captured launches, instantiation);
- ``eager other stream``: the decoder run eagerly on another stream;
- ``device sync loop``: ``torch.cuda.synchronize()`` in a loop;
- ``python``: pure Python (the GIL only).

Each scenario serves at most ``--budget`` seconds.  The interpreter's switch interval is set as the capture thread
sets it (``cgregistry.capture.background.SWITCH_INTERVAL_S``).

    PYTHONPATH=. python3 benchmarks/gpu_thread_contention.py [--budget 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from cgregistry.capture.background import SWITCH_INTERVAL_S

HIDDEN = 512


class Block(torch.nn.Module):
    """A pre-norm residual block: about seven launches."""

    def __init__(self, weight: torch.Tensor, norm: torch.nn.LayerNorm) -> None:
        super().__init__()
        self.weight, self.norm = weight, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(self.norm(x), self.weight)
        return x + torch.nn.functional.silu(h) * 0.5


class Contention:
    """The toy decoder, the serving loop and the background workloads."""

    def __init__(self, budget_s: float) -> None:
        torch.manual_seed(0)
        norm = torch.nn.LayerNorm(HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / 20 for _ in range(48)]
        self.blocks = torch.nn.ModuleList(Block(w, norm) for w in weights)
        self.budget_s = budget_s
        self.x = torch.randn(8, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.small = torch.randn(4, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.side = torch.cuda.Stream()
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.iterations = 0

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            for block in self.blocks:
                x = block(x)
        return x

    def serve(self, steps: int = 40) -> tuple[int, float, float, float]:
        """(steps served, median wall ms, p97 wall ms, median serving-thread CPU ms)."""
        wall, cpu = [], []
        end = time.perf_counter() + self.budget_s
        while len(wall) < steps and time.perf_counter() < end:
            t, c = time.perf_counter(), time.thread_time()
            self.step(self.x).sum().item()
            wall.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.thread_time() - c) * 1e3)
        wall.sort()
        return len(wall), statistics.median(wall), wall[int(0.97 * (len(wall) - 1))], statistics.median(cpu)

    def graph(self, keep: bool = False) -> torch.cuda.CUDAGraph:
        """The decoder at 4 rows captured on the side stream (warmed up there first: this thread's cuBLAS handle)."""
        with torch.cuda.stream(self.side):
            self.step(self.small)
        self.side.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.side):
            graph.capture_begin(capture_error_mode="thread_local")
            self.step(self.small)
            graph.capture_end()
        return graph

    def instantiate(self, half_duty: bool = False) -> None:
        graph = self.graph(keep=True)
        graph.instantiate()
        self.ready.set()
        while not self.stop.is_set():
            began = time.perf_counter()
            graph.instantiate()
            self.iterations += 1
            if half_duty:
                time.sleep(time.perf_counter() - began)

    def capture(self) -> None:
        self.graph()
        self.ready.set()
        while not self.stop.is_set():
            self.graph()
            self.iterations += 1

    def eager(self) -> None:
        with torch.cuda.stream(self.side):
            self.step(self.small)
            self.ready.set()
            while not self.stop.is_set():
                self.step(self.small)
                self.side.synchronize()
                self.iterations += 1

    def sync(self) -> None:
        self.ready.set()
        while not self.stop.is_set():
            torch.cuda.synchronize()
            self.iterations += 1

    def python(self) -> None:
        self.ready.set()
        while not self.stop.is_set():
            sum(range(2000))
            self.iterations += 1

    def beside(self, work: Callable[[], None] | None) -> tuple[int, float, float, float]:
        self.stop.clear()
        self.ready.clear()
        self.iterations = 0
        thread = None
        if work is not None:
            thread = threading.Thread(target=work, daemon=True)
            thread.start()
            assert self.ready.wait(60), "the background work never started"
        try:
            return self.serve()
        finally:
            self.stop.set()
            if thread is not None:
                thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds each scenario serves at most")
    args = parser.parse_args()
    bench = Contention(args.budget)
    bench.serve(10)  # warm-up: every kernel, the allocator
    began = time.perf_counter()
    graph = bench.graph(keep=True)
    graph.instantiate()
    captured = time.perf_counter()
    graph.instantiate()
    instantiated = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {sys.version.split()[0]}; one capture of "
          f"the decoder at 4 rows {(captured - began) * 1e3:.1f} ms (warm-up, record, instantiate), one instantiation "
          f"{(instantiated - captured) * 1e3:.1f} ms")
    if SWITCH_INTERVAL_S is not None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    scenarios: list[tuple[str, Callable[[], None] | None]] = [
        ("none", None), ("instantiate", bench.instantiate), ("instantiate half duty", lambda: bench.instantiate(True)),
        ("capture", bench.capture), ("eager other stream", bench.eager), ("device sync loop", bench.sync),
        ("python", bench.python),
    ]
    print(f"{'beside the serving thread':24s} {'steps':>5s} {'median ms':>9s} {'p97 ms':>7s} {'CPU ms':>7s} {'iterations':>10s}")
    for name, work in scenarios:
        steps, median, p97, cpu = bench.beside(work)
        print(f"{name:24s} {steps:5d} {median:9.1f} {p97:7.1f} {cpu:7.1f} {bench.iterations:10d}", flush=True)


if __name__ == "__main__":
    main()
