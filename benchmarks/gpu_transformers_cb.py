"""transformers' continuous batching served three ways in one process: eager, transformers' own CUDA graphs, and
cgregistry's (``plugins/cgregistry-transformers``), on a Llama-3.2-1B-shaped model with random bf16 weights (sdpa).

Workloads: ``--prompts`` random prompts of 16-256 tokens with ``--new`` new tokens each (greedy), and the first
``--trace`` requests of the bundled Azure trace (prompts capped at 1024 tokens, outputs at 128).  For each way, one
persistent manager is called three times: the first call includes the start-up (transformers' warm-up captures, or
cgregistry's capture while serving), the later two are the steady state.  Reported: tokens/s per call, the time to the
first request's first token, requests whose tokens equal transformers' graphs' (bf16, so near ties may differ), graph
count and the device memory the serving grew by, and a per-step host breakdown of a steady call (the batch's
preparation, the forward as launched, sampling, waiting for the device, the batch's update; for cgregistry also
``run()``, and inside it the graph segments' launches, the eager attention breaks, and the rest: what ``run()`` adds).
``--ways`` serves only some ways (one way per process compares first calls without another way's warm-up before
them); ``--capture`` is ``GraphSettings(capture=...)``.

    PYTHONPATH=.:plugins/cgregistry-transformers python3 benchmarks/gpu_transformers_cb.py [--prompts 64 --new 64 --trace 64]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import cgregistry_transformers as cgt
from cgregistry.plan.workload import read_trace

WAYS = ("eager", "transformers graphs", "cgregistry")


CUDA = torch.cuda.is_available()


def llama_1b(tiny: bool) -> LlamaForCausalLM:
    """The Llama-3.2-1B shape in bf16 on the GPU; ``tiny``: two small layers in fp32 (a smoke run on a CPU)."""
    shape = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    if tiny:
        shape = dict(vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA else "cpu"):
        model = LlamaForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    return model.eval()


def free_memory() -> int:
    return torch.cuda.mem_get_info()[0] if CUDA else 0


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 257, (count,), generator=g).tolist()
    return [torch.randint(1, 128000, (n,), generator=g).tolist() for n in lengths]


def trace_prompts(count: int, seed: int = 0) -> tuple[list[list[int]], int]:
    g = torch.Generator().manual_seed(seed)
    reqs = read_trace(limit=count)
    prompts = [torch.randint(1, 128000, (min(r.prompt_tokens, 1024),), generator=g).tolist() for r in reqs]
    return prompts, min(128, max(r.output_tokens for r in reqs))


class GraphKeys(logging.Handler):
    """The keys transformers' own runner captured graphs for, as its log says ("Setting graph for key = ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.keys: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Setting graph for" in message:
            self.keys.append(message.split("=", 1)[-1].strip())


class StepClock:
    """Host time of each part of a step, wrapped around the batch processor's methods for one call."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = defaultdict(list)

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.parts[label].append(time.perf_counter() - start)

        setattr(obj, name, timed)

    def summary(self, steps: int) -> str:
        return ", ".join(f"{label} {sum(v) / steps * 1e3:.3f}" for label, v in self.parts.items())


def instrument(manager: Any, way: str) -> StepClock:
    """Time each part of the steps of the next call (and, for cgregistry, run(), its graph launches and breaks)."""
    clock = StepClock()
    bp = manager.batch_processor
    clock.wrap(bp, "prepare_next_batch", "prepare")
    clock.wrap(bp.inputs_and_outputs, "retrieve_device_outputs", "wait device")
    clock.wrap(bp, "update_batch", "update")
    runner = bp.model_runner
    clock.wrap(runner, "compute_batch", "forward+sample launch")
    if way == "cgregistry":
        reg = runner.registry
        served = reg.run

        def run(*args: Any, **kwargs: Any) -> Any:  # a step served by graphs launches one; an eager step none
            launches, breaks = clock.parts["of which launches"], clock.parts["of which breaks"]
            seen, start = (len(launches), len(breaks)), time.perf_counter()
            try:
                return served(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                if len(launches) > seen[0]:  # what run() adds to this step: neither a launch nor a break
                    clock.parts["of which run() from graphs"].append(took)
                    inside = sum(launches[seen[0]:]) + sum(breaks[seen[1]:])
                    clock.parts["of which run() adds"].append(took - inside)
                else:
                    clock.parts["of which run() eager"].append(took)

        reg.run = run
        TIMING[:] = [clock]
    return clock


TIMING: list[StepClock] = []  # the clock of the call being timed, if any: graph launches and breaks report to it


def time_launches_and_breaks() -> None:
    """Time each graph segment's launch and each attention break of the graphs captured from now on (before any
    capture: a breakable graph binds its segments' launches when it is made)."""
    import cgregistry.backends.cuda as cuda
    from cgregistry.backends.cpu import CpuGraph
    from cgregistry_transformers.attention import LiveBatch

    def timed(run: Any, label: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not TIMING:
                return run(*args, **kwargs)
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                TIMING[0].parts[label].append(time.perf_counter() - start)

        return call

    launch = cuda.direct_replay
    cuda.direct_replay = lambda graph: timed(launch(graph), "of which launches")
    CpuGraph.replay = timed(CpuGraph.replay, "of which launches")  # the tiny run on a CPU
    LiveBatch.attend_into = timed(LiveBatch.attend_into, "of which breaks")


def manager_for(model: LlamaForCausalLM, way: str, new_tokens: int, hints: Any, capture: str | None) -> Any:
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    if way == "cgregistry":
        settings = cgt.GraphSettings() if capture is None else cgt.GraphSettings(capture=capture)
        return cgt.init_continuous_batching(model, gen, ContinuousBatchingConfig(), workload_hints=hints, graphs=settings)
    config = ContinuousBatchingConfig(use_cuda_graph=way == "transformers graphs" and CUDA)
    return model.init_continuous_batching(gen, config, workload_hints=hints)


def serve(manager: Any, prompts: list[list[int]], new_tokens: int, warm_up: bool) -> tuple[dict, float, float]:
    """One call: warm-up (transformers' own, as generate_batch does), start, every request, stop (kept)."""
    start = time.perf_counter()
    if warm_up and not manager.warmed_up:
        manager.warmup()
    manager.start()
    ids = manager.add_requests(inputs=prompts, max_new_tokens=new_tokens, record_timestamps=True)
    results = {}
    while len(results) < len(ids):
        out = manager.get_result(timeout=60)
        if out is None:
            raise RuntimeError("no result for 60 s")
        if out.is_finished():
            results[out.request_id] = out
    manager.stop(block=True, keep_for_next_session=True)
    if CUDA:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stamps = [r.timestamps[0] for r in results.values() if r.timestamps]
    first = min(stamps) - start if stamps else float("nan")
    return {rid: results[rid] for rid in ids}, elapsed, first


def run_workload(model: LlamaForCausalLM, name: str, calls: list[list[list[int]]], new_tokens: int,
                 ways: list[str], capture: str | None) -> None:
    """Each way serves ``calls[i]`` at its i-th call (the same prompts each call unless ``--fresh-prompts``: then no
    prefix is cached from the call before; transformers 5.17's own kept managers fail on new prompts, see the note)."""
    prompts = calls[0]
    from transformers.generation.continuous_batching.utils import WorkloadHints
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=new_tokens,
                          num_requests=len(prompts))
    print(f"\n== {name}: {len(prompts)} requests a call, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{new_tokens} new tokens each")
    outputs: dict[str, list[list[int]]] = {}
    for way in ways:
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        free_before = free_memory()
        made_at = time.perf_counter()
        keys = GraphKeys()
        cb_logger = logging.getLogger("ContinuousBatchingLogger")
        cb_logger.addHandler(keys)
        level = cb_logger.level
        cb_logger.setLevel(min(level or logging.INFO, logging.INFO))
        manager = manager_for(model, way, new_tokens, hints, capture)
        making = time.perf_counter() - made_at  # the first call pays for the manager (its KV cache) too
        rates = []
        for call in range(3):
            clock = None
            if call == 2:  # a kept manager keeps its batch processor between calls
                clock = instrument(manager, way)
            results, elapsed, first = serve(manager, calls[call], new_tokens, warm_up=way != "cgregistry")
            if call == 0:
                elapsed, first = elapsed + making, first + making
            made = sum(len(r.generated_tokens) for r in results.values())
            rates.append(made / elapsed)
            errors = [r.error for r in results.values() if r.error]
            print(f"{way:20s} call {call + 1}: {elapsed:6.2f} s, {made / elapsed:8.0f} tokens/s, first token after "
                  f"{first * 1e3:7.1f} ms{'; ERRORS: ' + errors[0] if errors else ''}")
            if call == 0:
                outputs[way] = [list(r.generated_tokens) for r in results.values()]
            if clock is not None:
                TIMING.clear()
                steps = len(clock.parts["prepare"])
                step_s = sum(sum(clock.parts[k]) for k in ("prepare", "forward+sample launch", "wait device", "update"))
                adds = ""
                if clock.parts.get("of which run() adds"):
                    rest = clock.parts["of which run() adds"]
                    adds = f"; what run() adds {sum(rest) / len(rest) * 1e3:.3f} ms a graph-served step ({len(rest)})"
                print(f"{'':20s} per step (host ms, {steps} steps): {clock.summary(steps)}; step "
                      f"{step_s / steps * 1e3:.3f}{adds}")
        used = free_before - free_memory()
        if way == "cgregistry":
            reg = cgt.registry_of(manager)
            print(f"{'':20s} graphs: {len(reg.entries())} entries, {reg.memory_bytes() / 2**20:.0f} MiB measured; "
                  f"{reg.stats().hits} steps from graphs, {reg.stats().misses} eager")
        elif way == "transformers graphs":
            print(f"{'':20s} graphs: {len(keys.keys)} ({', '.join(keys.keys[:6])} ...)")
        cb_logger.removeHandler(keys)
        cb_logger.setLevel(level)
        print(f"{'':20s} device memory held after the calls (KV cache, graphs, pools): {used / 2**30:.2f} GiB; "
              f"steady {statistics.mean(rates[1:]):.0f} tokens/s")
        manager.stop(block=True)
        manager.destroy()
        model.__dict__.pop("_cached_continuous_batching_manager", None)
        del manager
    if "transformers graphs" not in outputs:
        return
    ref = outputs["transformers graphs"]
    for way in (w for w in ("eager", "cgregistry") if w in outputs):
        same = sum(a == b for a, b in zip(outputs[way], ref))
        print(f"{way}: {same}/{len(ref)} requests' tokens equal transformers graphs'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--trace", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="a two-layer fp32 model: a smoke run of this script")
    parser.add_argument("--fresh-prompts", action="store_true", help="new prompts at each call of a kept manager")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"a comma-separated subset of {WAYS}")
    parser.add_argument("--capture", help="GraphSettings(capture=...) for cgregistry (default: the plugin's default)")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if not set(ways) <= set(WAYS):
        parser.error(f"--ways {args.ways!r}: each must be one of {WAYS}")
    import transformers
    where = torch.cuda.get_device_name() if CUDA else "cpu"
    capture = args.capture or cgt.GraphSettings().capture
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {where}; cgregistry captures: {capture}")
    model = llama_1b(args.tiny)
    time_launches_and_breaks()
    with torch.no_grad():
        seeds = range(3) if args.fresh_prompts else [0, 0, 0]
        run_workload(model, "random prompts", [random_prompts(args.prompts, seed) for seed in seeds], args.new, ways,
                     args.capture)
        if args.trace:
            new_tokens = trace_prompts(args.trace)[1]
            run_workload(model, "bundled trace", [trace_prompts(args.trace, seed)[0] for seed in seeds], new_tokens, ways,
                         args.capture)


if __name__ == "__main__":
    main()
