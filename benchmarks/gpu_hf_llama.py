"""A Llama-3.2-1B-shaped Hugging Face model on the GPU: per-step latency and trace tokens/s, one process.

Per decode step (batch 1, 8, 32; no padding, so every path does the same work): eager, the
registry's ``full`` entry, a hand-written ``torch.cuda.CUDAGraph`` of the same step (static
copies in, replay), and ``breakable``.  Then the engine of examples/hf_llama.py serves the
same bundled-trace requests eagerly and through the registry (decode ``full``, mixed batches
``breakable`` or ``piecewise``), and reports end-to-end tokens/s, with every logit checked
against Hugging Face's own forward.

``--inductor`` instead: the step (decoder and LM head) compiled once by Inductor, in pieces around the attention op, and
``full`` keys over those pieces (attention inline) at decode batch 1, 8 and 32, against
``torch.compile(mode="reduce-overhead")`` of the same step at batch 1 and the time to read the weights
once at the card's memory bandwidth; then the engine serves the trace with ``full_and_piecewise`` over
the same compile, every logit checked against Hugging Face's forward.  ``--fused`` adds, in the same process, the
engine's faster step: q/k/v and gate/up projections fused (``fuse_projections``) and the attention's Triton kernels
(``KERNELS``), measured the same way after the HF-module step, with its logits also held against that step's; the
trace is then served with it.

    PYTHONPATH=. python3 benchmarks/gpu_hf_llama.py [--requests 48] [--inductor [--fused]]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from pathlib import Path

import torch

import cgregistry as cg
from cgregistry.inspection import CapturePhases

sys.path.insert(0, str(Path(__file__).parent))
from timing import per_call_us, per_step_on_gpu, static_graph  # noqa: E402

_spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
hf = importlib.util.module_from_spec(_spec)
sys.modules["hf_llama"] = hf
_spec.loader.exec_module(hf)

SHAPE = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)


def decode_inputs(n: int, context: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A decode batch of ``n`` requests, each at position ``context`` with its own blocks (the same tokens each call)."""
    torch.manual_seed(n)
    blocks = SHAPE.max_blocks_per_req
    table = 1 + torch.arange(n * blocks, device=device).view(n, blocks) % (SHAPE.num_blocks - 1)  # block 0: the scratch block
    pos = torch.full((n,), context, device=device)
    return {
        "input_ids": torch.randint(0, 32000, (n,), device=device), "positions": pos,
        "slot_mapping": table[:, context // SHAPE.block_size] * SHAPE.block_size + context % SHAPE.block_size,
        "query_start_loc": torch.arange(n + 1, device=device), "seq_lens": pos + 1, "block_table": table,
        "logits_indices": torch.arange(n, device=device),
    }


def step_latency(model: torch.nn.Module, device: torch.device, sizes: list[int], iters: int) -> list[tuple]:
    step = hf.make_step(model, hf.decoder(model))
    regs = {}
    for mode in ("full", "breakable"):
        reg = cg.GraphRegistry(step, hf.static_inputs(SHAPE), output_axis=hf.OUTPUT_AXES, name=mode)
        with torch.inference_mode():
            reg.capture([(cg.BatchDescriptor.decode(n) if mode == "full" else cg.BatchDescriptor(n), mode) for n in sizes])
        regs[mode] = reg
    rows = []
    for n in sizes:
        batch = cg.BatchDescriptor.decode(n)
        inputs = decode_inputs(n, 500, device)
        with torch.inference_mode():
            def eager() -> object:
                with cg.eager_batch(batch):
                    return step(batch, **inputs)
            hand = static_graph(step, batch, inputs, torch.cuda.CUDAGraph(), torch.cuda.graph)
            t_eager = per_call_us(eager, iters)
            t_full = per_call_us(lambda: regs["full"].run(batch, **inputs), iters)
            t_hand = per_call_us(hand, iters)
            t_break = per_call_us(lambda: regs["breakable"].run(batch, **inputs), iters)
            want = eager()["logits"].float()
            diff = (regs["full"].run(batch, **inputs)["logits"].float() - want).abs().max().item()
        assert regs["full"].match(batch).strategy == "full" and regs["breakable"].match(batch).strategy == "breakable"
        rows.append((n, t_eager, t_full, t_hand, t_break, diff))
    return rows


HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # the cards' published memory bandwidth (SXM)


def inductor_latency(model: torch.nn.Module, device: torch.device, sizes: list[int], iters: int,
                     baseline: dict[int, torch.Tensor]) -> list[tuple]:
    """Decode steps: ``full`` keys over the one Inductor compile against reduce-overhead of the same step (batch 1
    only: each batch size is a compile of its own there).  Rows: batch, eager, full over Inductor, reduce-overhead
    (None past batch 1), both errors against eager, the full step's error against ``baseline``'s logits (filled with
    this eager step's where empty), the registry's start-up and reduce-overhead's."""
    eager_step = hf.make_step(model, hf.decoder(model))
    forward = hf.decoder(model)

    def decode_and_head(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                        logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole step, as reduce-overhead compiles it: the decoder and the LM head in one trace."""
        hidden = forward(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table)
        return hidden, model.lm_head(hidden[logits_indices])

    names = list(hf.static_inputs(SHAPE))  # decode_and_head's arguments, in order

    def step(batch: cg.BatchDescriptor, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        hf.check_fused(model)  # as the example's step: a fused weight its projections no longer reach is refused
        hidden, logits = compiled(*(inputs[name] for name in names))
        return {"hidden": hidden, "logits": logits}

    reg = cg.GraphRegistry(step, hf.static_inputs(SHAPE), output_axis=hf.OUTPUT_AXES, name="full-inductor")
    compiled = reg.compile(decode_and_head, inductor=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        reg.capture([(cg.BatchDescriptor.decode(n), "full") for n in sorted(sizes, reverse=True)])  # a plan's order
    torch.cuda.synchronize()
    reg_startup = time.perf_counter() - started
    report = compiled.compiler.traces
    print(f"full over Inductor: {len(report)} trace(s), " + "; ".join(f"{r.pieces} pieces, {r.compiles} Inductor compiles" for r in report)
          + f"; capture {reg_startup:.1f} s, phases {CapturePhases.of(reg.entries()).summary()}", flush=True)
    rows = []
    for n in sizes:
        batch = cg.BatchDescriptor.decode(n)
        inputs = decode_inputs(n, 500, device)
        with torch.inference_mode():
            want = eager_step(batch, **inputs)["logits"].float()
            baseline.setdefault(n, want)
            t_eager = per_call_us(lambda: eager_step(batch, **inputs), max(iters // 5, 5))
            t_reg = per_call_us(lambda: reg.run(batch, **inputs), iters)
            got = reg.run(batch, **inputs)["logits"].float()
            err_reg, err_base = (got - want).abs().max().item(), (got - baseline[n]).abs().max().item()
            if n == 1:
                gpu_us, kernels, _ = per_step_on_gpu(lambda: reg.run(batch, **inputs), top=12)
                print(f"  batch 1 full over Inductor: {gpu_us:.1f} GPU us, {kernels:.0f} kernels a step (the top 12 above)")
            t_ro = err_ro = ro_startup = None
            if n == 1:
                def plain(**i: torch.Tensor) -> dict[str, torch.Tensor]:
                    return eager_step(batch, **i)

                ro = torch.compile(plain, mode="reduce-overhead", fullgraph=True, dynamic=False)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(3):  # compile, warm-up, record
                    ro(**inputs)
                torch.cuda.synchronize()
                ro_startup = time.perf_counter() - started
                t_ro = per_call_us(lambda: ro(**inputs), iters)
                err_ro = (ro(**inputs)["logits"].float() - want).abs().max().item()
                ro_gpu, ro_kernels, _ = per_step_on_gpu(lambda: ro(**inputs))
                copies = itertools.cycle([inputs, {name: t.clone() for name, t in inputs.items()}])
                t_ro_moved = per_call_us(lambda: ro(**next(copies)), iters)
                t_reg_moved = per_call_us(lambda: reg.run(batch, **next(copies)), iters)
                print(f"  batch 1 reduce-overhead: {ro_gpu:.1f} GPU us, {ro_kernels:.0f} kernels a step; with the inputs "
                      f"alternating between two copies (new tensors each step, as an engine's): full {t_reg_moved:.1f} us, "
                      f"reduce-overhead {t_ro_moved:.1f} us")
        assert reg.match(batch).strategy == "full"
        rows.append((n, t_eager, t_reg, t_ro, err_reg, err_ro, err_base, reg_startup, ro_startup))
    return rows


def trace_replay(device: torch.device, requests: int, modes: tuple[str, ...] = ("none", "full_and_breakable", "full_and_piecewise"),
                 inductor: bool = False, fuse: bool = False) -> list[tuple]:
    rows = []
    for mode in modes:
        started = time.perf_counter()
        model = hf.build_model("llama-3.2-1b", device, SHAPE)
        if fuse:
            hf.fuse_projections(model)
        reg = hf.build_registry(model, SHAPE, mode, inductor=inductor and mode != "none")
        setup = time.perf_counter() - started
        engine = hf.Engine(model, SHAPE, reg, keep_logits=True)
        reqs = hf.trace_requests(requests, SHAPE, model.config.vocab_size, max_prompt=768, max_new=128)
        result = engine.serve(reqs)
        error = hf.check_against_hf(model, result.finished)
        stats = reg.stats() if reg is not None else None
        rows.append((mode, result.steps, result.tokens, result.seconds, setup, len(reg) if reg else 0,
                     stats.hits if stats else 0, stats.misses if stats else result.steps, error))
        del model, reg, engine
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--inductor", action="store_true", help="full over one Inductor compile against reduce-overhead")
    parser.add_argument("--fused", action="store_true", help="with --inductor: also the fused projections and Triton attention")
    args = parser.parse_args()
    if args.fused and not args.inductor:
        parser.error("argument --fused: measured with --inductor")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3.2-1B shape (16 x 2048, 32 heads, 8 KV heads, "
          f"vocab 32000), bf16; KV cache {SHAPE.num_blocks} blocks of {SHAPE.block_size}")
    model = hf.build_model("llama-3.2-1b", device, SHAPE)
    if args.inductor:
        inductor_main(model, device, args)
        return
    lat = step_latency(model, device, [1, 8, 32], args.iters)
    del model
    torch.cuda.empty_cache()
    trace = trace_replay(device, args.requests)
    print("\nper decode step (median wall time per step, us; context 500)")
    print(f"{'batch':>5} {'eager':>9} {'full':>9} {'hand graph':>10} {'breakable':>9} {'full/hand':>9} {'eager/full':>10} {'|full-eager|':>12}")
    for n, e, f, h, b, d in lat:
        print(f"{n:5d} {e:9.1f} {f:9.1f} {h:10.1f} {b:9.1f} {f / h:9.3f} {e / f:10.2f} {d:12.2e}")
    print(f"\ntrace replay: {args.requests} bundled-trace requests (prompts folded to <= 768 tokens, outputs <= 128)")
    print(f"{'mode':19} {'steps':>5} {'tokens':>6} {'seconds':>8} {'tokens/s':>9} {'vs eager':>8} {'setup s':>8} {'graphs':>6} {'hits':>5} {'misses':>6} {'max|logit-HF|':>13}")
    base = trace[0][2] / trace[0][3]
    for mode, steps, tokens, secs, setup, graphs, hits, misses, err in trace:
        print(f"{mode:19} {steps:5d} {tokens:6d} {secs:8.2f} {tokens / secs:9.1f} {tokens / secs / base:8.2f} {setup:8.1f} {graphs:6d} {hits:5d} {misses:6d} {err:13.3e}")


def inductor_main(model: torch.nn.Module, device: torch.device, args: argparse.Namespace) -> None:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    weight_bytes = sum(storages.values())
    card = next((name for name in HBM_BYTES_PER_S if name in torch.cuda.get_device_name()), None)
    read_us = weight_bytes / HBM_BYTES_PER_S[card] * 1e6 if card else float("nan")
    print(f"weights {weight_bytes / 1e9:.2f} GB: read once in {read_us:.0f} us at {card}'s bandwidth")
    baseline: dict[int, torch.Tensor] = {}
    variants = [("HF modules, gather + SDPA attention", False)] + ([("fused projections, Triton attention", True)] if args.fused else [])
    for label, fast in variants:
        hf.KERNELS = fast
        if fast:
            hf.fuse_projections(model)
        print(f"\n{label}")
        rows = inductor_latency(model, device, [1, 8, 32], args.iters, baseline)
        print(f"{'batch':>5} {'eager us':>9} {'full/Inductor us':>16} {'reduce-overhead us':>18} {'full/ro':>7} {'full/read':>9} "
              f"{'|full-eager|':>12} {'|ro-eager|':>10} {'|full-HF step|':>14}")
        for n, e, f, ro, ef, er, eb, _, _ in rows:
            ro_text = f"{ro:18.1f} {f / ro:7.3f}" if ro else f"{'-':>18} {'-':>7}"
            print(f"{n:5d} {e:9.1f} {f:16.1f} {ro_text} {f / read_us:9.2f} {ef:12.2e} {er if er is not None else float('nan'):10.2e} {eb:14.2e}")
        print(f"start-up: registry (trace, compile, 3 full keys) {rows[0][7]:.1f} s; reduce-overhead at batch 1 alone {rows[0][8]:.1f} s")
    del model
    torch.cuda.empty_cache()
    trace = trace_replay(device, args.requests, ("none", "full_and_piecewise"), inductor=True, fuse=args.fused)
    print(f"\ntrace replay, Inductor pieces{', fused projections and Triton attention' if args.fused else ''}: {args.requests} bundled-trace requests")
    base = trace[0][2] / trace[0][3]
    for mode, steps, tokens, secs, setup, graphs, hits, misses, err in trace:
        print(f"{mode:19} {steps:5d} steps {tokens:6d} tokens {tokens / secs:9.1f} tok/s {tokens / secs / base:6.2f}x eager, "
              f"setup {setup:6.1f} s, {graphs} graphs, {hits} hits, {misses} misses, max|logit-HF| {err:.3e}")


if __name__ == "__main__":
    main()
