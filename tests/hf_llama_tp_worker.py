"""One rank of the TP=2 Hugging Face Llama test (tests/distributed/test_hf_llama_tp.py): gloo, the cpu emulator, the tiny config.

Each rank serves the same trace requests at TP=1 (the full model, no process group) and then at TP=2 in every mode,
and checks: the same tokens as TP=1, every logit within 1e-5 of TP=1's (float32; the all-reduce sums two partial
products where TP=1 sums one matmul, so only the rounding differs), within 1e-5 of HF's forward of the full model,
bit-identical logits on both ranks, the same graphs replayed the same number of times on both ranks; and that the
registry refuses background capture and adaptation with two ranks.  Any failure raises, which fails the parent.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cgregistry as cg

ROOT = Path(__file__).parent.parent
TOLERANCE = 1e-5  # float32 logits of magnitude ~1: observed differences are ~1e-7


def load_example() -> object:
    spec = importlib.util.spec_from_file_location("hf_llama_example", ROOT / "examples" / "hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_llama_example"] = module
    spec.loader.exec_module(module)
    return module


def logits_by_position(result: object) -> dict[tuple[int, int], torch.Tensor]:
    return {(seq.rid, pos): logits for seq in result.finished for pos, logits in seq.logits.items()}


def main(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    hf = load_example()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    shape = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
    options = dict(device=cpu, shape=shape, requests=6, max_prompt=12, max_new=4, backend="cpu")
    try:
        tp1, _ = hf.serve("tiny", "full_and_breakable", **options)  # no group: the full model on this rank
        want = logits_by_position(tp1)
        tokens = {seq.rid: seq.tokens for seq in tp1.finished}
        for mode in ("full_and_breakable", "full_and_piecewise", "full", "breakable", "none"):
            result, reg = hf.serve("tiny", mode, group=dist.group.WORLD, **options)
            got = logits_by_position(result)
            assert {seq.rid: seq.tokens for seq in result.finished} == tokens, f"{mode}: TP=2 sampled other tokens than TP=1"
            assert got.keys() == want.keys()
            diff = max((got[k] - want[k]).abs().max().item() for k in want)
            assert diff <= TOLERANCE, f"{mode}: TP=2 logits differ from TP=1 by {diff:.3g}"
            assert result.max_abs_error <= TOLERANCE, f"{mode}: TP=2 logits differ from HF's full forward by {result.max_abs_error:.3g}"
            stacked = torch.stack([got[k] for k in sorted(got)])
            gathered = [torch.empty_like(stacked) for _ in range(world)]
            dist.all_gather(gathered, stacked)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"{mode}: ranks' logits differ"
            if reg is not None:
                stats = reg.stats()
                assert stats.hits == result.steps and stats.misses == 0, (mode, stats)
                replays = sorted((str(e.key), e.strategy, e.replays) for e in reg.entries())
                seen: list[object] = [None] * world
                dist.all_gather_object(seen, replays)
                assert all(s == seen[0] for s in seen), f"{mode}: ranks replayed different graphs: {seen}"
            if rank == 0:
                print(f"TP=2 {mode}: max |logit - TP=1| {diff:.2e}, max |logit - HF full| {result.max_abs_error:.2e}", flush=True)

        # Refused with two ranks: the registry's own errors.
        model = hf.shard_model(hf.build_model("tiny", cpu, shape), rank, world)
        with pytest.raises(RuntimeError, match=r"^capture\(background=True\) with torch.distributed initialized \(world size 2\): "
                                               r"pending keys are captured in pieces between steps at times each rank decides alone") as background:
            hf.build_registry(model, shape, "full_and_breakable", "cpu", background=True)
        adapt = cg.Adaptation(max_graphs=16, settings=dict(max_num_seqs=4, max_num_tokens=16, mode="full_and_breakable"))
        with pytest.raises(RuntimeError, match=r"^GraphRegistry\(adapt=...\) with torch.distributed initialized \(world size 2\).*"
                                               r"and without adaptation \(each rank would refit to its own traffic\)$") as adapting:
            hf.build_registry(model, shape, "full_and_breakable", "cpu", adapt=adapt)
        if rank == 0:
            print(f"refused: {background.value}\nrefused: {adapting.value}", flush=True)
        dist.barrier()
    finally:
        result = reg = model = background = adapting = None  # this frame's references: the group goes before exit
        hf.release_process_group()
