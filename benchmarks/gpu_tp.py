"""Tensor parallel decode on several GPUs: the Hugging Face Llama engine of examples/hf_llama.py at TP=1/2/4.

Run under torchrun, one process a GPU (NCCL).  Every rank builds the same random-weight model (Llama-3.2-1B's
shape, bf16) with a random KV cache, computes the TP=1 logits of each decode batch, then for each TP size the
first TP ranks shard it (``shard_model``: heads and MLP columns split, one all-reduce after ``o_proj`` and one
after ``down_proj``) and measure, per decode step at each batch size:

- ``eager``: the step run eagerly (its all-reduces eager NCCL calls);
- ``full``: the registry's ``full`` graph, all-reduces inside, served with ``run(..., group=tp_group)``;
- ``breakable``: the registry's ``breakable`` entry (graph segments holding the all-reduces, the attention eager
  between them), served the same way;

and report the step latency (the median of repeats, the slowest rank's), tokens/s per GPU (batch / latency /
TP; one token a request a decode step), and the largest |logit - TP=1| of the step over every logit of every
rank.  TP > 1 rows are served with ``run(..., group=agreement)``, a ``HostAgreement(tp_group, same_batch=True)``.
TP=1 rows are the unsharded model on rank 0 (no collectives, no agreement).

What agreement costs, for each TP > 1 and batch size: ``full`` steps back to back (the device drained only before and
after the loop) with no agreement, with the host agreement (its shared-memory page), and with ``group=tp_group`` (the
all-reduce on NCCL and the host read of its result); and each agreement alone, with the host agreement's fallback
beside them (``transport="group"``: one all-reduce on a gloo group of the same ranks, on the CPU).  On CUDA every rank then serves steps through the host
agreement under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronizing call: none is made.

Then the no-hang check, for each TP > 1: a ``full_and_breakable`` registry over the engine's whole capture plan
serves ``--random-batches`` random batches (decode-only and mixed, 1..max_num_seqs requests, random contexts and
block tables), the same on every rank (one seed), through ``run(..., group=...)``, and reports what the host
agreement took a batch.  A watchdog on every rank kills
its process, and so torchrun the job, when a batch makes no progress for ``--timeout`` seconds ("HANG" on stderr).  At the end the ranks must have
replayed the same graphs the same number of times, and their logits' checksums must agree.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_tp.py            # TP=1 and 2 on 2 GPUs
    torchrun --standalone --nproc-per-node 4 benchmarks/gpu_tp.py            # TP=1, 2 and 4 on 4 GPUs
    torchrun --standalone --nproc-per-node 4 benchmarks/gpu_tp.py --config llama-3.1-8b --random-batches 0 --batches 1 8 32 64
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_tp.py --smoke    # CPU: gloo, the cpu emulator, the tiny config

``--smoke`` is ``--config tiny --device cpu --batches 1 4 8 --random-batches 200 --iters 3 --repeats 3`` with a
float32 tolerance: it checks that the script runs end to end (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import os
import signal
import statistics
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement, agree

_spec = importlib.util.spec_from_file_location("hf_llama", Path(__file__).parent.parent / "examples" / "hf_llama.py")
hf = importlib.util.module_from_spec(_spec)
sys.modules["hf_llama"] = hf
_spec.loader.exec_module(hf)

GPU_SHAPE = hf.EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
# bf16: a sharded or padded GEMM rounds differently, and the deeper, wider 8B drifts further.  On 4 H200s the 8B's TP=1
# eager and full steps already differ from the TP=1 reference by 0.23 at batch 64; TP=2 and 4 came within 0.40.
BF16_TOLERANCE = {"llama-3.2-1b": 0.25, "llama-3.1-8b": 0.5}
SMOKE = dict(config="tiny", device="cpu", batches=[1, 4, 8], random_batches=200, iters=3, repeats=3)


# --------------------------------------------------------------------------- setup


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU smoke mode: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--config", choices=sorted(hf.CONFIGS), default="llama-3.2-1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tp", type=int, nargs="+", help="TP sizes (default: 1 and each of 2, 4, 8 up to the world size)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes (default: 1 8 32)")
    parser.add_argument("--iters", type=int, default=50, help="steps per timing repeat (default: 50)")
    parser.add_argument("--repeats", type=int, default=7, help="timing repeats, the median kept (default: 7)")
    parser.add_argument("--random-batches", type=int, default=10_000, help="batches of the no-hang check (default: 10000; 0: no check)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds without progress that count as a hang (default: 120)")
    parser.add_argument("--tolerance", type=float, help="largest |logit - TP=1| allowed (default: 1e-4 in float32; in bf16 "
                        + ", ".join(f"{v:g} for {k}" for k, v in BF16_TOLERANCE.items()) + ")")
    parser.add_argument("--tp1-group", action="store_true",
                        help="also TP=1 through the sharded path on a one-rank group (rows '1g'): all-reduces of one rank "
                             "inside the graphs, run(..., group=...), the no-hang check; what one GPU can check of the TP path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if "WORLD_SIZE" not in os.environ:
        parser.error("run it under torchrun, one process a GPU: torchrun --standalone --nproc-per-node 2 benchmarks/gpu_tp.py")
    world = int(os.environ["WORLD_SIZE"])
    args.tp = sorted(set(args.tp or [1, *(k for k in (2, 4, 8) if k <= world)]))
    if args.tp[-1] > world:
        parser.error(f"--tp {args.tp[-1]} needs {args.tp[-1]} processes; this job has {world}")
    for tp in args.tp:
        try:
            hf.TensorParallelShard.of(hf.CONFIGS[args.config], 0, tp)
        except ValueError as exc:
            parser.error(f"--tp: {exc} ({args.config})")
    if args.tolerance is None:
        args.tolerance = 1e-4 if hf.CONFIGS[args.config]["dtype"] == torch.float32 else BF16_TOLERANCE[args.config]
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_reduce(value: float, group: Any, device: torch.device, op: Any = dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def per_step_us(fn: Callable[[], object], device: torch.device, group: Any, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the wall time per call (device drained before and after, ranks started together);
    with a group, the slowest rank's median."""
    for _ in range(max(iters // 10, 3)):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / iters * 1e6)
    median = statistics.median(samples)
    return median if group is None else group_reduce(median, group, device)


def fill_cache(model: torch.nn.Module, seed: int) -> None:
    """Random K/V in every slot (the same on every rank): attention reads a real context, and TP shards must read
    the right heads of it."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in model.model.layers:
        for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=g, device=device, dtype=torch.float32))


def decode_batch(n: int, shape: Any, vocab: int, device: torch.device, seed: int) -> tuple[dict[str, torch.Tensor], Any]:
    """``n`` requests decoding one token each, each at its own random context, with its own blocks.

    The new tokens' K/V go to the scratch slot, not to their positions: every step of every batch size then reads
    the same cache (the random one, their own position's K/V included), so any run of it gives the same logits as
    the TP=1 reference, whatever ran before.  The work is a real decode step's."""
    g = torch.Generator().manual_seed(seed)
    bpr = shape.max_blocks_per_req
    table = 1 + torch.arange(n * bpr).view(n, bpr) % (shape.num_blocks - 1)  # block 0 is the scratch block
    lens = torch.randint(1, shape.max_context + 1, (n,), generator=g)
    pos = lens - 1
    inputs = {
        "input_ids": torch.randint(0, vocab, (n,), generator=g), "positions": pos, "slot_mapping": torch.full((n,), shape.scratch_slot),
        "query_start_loc": torch.arange(n + 1), "seq_lens": lens, "block_table": table, "logits_indices": torch.arange(n),
    }
    host = hf.HostBatch(list(range(n)), [1] * n, lens.tolist())
    return {k: v.to(device) for k, v in inputs.items()}, host


def random_batch(shape: Any, vocab: int, g: torch.Generator) -> tuple[B, dict[str, torch.Tensor], Any]:
    """A random batch the engine could schedule: decode-only (uniform) or mixed (prefill chunks beside decodes)."""
    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    reqs = draw(1, shape.max_num_seqs)
    mixed = draw(0, 9) < 4
    budget, qlens = shape.max_num_tokens, []
    for _ in range(reqs):
        if budget == 0:
            break
        n = 1 if not mixed or draw(0, 1) else draw(1, min(budget, shape.max_context))
        qlens.append(n)
        budget -= n
    bpr, block = shape.max_blocks_per_req, shape.block_size
    perm = 1 + torch.randperm(shape.num_blocks - 1, generator=g)  # block 0 is the scratch block
    ids, pos, slots, starts, lens, table = [], [], [], [0], [], []
    for r, n in enumerate(qlens):
        length = draw(n, shape.max_context)
        blocks = perm[r * bpr : (r + 1) * bpr].tolist()
        p = list(range(length - n, length))
        ids += torch.randint(0, vocab, (n,), generator=g).tolist()
        pos += p
        slots += [blocks[i // block] * block + i % block for i in p]
        starts.append(starts[-1] + n)
        lens.append(length)
        table.append(blocks)
    inputs = {
        "input_ids": ids, "positions": pos, "slot_mapping": slots, "query_start_loc": starts, "seq_lens": lens,
        "block_table": table, "logits_indices": [s - 1 for s in starts[1:]],
    }
    actual = B(len(ids), len(qlens), uniform=all(n == 1 for n in qlens))
    return actual, {k: torch.tensor(v, dtype=torch.long) for k, v in inputs.items()}, hf.HostBatch(starts[:-1], qlens, lens)


def note(what: str) -> None:
    """A progress line on rank 0's stderr, so that a run cut short still shows what it measured."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[gpu_tp] {what}", file=sys.stderr, flush=True)


class Watchdog:
    """Kills its process (SIGKILL) when ``beat()`` has not been called for ``timeout`` seconds while armed."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.last, self.where, self.armed = time.monotonic(), "", False
        threading.Thread(target=self.watch, daemon=True, name="gpu_tp-watchdog").start()

    def arm(self, where: str) -> None:
        self.beat(where)
        self.armed = True

    def beat(self, where: str) -> None:
        self.last, self.where = time.monotonic(), where

    def disarm(self) -> None:
        self.armed = False

    def watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self.armed and time.monotonic() - self.last > self.timeout:
                print(f"rank {self.rank}: HANG: no progress for {self.timeout:g} s at {self.where}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # the main thread is stuck in a collective: end the process, and torchrun the job


# --------------------------------------------------------------------------- the measurements


def latency_rows(label: str, tp: int, model: torch.nn.Module, group: Any, args: argparse.Namespace, shape: Any,
                 device: torch.device, batches: dict[int, tuple], reference: dict[int, torch.Tensor]) -> list[tuple]:
    """Per batch size: (TP label, strategy, batch, us, tokens/s per GPU, max |logit - TP=1|) for eager, full, breakable."""
    step = hf.make_step(model, hf.decoder(model))
    backend = "cuda" if device.type == "cuda" else "cpu"
    regs = {}
    for strategy in ("full", "breakable"):
        reg = cg.GraphRegistry(step, hf.static_inputs(shape), backend=backend, output_axis=hf.OUTPUT_AXES, name=f"tp{label}-{strategy}")
        keys = [(B.decode(n) if strategy == "full" else B(n), strategy) for n in args.batches]
        with torch.inference_mode():
            reg.capture(keys)  # every rank of the group, the same keys in the same order
        regs[strategy] = reg
    served = {"group": HostAgreement(group, same_batch=True)} if group is not None else {}
    rows = []
    for n in args.batches:
        batch = B.decode(n)
        inputs, host = batches[n]
        assert regs["full"].match(batch).strategy == "full" and regs["breakable"].match(batch).strategy == "breakable"

        def eager() -> dict[str, torch.Tensor]:
            with cg.eager_batch(batch, host):
                return step(batch, **inputs)

        calls = {
            "eager": lambda: eager()["logits"],
            "full": lambda: regs["full"].run(batch, context=host, **served, **inputs)["logits"],
            "breakable": lambda: regs["breakable"].run(batch, context=host, **served, **inputs)["logits"],
        }
        with torch.inference_mode():
            for strategy, call in calls.items():
                diff = (call().float().cpu() - reference[n]).abs().max().item()
                if group is not None:
                    diff = group_reduce(diff, group, device)
                us = per_step_us(call, device, group, args.iters, args.repeats)
                rows.append((label, strategy, n, us, n / (us * 1e-6) / tp, diff))
                note(f"TP={label} {strategy} batch {n}: {us:.1f} us a step, max|logit-TP1| {diff:.3e}")
    return rows


class TimedAgreement(HostAgreement):
    """A ``HostAgreement`` that sums the wall time of its ``agree()`` calls (what the no-hang check reports)."""

    seconds, calls = 0.0, 0

    def agree(self, actual: B) -> B:
        start = time.perf_counter()
        try:
            return super().agree(actual)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def agreement_rows(label: str, model: torch.nn.Module, group: Any, gloo: Any, args: argparse.Namespace, shape: Any,
                   device: torch.device, batches: dict[int, tuple]) -> list[tuple]:
    """Per batch size: (TP label, batch, full us with no agreement, with the host agreement, with the group's
    all-reduce (NCCL on GPUs), host agree() alone us, all-reduce agree() alone us, the host agreement's gloo fallback
    agree() alone us).  ``gloo``: a gloo group of the same ranks."""
    step = hf.make_step(model, hf.decoder(model))
    backend = "cuda" if device.type == "cuda" else "cpu"
    reg = cg.GraphRegistry(step, hf.static_inputs(shape), backend=backend, output_axis=hf.OUTPUT_AXES, name=f"agree{label}")
    with torch.inference_mode():
        reg.capture([(B.decode(n), "full") for n in args.batches])
    host = HostAgreement(group, same_batch=True)
    fallback = HostAgreement(gloo, same_batch=True, transport="group")
    backend = dist.get_backend(group).upper()
    note(f"TP={label}: the host agreement meets in {host.transport!r}" + (f" ({host.shm_refused})" if host.shm_refused else ""))
    rows = []
    with torch.inference_mode():
        for n in args.batches:
            batch = B.decode(n)
            inputs, context = batches[n]
            ways = {"none": {}, "host": {"group": host}, "group": {"group": group}}
            us = {way: per_step_us(lambda served=served: reg.run(batch, context=context, **served, **inputs), device, group,
                                   args.iters, args.repeats) for way, served in ways.items()}
            alone = [per_step_us(lambda g=g: agree(batch, g), device, group, args.iters, args.repeats)
                     for g in (host, group, fallback)]
            rows.append((label, n, us["none"], us["host"], us["group"], *alone))
            note(f"TP={label} batch {n}: full {us['none']:.1f} us, with host agreement {us['host']:.1f}, with the "
                 f"{backend} all-reduce {us['group']:.1f}; agree() alone: host {alone[0]:.1f} us, {backend} {alone[1]:.1f} "
                 f"us, the host agreement over gloo {alone[2]:.1f} us")
        if device.type == "cuda":
            sync(device)
            torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises from here on
            try:
                for n in args.batches:
                    inputs, context = batches[n]
                    for _ in range(20):
                        reg.run(B.decode(n), context=context, group=host, **inputs)
                served = "no synchronizing call"
            except RuntimeError as exc:
                served = f"RAISED {str(exc).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sync(device)
            try:  # the check does see a sync: the NCCL agreement's read-back
                torch.cuda.set_sync_debug_mode("error")
                agree(B.decode(1), group)
                seen = "no error raised"
            except RuntimeError as exc:
                seen = str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            note(f"TP={label}: {20 * len(args.batches)} steps served through the host agreement under "
                 f"set_sync_debug_mode('error'): {served}; the NCCL agreement under it: {seen}")
    return rows


def no_hang(label: str, tp: int, model: torch.nn.Module, group: Any, args: argparse.Namespace, shape: Any, device: torch.device,
            rank: int, watchdog: Watchdog) -> str:
    """``--random-batches`` random batches, the same on every rank, through a full_and_breakable registry (each step
    checked the same on every rank by a host agreement)."""
    backend = "cuda" if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    reg = hf.build_registry(model, shape, "full_and_breakable", backend, progress=False)
    capture_s = time.perf_counter() - started
    note(f"TP={label}: {len(reg)} graphs captured in {capture_s:.1f} s; serving {args.random_batches} random batches")
    agreement = TimedAgreement(group, same_batch=True)
    g = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank
    checksum = torch.zeros((), dtype=torch.float64, device=device)
    kinds = {True: 0, False: 0}
    started = time.perf_counter()
    watchdog.arm(f"TP={label}: random batch 0")
    with torch.inference_mode():
        for i in range(args.random_batches):
            actual, inputs, host = random_batch(shape, model.config.vocab_size, g)
            watchdog.beat(f"TP={label}: random batch {i} ({actual})")
            out = reg.run(actual, context=host, group=agreement, **{k: v.to(device, non_blocking=True) for k, v in inputs.items()})
            checksum += out["logits"].double().sum()
            kinds[actual.uniform] += 1
            if (i + 1) % 500 == 0:
                note(f"TP={label}: {i + 1} random batches in {time.perf_counter() - started:.1f} s")
        sync(device)
    watchdog.disarm()
    seconds = time.perf_counter() - started
    stats = reg.stats()
    replays = sorted((str(e.key), e.strategy, e.replays) for e in reg.entries())
    seen: list[Any] = [None] * tp
    dist.all_gather_object(seen, replays, group=group)
    same_graphs = all(s == seen[0] for s in seen)
    low = group_reduce(checksum.item(), group, device, dist.ReduceOp.MIN)
    high = group_reduce(checksum.item(), group, device, dist.ReduceOp.MAX)
    if not same_graphs:
        raise SystemExit(f"TP={label}: the ranks replayed different graphs: {seen}")
    return (f"no hang at TP={label}: {args.random_batches} random batches ({kinds[True]} decode-only, {kinds[False]} mixed) "
            f"in {seconds:.1f} s ({seconds / args.random_batches * 1e3:.2f} ms a batch, input building included), "
            f"{len(reg)} graphs captured in {capture_s:.1f} s, {stats.hits} hits, {stats.misses} misses; every rank "
            f"replayed the same graphs the same number of times; logits checksum spread over the ranks {high - low:.3g}; "
            f"the host agreement ({agreement.transport}) took {agreement.seconds / agreement.calls * 1e6:.1f} us a batch, "
            "waiting for the other ranks included")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(minutes=60)  # ranks outside a TP size wait in a barrier while it runs
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    started = time.perf_counter()

    def log(what: str) -> None:
        if rank == 0:
            print(f"[gpu_tp {time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    # Every rank creates every group, in the same order.  "1g": TP=1 sharded, on a group of rank 0 alone.
    runs = [("1", 1)] if 1 in args.tp else []
    runs += [("1g", 1)] if args.tp1_group else []
    runs += [(str(tp), tp) for tp in args.tp if tp > 1]
    groups = {label: dist.new_group(list(range(tp))) for label, tp in runs if label != "1"}
    gloo_groups = {label: dist.new_group(list(range(tp)), backend="gloo") for label, tp in runs if label != "1"}
    watchdog = Watchdog(rank, args.timeout)
    shape = GPU_SHAPE if args.config != "tiny" else hf.EngineShape()
    sizes = [n for n in args.batches if n > shape.max_num_seqs]
    if sizes:
        raise SystemExit(f"batches {sizes} exceed the engine's {shape.max_num_seqs} requests a step")
    try:
        log(f"building {args.config} on every rank")
        full = hf.build_model(args.config, device, shape, seed=args.seed)
        fill_cache(full, args.seed)
        vocab = full.config.vocab_size
        batches = {n: decode_batch(n, shape, vocab, device, args.seed + n) for n in args.batches}
        reference = {}
        with torch.inference_mode():
            step = hf.make_step(full, hf.decoder(full))
            for n, (inputs, host) in batches.items():
                with cg.eager_batch(B.decode(n), host):
                    reference[n] = step(B.decode(n), **inputs)["logits"].float().cpu()
        rows, agreed, hangs = [], [], []
        for label, tp in runs:
            log(f"TP={label}: capture, step latency" + (", the no-hang check" if label != "1" else ""))
            if label == "1":
                if rank == 0:
                    rows += latency_rows(label, 1, full, None, args, shape, device, batches, reference)
            elif rank < tp:
                group = groups[label]
                model = hf.shard_model(copy.deepcopy(full), rank, tp, group)
                rows += latency_rows(label, tp, model, group, args, shape, device, batches, reference)
                agreed += agreement_rows(label, model, group, gloo_groups[label], args, shape, device, batches)
                if args.random_batches:
                    hangs.append(no_hang(label, tp, model, group, args, shape, device, rank, watchdog))
                del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
        if rank == 0:
            report(args, device, world, shape, rows, agreed, hangs)
        worst = max((r[5] for r in rows), default=0.0)
        if not worst <= args.tolerance:
            raise SystemExit(f"rank {rank}: logits differ from TP=1 by {worst:.3g} (tolerance {args.tolerance})")
    finally:
        # a rank outside a subgroup is handed an int marker by new_group(), not a group: nothing of it to free
        subgroups = [weakref.ref(g) for g in (*groups.values(), *gloo_groups.values()) if isinstance(g, dist.ProcessGroup)]
        groups = gloo_groups = group = model = None  # this frame's references: every group must be freed before exit
        hf.release_process_group(subgroups)


def report(args: argparse.Namespace, device: torch.device, world: int, shape: Any, rows: list[tuple], agreed: list[tuple],
           hangs: list[str]) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke mode: timings mean nothing)"
    cfg = hf.CONFIGS[args.config]
    print(f"{world} x {name}, torch {torch.__version__}, {dist.get_backend()}; {args.config} ({cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, {cfg['num_key_value_heads']} KV heads, "
          f"{str(cfg['dtype']).removeprefix('torch.')}); KV cache {shape.num_blocks} blocks of {shape.block_size}, random contexts")
    print(f"\nper decode step (median of {args.repeats} x {args.iters} steps, the slowest rank; TP > 1 served with "
          "run(..., group=HostAgreement(tp_group, same_batch=True)))")
    print(f"{'TP':>3} {'strategy':10} {'batch':>5} {'step us':>10} {'tokens/s/GPU':>13} {'max|logit-TP1|':>15}")
    for label, strategy, n, us, tps, diff in rows:
        print(f"{label:>3} {strategy:10} {n:5d} {us:10.1f} {tps:13.1f} {diff:15.3e}")
    if agreed:
        print("\nwhat agreement costs a full step, steps back to back (median us a step, the slowest rank; the device "
              "drained only around each loop)")
        print(f"{'TP':>3} {'batch':>5} {'no agreement':>13} {'host':>9} {'(+%)':>7} {'all-reduce':>11} {'(+%)':>7} "
              f"{'agree() host':>13} {'agree() a-r':>13} {'agree() gloo':>13}")
        for label, n, none, host, group, host_alone, group_alone, gloo_alone in agreed:
            print(f"{label:>3} {n:5d} {none:13.1f} {host:9.1f} {(host / none - 1) * 100:+6.1f}% {group:11.1f} "
                  f"{(group / none - 1) * 100:+6.1f}% {host_alone:13.1f} {group_alone:13.1f} {gloo_alone:13.1f}")
    for line in hangs:
        print(line)
    print(f"every logit within {args.tolerance:g} of TP=1: {'yes' if max((r[5] for r in rows), default=0) <= args.tolerance else 'NO'}")


if __name__ == "__main__":
    main()
