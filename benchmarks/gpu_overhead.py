"""Host-side cost of ``reg.run()`` on the GPU, precise enough to compare two versions back to back.

Each round enqueues N calls and reads the host clock before synchronising, so the
figure is the host time per call (what a step pays on top of the GPU work when the
host is the bottleneck), not the GPU's.  Cases, on a one-kernel graph: bare
``graph.replay()``, a hand-written copy + replay + slice, ``reg.run()`` with no
inputs, ``reg.run()`` with one input.  Uses only the public API, so another
checkout can be measured with the same script:

    PYTHONPATH=. python3 benchmarks/gpu_overhead.py
    PYTHONPATH=../other-checkout python3 benchmarks/gpu_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B

try:
    from benchmarks.timing import copy_replay_slice, doubling_graph
except ImportError:  # run as a script from benchmarks/
    from timing import copy_replay_slice, doubling_graph  # type: ignore[no-redef]


def host_us(fn: Callable[[], object], calls: int, rounds: int) -> tuple[float, float]:
    """Median and minimum over rounds of host microseconds per call (GPU drained between rounds)."""
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples), min(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="calls per round (few enough not to fill the launch queue)")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    n = 8
    batch = B.decode(n)
    live = torch.randn(n, 256, device="cuda")
    held = torch.randn(n, 256, device="cuda")

    graph, static, out = doubling_graph(n)

    hand = copy_replay_slice(graph, static, out, live)

    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((64, 256), torch.float32)}, backend="cuda")
    reg.capture([(batch, "full")], progress=False)
    bare_reg = cg.GraphRegistry(lambda b: held * 2, {}, backend="cuda")
    bare_reg.capture([(batch, "full")], progress=False)
    with torch.inference_mode():
        assert torch.equal(reg.run(batch, x=live), live * 2) and torch.equal(bare_reg.run(batch), held * 2)
        cases = {
            "bare replay": graph.replay,
            "hand copy+replay+slice": hand,
            "reg.run, no inputs": lambda: bare_reg.run(batch),
            "reg.run, one input": lambda: reg.run(batch, x=live),
        }
        results = {name: host_us(fn, args.calls, args.rounds) for name, fn in cases.items()}
    print(f"cgregistry from {cg.__file__.rsplit('/cgregistry/', 1)[0]}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'host us per call':26} {'median':>8} {'min':>8}")
    for name, (median, low) in results.items():
        print(f"{name:26} {median:8.3f} {low:8.3f}")
    bare = results["bare replay"][0]
    print(f"overhead over a bare replay: no inputs {results['reg.run, no inputs'][0] - bare:+.3f} us, "
          f"one input {results['reg.run, one input'][0] - results['hand copy+replay+slice'][0]:+.3f} us vs hand-written")


if __name__ == "__main__":
    main()
