"""Predicted against actual device memory of capture(plan) on the GPU.

Each configuration runs in a fresh process (the caching allocator starts empty) and follows the
engine's recipe: build the registry, ``reg.estimate_memory(plan)`` (the process's first graphs, as an
engine's estimate is; what stays of it is split into the caching allocator's part, which must be none,
and the rest: kernels loaded, cuBLAS handles and the memory the driver keeps from dead graphs), then
an 8 GiB stand-in for the KV cache (allocated between the two, as the recipe has it), ``reg.capture(plan)`` and the device memory it took (``torch.cuda.mem_get_info`` before and after).
Target: the predicted ``capture_bytes`` within 5% (or 32 MiB, whichever is larger) of what capture
took.  Then ``clear()`` and a second estimate, which must leave nothing behind.  Configurations: the
demo decoder in ``full``, ``full_and_piecewise``, ``full_and_breakable``, with LoRA counts and spec
depths, and the Hugging Face Llama engine of examples/hf_llama.py; two of them also captured between steps
(``capture(plan, background=True)``: the same pool and inputs, so the same estimate).  The estimate is the default one (every key captured), or
with ``--sample`` ``estimate_memory(sample=True)`` (a sample of the whole-graph keys); each configuration's
capture is also timed alone in a fresh process ("alone s"), and "start-up" is (estimate + capture) / capture
alone: what the estimate adds to an engine's start-up.

    PYTHONPATH=. python3 benchmarks/gpu_memory.py [--sample]            # every configuration, a table at the end
    PYTHONPATH=. python3 benchmarks/gpu_memory.py --one NAME [--sample]  # one, printing a JSON line
    PYTHONPATH=. python3 benchmarks/gpu_memory.py --capture-first       # no estimate: capture, then back the KV cache

``--capture-first`` is the other way to size a KV cache: its addresses reserved before capture
(``cgregistry.kvcache.ReservedMemory``), the plan captured with no estimate, the cache backed with what the
device has left after it.  It reports that start-up against the capture alone and what stayed unbacked.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import cgregistry as cg

KV_CACHE_BYTES = 8 << 30  # allocated between the estimate and the capture, as an engine's KV cache is

CONFIGS = {
    "demo full": dict(mode="full"),
    "demo full_and_breakable": dict(mode="full_and_breakable"),
    "demo full_and_piecewise": dict(mode="full_and_piecewise"),
    "demo full, spec 0,2, LoRA 2": dict(mode="full", spec_depths=(0, 2), max_loras=2),
    "demo full_and_breakable, spec 0,1": dict(mode="full_and_breakable", spec_depths=(0, 1)),
    "hf llama-3.2-1b full_and_breakable": dict(hf=True, mode="full_and_breakable"),
    "hf llama-3.2-1b full": dict(hf=True, mode="full"),
    "demo full_and_breakable (background)": dict(mode="full_and_breakable", background=True),
    "hf llama-3.2-1b full_and_breakable (background)": dict(hf=True, mode="full_and_breakable", background=True),
}


def _demo(options: dict[str, Any]) -> tuple[cg.GraphRegistry, cg.CapturePlan]:
    from cgregistry.strategies.breaks import eager_break
    from cgregistry.demo_model import DemoConfig, DemoDecoder, attention_kernel_into, demo_inputs

    device = torch.device("cuda")
    cfg = DemoConfig.for_device(device)
    mode = options["mode"]
    plan = cg.CapturePlan.build(max_num_seqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens, **options)
    if "piecewise" in mode:
        model = DemoDecoder(cfg, device, seed=0, attention=eager_break(attention_kernel_into))
        reg = cg.GraphRegistry(lambda batch, **inputs: compiled(**inputs), demo_inputs(cfg), preference=cg.plan.mode_preference(mode))
        compiled = reg.compile(lambda input_ids, req_idx, seq_lens: model(None, input_ids, req_idx, seq_lens))
    else:
        model = DemoDecoder(cfg, device, seed=0)
        reg = cg.GraphRegistry(model, demo_inputs(cfg), preference=cg.plan.mode_preference(mode))
    return reg, plan


def _hf(options: dict[str, Any]) -> tuple[cg.GraphRegistry, cg.CapturePlan]:
    spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
    hf = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["hf_llama"] = hf
    spec.loader.exec_module(hf)  # type: ignore[union-attr]
    shape = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    model = hf.build_model("llama-3.2-1b", torch.device("cuda"), shape)
    mode = options["mode"]
    reg = cg.GraphRegistry(hf.make_step(model, hf.decoder(model)), hf.static_inputs(shape), output_axis=hf.OUTPUT_AXES,
                           preference=("full", "piecewise", "breakable"))
    reg.watch(model)
    plan = cg.CapturePlan.build(max_num_seqs=shape.max_num_seqs, max_num_tokens=shape.max_num_tokens,
                                max_capture_size=shape.max_num_tokens, mode=mode)
    return reg, plan


def _configuration(name: str) -> tuple[cg.GraphRegistry, cg.CapturePlan, bool]:
    """Configuration ``name``'s registry, plan, and whether it captures in the background."""
    options = dict(CONFIGS[name])
    background = options.pop("background", False)
    reg, plan = (_hf if options.pop("hf", False) else _demo)(options)
    return reg, plan, background


def capture_alone(name: str) -> dict[str, Any]:
    """The configuration's capture with no estimate before it, the process's first graphs: its seconds."""
    reg, plan, background = _configuration(name)
    with torch.inference_mode():
        torch.cuda.synchronize()
        t = time.perf_counter()
        reg.capture(plan, background=background)
        if background and not reg.wait_captured(timeout=300):
            raise SystemExit(f"{name}: the background capture did not finish")
        torch.cuda.synchronize()
        return {"name": name, "capture_alone_s": time.perf_counter() - t}


def capture_first(name: str) -> dict[str, Any]:
    """No estimate: a stand-in KV cache's address range reserved for the whole device with one granule backed, the
    configuration captured, then the range backed with everything the device has left (``ReservedMemory``); the
    seconds of each part and what was left unbacked (target: within 64 MiB)."""
    from cgregistry.kvcache import ReservedMemory

    reg, plan, background = _configuration(name)
    device = torch.device("cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        t = time.perf_counter()
        kv = ReservedMemory(torch.cuda.mem_get_info(device)[1], device=device)
        reserve_s = time.perf_counter() - t
        reg.capture(plan, background=background)
        if background and not reg.wait_captured(timeout=300):
            raise SystemExit(f"{name}: the background capture did not finish")
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t - reserve_s
        torch.cuda.empty_cache()
        t2 = time.perf_counter()
        backed = kv.back_free()
        torch.cuda.synchronize()
        back_s = time.perf_counter() - t2
        left = torch.cuda.mem_get_info(device)[0]
        kv.tensor[backed - (1 << 20): backed].fill_(1)  # the last backed MiB is memory the device can write
        torch.cuda.synchronize()
    return {"name": name, "keys": len(plan), "reserve_s": reserve_s, "capture_s": capture_s, "back_s": back_s,
            "kv_bytes": backed, "left": left, "graphs": reg.memory_bytes()}


def one(name: str, sample: bool = False) -> dict[str, Any]:
    reg, plan, background = _configuration(name)
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        t = time.perf_counter()
        cold = reg.estimate_memory(plan, sample=sample)  # the process's first graphs, as an engine's estimate is
        estimate_s = time.perf_counter() - t
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_est, reserved_cold = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        kv = torch.empty(KV_CACHE_BYTES, dtype=torch.uint8, device="cuda")  # the recipe's step 3: the KV cache, between the two
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        reg.capture(plan, background=background)  # what the engine's recipe does next: the estimate is judged against this
        if background and not reg.wait_captured(timeout=300):
            raise SystemExit(f"{name}: the background capture did not finish")
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t
        free2 = torch.cuda.mem_get_info()[0]
        per_key = {f"{e.key} [{e.strategy}]": (e.predicted_bytes, e.device_bytes) for e in reg.entries()}
        reg.clear()
        del kv
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free3 = torch.cuda.mem_get_info()[0]
        est = reg.estimate_memory(plan, sample=sample)  # a second, once graphs were captured and dropped: it must leave nothing
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free4 = torch.cuda.mem_get_info()[0]
    taken = free1 - free2
    worst = max((abs((p or 0) - (d or 0)) for p, d in per_key.values()), default=0)
    return {
        "name": name, "keys": len(plan), "probes": sum(k.probed for k in cold.keys), "predicted": cold.capture_bytes, "taken": taken,
        "second_predicted": est.capture_bytes, "left_behind": free3 - free4, "left_cold": free0 - free_est, "kv_took": free_est - free1,
        "left_cold_allocator": reserved_cold - reserved0, "pool": cold.pool_bytes, "warmup": cold.warmup_bytes,
        "per_key": cold.capture_bytes - cold.pool_bytes - cold.warmup_bytes, "estimate_s": estimate_s, "capture_s": capture_s,
        "predicted_capture_s": cold.capture_seconds, "worst_key_error": worst,
    }


def _each(name: str, extras: list[list[str]]) -> list[dict[str, Any]] | None:
    """``--one name`` with each of ``extras``, a fresh process each; None (and the error shown) when one fails."""
    found = []
    for extra in extras:
        done = subprocess.run([sys.executable, __file__, "--one", name, *extra], capture_output=True, text=True, timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{name} {extra}: failed\n{done.stderr[-2000:]}")
            return None
        found.append(json.loads(lines[-1]))
    return found


def report_capture_first(names: list[str]) -> None:
    """Capture-first sizing against the capture alone, each in a fresh process, interleaved."""
    mib, rows = 2**20, []
    for name in names:
        found = _each(name, [["--capture-alone"], ["--capture-first"]])
        if found:
            rows.append({**found[0], **found[1]})
            print(rows[-1], flush=True)
    print(f"\n{'configuration':48} {'keys':>4} {'alone s':>7} {'reserve s':>9} {'capture s':>9} {'back s':>6} {'start-up':>8} "
          f"{'KV cache':>9} {'left':>7}")
    for r in rows:
        startup = (r["reserve_s"] + r["capture_s"] + r["back_s"]) / r["capture_alone_s"]
        print(f"{r['name']:48} {r['keys']:4d} {r['capture_alone_s']:7.2f} {r['reserve_s']:9.3f} {r['capture_s']:9.2f} "
              f"{r['back_s']:6.3f} {startup:7.2f}x {r['kv_bytes'] / 2**30:7.2f}Gi {r['left'] / mib:5.0f}Mi")
    print("alone s: the capture with nothing before it; reserve, capture, back: the capture-first start-up's parts (a fresh "
          "process); start-up: their sum / alone s; KV cache: what back_free() backed after the capture; left: the device's "
          "free memory after it (target: within 64 MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", default=None, choices=sorted(CONFIGS))
    parser.add_argument("--only", default=None, help="names separated by ';' (default: all)")
    parser.add_argument("--sample", action="store_true", help="estimate_memory(sample=True): a sample of the whole-graph keys captured")
    parser.add_argument("--capture-alone", action="store_true", help="with --one: time the capture alone")
    parser.add_argument("--capture-first", action="store_true",
                        help="no estimate: capture, then back a reserved KV cache with what is left (ReservedMemory)")
    args = parser.parse_args()
    if args.one:
        result = (capture_alone(args.one) if args.capture_alone else capture_first(args.one) if args.capture_first
                  else one(args.one, args.sample))
        print(json.dumps(result))
        return
    names = args.only.split(";") if args.only else list(CONFIGS)
    if args.capture_first:
        report_capture_first(names)
        return
    rows = []
    for name in names:
        found = _each(name, [["--sample"] if args.sample else [], ["--capture-alone"]])
        if found:
            rows.append({**found[0], **found[1]})
            print(rows[-1], flush=True)
    mib = 2**20
    print(f"\n{'configuration':38} {'keys':>4} {'probes':>6} {'predicted':>10} {'taken':>9} {'error':>7} {'within':>6} "
          f"{'2nd':>8} {'2nd err':>7} {'left':>6} {'cold':>6} {'pool':>8} {'warm-up':>8} {'per key':>8} {'est s':>6} {'capt s':>6} {'pred s':>6} "
          f"{'alone s':>7} {'start-up':>8}")
    for r in rows:
        err = r["predicted"] - r["taken"]
        ok = abs(err) <= max(0.05 * r["taken"], 32 * mib)
        err2 = r["second_predicted"] - r["taken"]
        print(f"{r['name']:38} {r['keys']:4d} {r['probes']:6d} {r['predicted'] / mib:8.0f}Mi {r['taken'] / mib:7.0f}Mi "
              f"{err / max(1, r['taken']) * 100:6.1f}% {'yes' if ok else 'NO':>6} {r['second_predicted'] / mib:6.0f}Mi "
              f"{err2 / max(1, r['taken']) * 100:6.1f}% {r['left_behind'] / mib:5.0f}Mi {r['left_cold'] / mib:5.0f}Mi "
              f"{r['pool'] / mib:6.0f}Mi {r['warmup'] / mib:6.0f}Mi {r['per_key'] / mib:6.0f}Mi {r['estimate_s']:6.2f} "
              f"{r['capture_s']:6.2f} {r['predicted_capture_s']:6.2f} {r['capture_alone_s']:7.2f} "
              f"{(r['estimate_s'] + r['capture_s']) / r['capture_alone_s']:7.2f}x")
    print("predicted: the process's first estimate (an engine's); taken: what capture(plan) took right after it; 2nd: an estimate "
          "after the plan was captured and cleared; left: what that one left on the device; cold: what the first left; alone s: the "
          "capture with no estimate before it (a fresh process); start-up: (est s + capt s) / alone s")


if __name__ == "__main__":
    main()
