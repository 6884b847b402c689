"""A Llama-3.2-1B-shaped Hugging Face model on the GPU: per-step latency and trace tokens/s, one process.

Per decode step (batch 1, 8, 32; no padding, so every path does the same work): eager, the
registry's ``full`` entry, a hand-written ``torch.cuda.CUDAGraph`` of the same step (static
copies in, replay), and ``breakable``.  Then the engine of examples/hf_llama.py serves the
same bundled-trace requests eagerly and through the registry (decode ``full``, mixed batches
``breakable`` or ``piecewise``), and reports end-to-end tokens/s, with every logit checked
against Hugging Face's own forward.

    PYTHONPATH=. python3 benchmarks/gpu_hf_llama.py [--requests 48]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

import cgregistry as cg

sys.path.insert(0, str(Path(__file__).parent))
from timing import per_call_us, static_graph  # noqa: E402

_spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
hf = importlib.util.module_from_spec(_spec)
sys.modules["hf_llama"] = hf
_spec.loader.exec_module(hf)

SHAPE = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)


def decode_inputs(n: int, context: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A decode batch of ``n`` requests, each at position ``context`` with its own blocks."""
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


def trace_replay(device: torch.device, requests: int) -> list[tuple]:
    rows = []
    for mode in ("none", "full_and_breakable", "full_and_piecewise"):
        started = time.perf_counter()
        model = hf.build_model("llama-3.2-1b", device, SHAPE)
        reg = hf.build_registry(model, SHAPE, mode)
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
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3.2-1B shape (16 x 2048, 32 heads, 8 KV heads, "
          f"vocab 32000), bf16; KV cache {SHAPE.num_blocks} blocks of {SHAPE.block_size}")
    model = hf.build_model("llama-3.2-1b", device, SHAPE)
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


if __name__ == "__main__":
    main()
