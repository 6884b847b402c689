"""Speculative decoding on the Hugging Face Llama engine: a small Llama drafter proposes k tokens, the target
verifies them in one uniform step, greedy acceptance, and both KV caches roll back past the first rejected token.

Two registries share one graph pool (``GraphRegistry(..., pool=verify.pool)``): the target's verify step and the
drafter's step never replay at once, so their graphs' intermediate memory is shared.  Both are keyed by
``BatchDescriptor.decode(n, spec_depth=k)``: n requests of k + 1 token positions each.

- **verify** (the target, ``full``): each request's last token and its k drafts, at their positions; logits for every
  position, written K/V at every one.
- **draft** (the drafter, ``full``): with k > 0, k autoregressive draft tokens inside one graph, the loop unrolled at
  capture: the first pass feeds each request's last two tokens (the newest is not in the drafter's cache yet, and the
  one before it may have been rejected there), each later pass feeds the draft just taken (greedy, on the device).
  With k = 0, one pass over one token: the drafter's one-step form, replayed k - 1 times after a k = 1 replay
  (``chained``: k replays and k host round trips where ``unrolled`` has one).  ``auto`` picks per batch: unrolled
  where its graph was captured, else chained.

The depth is chosen per step from the batch (``SchedulerConfig.spec_schedule``: deep speculation for small batches).
A step whose depth has no graph in either registry is served by the nearest deeper depth that has both (its extra
draft slots carry real drafts; acceptance stops at the scheduled depth), else eagerly: never wrongly.

Rolling back is a matter of lengths: a request's target cache holds every token but its last, its drafter cache every
token but its last two (after a round that drafted nothing, fewer: the next draft round first brings it there, eagerly);
what a rejected draft wrote beyond them is masked (each token sees positions up to its own) and written over by the
next round.  Greedy acceptance makes speculation lossless: every request's tokens equal the
target's own greedy decode without speculation, which the example checks, with every verify logit row that decided
a token checked against Hugging Face's forward (SDPA, no cache) over the final tokens.  Prefill runs eagerly.

The drafter is the target's embeddings, first layers, final norm and LM head, its layers' weights perturbed (random
weights: a drafter that agrees with the target neither always nor never), so both accept and reject paths run.

    python examples/hf_spec_decode.py                                # tiny config on CPU: every draft form, checked
    python examples/hf_spec_decode.py --config llama-3.2-1b --drafter-layers 2 --requests 64   # on a GPU
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

import cgregistry as cg
from cgregistry.plan.workload import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_llama as hf  # noqa: E402  (the engine's model, paged attention and trace requests)

# One replay of k draft passes, k replays of one pass, no graphs; or per batch: unrolled where its graph is captured,
# else chained where the one-pass graphs are, else eager.
FORMS = ("unrolled", "chained", "eager", "auto")


# --------------------------------------------------------------------------- the drafter


def build_drafter(target: LlamaForCausalLM, shape: hf.EngineShape, layers: int, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A drafter of ``layers`` decoder layers sharing the target's vocabulary: the target's embeddings, first
    ``layers`` layers, final norm and LM head, each layer weight perturbed by ``noise`` times its own standard
    deviation; with its own paged KV cache of ``shape``."""
    if not 1 <= layers <= target.config.num_hidden_layers:
        raise ValueError(f"a drafter of {layers} layers: expected 1 to the target's {target.config.num_hidden_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    weight = target.lm_head.weight
    default = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            drafter = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    own = drafter.state_dict()
    drafter.load_state_dict({name: t for name, t in target.state_dict().items() if name in own}, strict=False)
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if ".layers." in name and p.dim() > 1:
                p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * (noise * p.float().std().item()))
    hf.resize_kv_cache(drafter, shape)
    return drafter


def damp_later_layers(target: LlamaForCausalLM, keep: int, factor: float) -> None:
    """Scale what every layer after the first ``keep`` adds to the residual stream (``o_proj`` and ``down_proj``) by
    ``factor``, in place.  With random weights a deep target's choices are unrelated to its first layers' (a 2-layer
    drafter of a 16-layer target accepts nothing); damped, the target follows its first layers closely but not
    always, as a trained target and drafter do (0.05: about half of the drafts of a Llama-3.2-1B shape accepted)."""
    with torch.no_grad():
        for layer in target.model.layers[keep:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


# --------------------------------------------------------------------------- the two steps


def verify_inputs(shape: hf.EngineShape) -> dict[str, cg.StaticInput]:
    """The target's step inputs: k + 1 tokens per request on the token axis."""
    t, r = shape.max_num_tokens, shape.max_num_seqs
    return {
        "input_ids": cg.StaticInput((t,), torch.long, fill=0),
        "positions": cg.StaticInput((t,), torch.long, fill=0),
        "slot_mapping": cg.StaticInput((t,), torch.long, fill=shape.scratch_slot),
        "query_start_loc": cg.StaticInput((r + 1,), torch.long, axis="reqs+1"),
        "seq_lens": cg.StaticInput((r,), torch.long, axis="reqs", fill=1),
        "block_table": cg.StaticInput((r, shape.max_blocks_per_req), torch.long, axis="reqs", fill=0),
    }


def make_verify_step(target: LlamaForCausalLM) -> Any:
    """The target on a flattened token batch: logits for every token (the output axis is ``tokens``)."""
    forward = hf.decoder(target)

    def verify(batch: cg.BatchDescriptor, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        return target.lm_head(forward(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table))

    return verify


def draft_inputs(shape: hf.EngineShape) -> dict[str, cg.StaticInput]:
    """The drafter's step inputs: each request's last two tokens, and the positions and cache slots of its k + 1
    token positions (the drafts' own included)."""
    t, r = shape.max_num_tokens, shape.max_num_seqs
    return {
        "last_tokens": cg.StaticInput((r, 2), torch.long, axis="reqs", fill=0),
        "positions": cg.StaticInput((t,), torch.long, fill=0),
        "slot_mapping": cg.StaticInput((t,), torch.long, fill=shape.scratch_slot),
        "block_table": cg.StaticInput((r, shape.max_blocks_per_req), torch.long, axis="reqs", fill=0),
    }


def make_draft_step(drafter: LlamaForCausalLM) -> Any:
    """The drafter's step for a key of depth k: k greedy draft tokens per request, (n, k); depth 0: one pass over
    each request's last token (``last_tokens[:, 1]``), one draft, (n, 1)."""
    forward = hf.decoder(drafter)

    def draft(batch: cg.BatchDescriptor, last_tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              block_table: torch.Tensor) -> torch.Tensor:
        n, k = batch.num_reqs, batch.spec_depth
        pos, slots = positions.view(n, k + 1), slot_mapping.view(n, k + 1)
        ids, drafts = (last_tokens if k else last_tokens[:, 1:]), []
        for j in range(max(k, 1)):
            cols = slice(0, 2) if j == 0 and k else slice(j + 1, j + 2) if k else slice(0, 1)
            p, s = pos[:, cols], slots[:, cols]
            q = p.shape[1]
            starts = torch.arange(0, n * q + 1, q, device=p.device)
            hidden = forward(ids.reshape(-1), p.reshape(-1), s.reshape(-1), starts, p[:, -1] + 1, block_table)
            token = drafter.lm_head(hidden.view(n, q, -1)[:, -1]).argmax(-1)
            drafts.append(token)
            ids = token[:, None]
        return torch.stack(drafts, dim=1)

    return draft


# --------------------------------------------------------------------------- the engine


@dataclass
class Request:
    """One request: its tokens (prompt and generated), its cache blocks (the same in both caches), the target's logits
    that decided each generated token (kept when checking)."""

    rid: int
    prompt_len: int
    max_new: int
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits predicting the next token
    drafted: int = 0  # tokens in the drafter's cache: every token but the last two after a draft round; fewer after plain ones

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new


@dataclass
class Round:
    """One draft-verify round: the batch, the depth scheduled and the depth run, the keys that served it (None:
    eager), the drafts accepted."""

    num_reqs: int
    depth: int
    ran: int
    form: str
    draft_keys: tuple[cg.BatchDescriptor | None, ...]
    verify_key: cg.BatchDescriptor | None
    accepted: int


@dataclass
class SpecResult:
    requests: list[Request]
    rounds: list[Round]
    seconds: float  # the decode rounds (prefill excluded)

    @property
    def generated(self) -> int:
        return sum(len(r.tokens) - r.prompt_len for r in self.requests)

    def summary(self, label: str) -> str:
        rounds = [r for r in self.rounds if r.depth]
        proposed = sum(r.num_reqs * r.depth for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        graphed = sum(r.verify_key is not None and all(k is not None for k in r.draft_keys) for r in self.rounds)
        deeper = sum(r.ran > r.depth for r in self.rounds)
        rate = f"{accepted}/{proposed} drafts accepted ({accepted / proposed:.0%})" if proposed else "no drafts"
        return (f"{label}: {self.generated} tokens in {len(self.rounds)} rounds ({self.generated / self.seconds:.0f} tokens/s); "
                f"{rate}; {graphed}/{len(self.rounds)} rounds served by graphs, {deeper} by a deeper depth's graphs")


class SpecEngine:
    """Greedy speculative decoding over ``target`` with ``drafter``: registries ``verify`` and ``draft`` (None: eager).

    ``schedule``: the depth per round from the number of requests (``SchedulerConfig.spec_schedule``; depth 0 is plain
    decoding); ``form``: ``unrolled`` (one draft replay per round), ``chained`` (one replay per draft token) or ``eager``.
    """

    def __init__(self, target: LlamaForCausalLM, drafter: LlamaForCausalLM, shape: hf.EngineShape, schedule: SchedulerConfig,
                 verify: cg.GraphRegistry | None, draft: cg.GraphRegistry | None, form: str = "unrolled",
                 keep_logits: bool = False) -> None:
        if form not in FORMS:
            raise ValueError(f"form {form!r}: expected one of {', '.join(FORMS)}")
        self.target, self.drafter, self.shape, self.schedule = target, drafter, shape, schedule
        self.verify_reg, self.draft_reg, self.form, self.keep_logits = verify, draft, form, keep_logits
        self.device = target.lm_head.weight.device
        self.max_depth = max([d for _, d in schedule.spec_schedule or ()] + [schedule.spec_depth])
        self.verify_step, self.draft_step = make_verify_step(target), make_draft_step(drafter)
        self.draft_forward = hf.decoder(drafter)

    # ---------------------------------------------------------------- helpers

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _slot(self, req: Request, position: int) -> int:
        block = self.shape.block_size
        return req.blocks[position // block] * block + position % block

    def _table(self, reqs: list[Request]) -> torch.Tensor:
        width = self.shape.max_blocks_per_req
        return self._tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs])

    def _served(self, reg: cg.GraphRegistry | None, batch: cg.BatchDescriptor) -> cg.BatchDescriptor | None:
        match = reg.match(batch) if reg is not None else None
        return match.key if match is not None else None

    # ---------------------------------------------------------------- prefill (eager)

    def prefill(self, req: Request) -> None:
        """The prompt through both models eagerly, one request alone: the target's cache holds every prompt token and
        gives the first new token; the drafter's holds every prompt token but the last."""
        prompt = req.tokens
        n = len(prompt)
        positions = list(range(n))
        table = self._table([req])
        host = hf.HostBatch([0], [n], [n])
        inputs = dict(input_ids=self._tensor(prompt), positions=self._tensor(positions),
                      slot_mapping=self._tensor([self._slot(req, p) for p in positions]), query_start_loc=self._tensor([0, n]),
                      seq_lens=self._tensor([n]), block_table=table)
        actual = cg.BatchDescriptor(n, 1, uniform=n == 1)
        with cg.eager_batch(actual, host):
            logits = self.verify_step(actual, **inputs)
        if self.keep_logits:
            req.logits[n - 1] = logits[-1].to("cpu", torch.float32, copy=True)
        req.tokens.append(int(logits[-1].argmax()))
        self.catch_up([req])

    def catch_up(self, reqs: list[Request]) -> None:
        """The drafter's cache brought to every token but the last two of each request (what its first draft pass
        assumes), eagerly in one varlen pass: after the prompt, and after rounds that drafted nothing (depth 0)."""
        behind = [r for r in reqs if r.drafted < len(r.tokens) - 2]
        if not behind:
            return
        lens = [len(r.tokens) - 2 - r.drafted for r in behind]
        ids = [t for r in behind for t in r.tokens[r.drafted:len(r.tokens) - 2]]
        positions = [p for r in behind for p in range(r.drafted, len(r.tokens) - 2)]
        slots = [self._slot(r, p) for r in behind for p in range(r.drafted, len(r.tokens) - 2)]
        starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
        seq_lens = [len(r.tokens) - 2 for r in behind]
        actual = cg.BatchDescriptor(len(ids), len(behind), uniform=all(n == 1 for n in lens))
        with cg.eager_batch(actual, hf.HostBatch(starts[:-1], lens, seq_lens)):
            self.draft_forward(self._tensor(ids), self._tensor(positions), self._tensor(slots), self._tensor(starts),
                               self._tensor(seq_lens), self._table(behind))
        for r in behind:
            r.drafted = len(r.tokens) - 2

    # ---------------------------------------------------------------- one round

    def depth_to_run(self, n: int, depth: int) -> tuple[int, str]:
        """The depth and the draft form for ``n`` requests: the scheduled ``depth``, or the nearest deeper one whose draft
        and verify keys both have a graph (its extra draft slots are padding: acceptance stops at ``depth``), in the
        engine's form (``auto``: unrolled where its graph exists, else chained); ``depth`` itself, eagerly (the
        registries run what no key serves eagerly) when no depth has graphs."""
        if not depth or self.form == "eager":
            return depth, self.form
        forms = ("unrolled", "chained") if self.form == "auto" else (self.form,)
        for candidate in range(depth, self.max_depth + 1):
            if self._served(self.verify_reg, cg.BatchDescriptor.decode(n, candidate)) is None:
                continue
            for form in forms:
                drafts = [cg.BatchDescriptor.decode(n, candidate)] if form == "unrolled" else \
                    [cg.BatchDescriptor.decode(n, 1)] + [cg.BatchDescriptor.decode(n)] * (candidate > 1)
                if all(self._served(self.draft_reg, d) is not None for d in drafts):
                    return candidate, form
        return depth, forms[0]

    def propose(self, reqs: list[Request], k: int, form: str) -> tuple[torch.Tensor, tuple[cg.BatchDescriptor | None, ...]]:
        """k drafts per request, (n, k), in ``form``, and the draft keys that served them (None: eager)."""
        n = len(reqs)
        lengths = [len(r.tokens) for r in reqs]
        last = self._tensor([r.tokens[-2:] for r in reqs])
        table = self._table(reqs)
        positions = [[length - 2 + j for j in range(k + 1)] for length in lengths]
        slots = [[self._slot(r, p) for p in row] for r, row in zip(reqs, positions)]

        def run(batch: cg.BatchDescriptor, tokens: torch.Tensor, pos: list[list[int]], slot: list[list[int]]) -> tuple[torch.Tensor, Any]:
            inputs = dict(last_tokens=tokens, positions=self._tensor(sum(pos, [])), slot_mapping=self._tensor(sum(slot, [])),
                          block_table=table)
            if form == "eager" or self.draft_reg is None:
                return self.draft_step(batch, **inputs), None
            key = self._served(self.draft_reg, batch)
            return self.draft_reg.run(batch, **inputs), key

        if form != "chained":
            drafts, key = run(cg.BatchDescriptor.decode(n, k), last, positions, slots)
            return drafts.clone(), (key,)
        first, key = run(cg.BatchDescriptor.decode(n, 1), last, [row[:2] for row in positions], [row[:2] for row in slots])
        columns, keys = [first[:, 0].clone()], [key]
        for j in range(2, k + 1):
            fed = torch.stack([columns[-1], columns[-1]], dim=1)  # the one-step form reads column 1
            out, key = run(cg.BatchDescriptor.decode(n), fed, [row[j:j + 1] for row in positions], [row[j:j + 1] for row in slots])
            columns.append(out[:, 0].clone())
            keys.append(key)
        return torch.stack(columns, dim=1), tuple(keys)

    def verify(self, reqs: list[Request], drafts: torch.Tensor, k: int) -> tuple[torch.Tensor, cg.BatchDescriptor | None]:
        """The target's logits for each request's last token and its k drafts, (n * (k + 1), vocab), and the key that
        served them (None: eager)."""
        n = len(reqs)
        lengths = [len(r.tokens) for r in reqs]
        ids = torch.cat([self._tensor([r.tokens[-1] for r in reqs])[:, None], drafts[:, :k]], dim=1).reshape(-1)
        positions = [length - 1 + j for length in lengths for j in range(k + 1)]
        slots = [self._slot(r, length - 1 + j) for r, length in zip(reqs, lengths) for j in range(k + 1)]
        inputs = dict(input_ids=ids, positions=self._tensor(positions), slot_mapping=self._tensor(slots),
                      query_start_loc=self._tensor(list(range(0, n * (k + 1) + 1, k + 1))),
                      seq_lens=self._tensor([length + k for length in lengths]), block_table=self._table(reqs))
        batch = cg.BatchDescriptor.decode(n, k)
        if self.verify_reg is None or self.form == "eager":
            return self.verify_step(batch, **inputs), None
        key = self._served(self.verify_reg, batch)
        return self.verify_reg.run(batch, **inputs), key

    def round(self, reqs: list[Request]) -> Round:
        """Draft, verify and accept for every request in ``reqs`` (all decoding)."""
        n = len(reqs)
        depth = self.schedule.depth_for(n)
        ran, form = self.depth_to_run(n, depth)
        if ran:
            self.catch_up(reqs)  # after plain rounds the drafter's cache lacks the tokens they added
            drafts, draft_keys = self.propose(reqs, ran, form)
        else:
            drafts, draft_keys = torch.empty(n, 0, dtype=torch.long, device=self.device), ()
        logits, verify_key = self.verify(reqs, drafts, ran)
        chosen = logits.argmax(-1).view(n, ran + 1)[:, : depth + 1]  # acceptance stops at the scheduled depth
        agree = (chosen[:, :depth] == drafts[:, :depth]).cumprod(dim=1).sum(dim=1) if depth else torch.zeros(n, dtype=torch.long)
        accepted_each, picks = agree.tolist(), chosen.tolist()
        rows = logits.view(n, ran + 1, -1)
        for i, req in enumerate(reqs):
            a = accepted_each[i]
            start = len(req.tokens) - 1
            if self.keep_logits:
                for j in range(a + 1):
                    req.logits[start + j] = rows[i, j].to("cpu", torch.float32, copy=True)  # graph memory: copy it out
            req.tokens.extend(picks[i][: a + 1])  # the accepted drafts (the target's own choices) and one more
            if ran:
                req.drafted = len(req.tokens) - 2  # what it wrote past that is masked, and written over next round
        return Round(n, depth, ran, form, draft_keys, verify_key, sum(accepted_each))

    # ---------------------------------------------------------------- serving

    def generate(self, requests: list[Request]) -> SpecResult:
        """Serve ``requests`` in waves of at most ``max_num_seqs``: each wave prefilled, then rounds over its unfinished
        requests until each has its tokens (the batch shrinks as requests finish, and the depth follows it)."""
        rounds: list[Round] = []
        seconds = 0.0
        width = self.shape.max_blocks_per_req
        with torch.inference_mode():
            for first in range(0, len(requests), self.shape.max_num_seqs):
                wave = requests[first:first + self.shape.max_num_seqs]
                for i, req in enumerate(wave):
                    need = math.ceil((req.prompt_len + req.max_new + self.max_depth + 1) / self.shape.block_size)
                    if need > width:
                        raise ValueError(f"request {req.rid}: {req.prompt_len} + {req.max_new} tokens and {self.max_depth} "
                                         f"drafts need {need} blocks, the engine gives a request {width}")
                    req.blocks = [1 + i * width + b for b in range(need)]  # block 0 is the scratch block
                    self.prefill(req)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                active = [r for r in wave if not r.done]
                while active:
                    rounds.append(self.round(active))
                    active = [r for r in active if not r.done]
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds += time.perf_counter() - started
        for req in requests:
            del req.tokens[req.prompt_len + req.max_new:]  # a last round may accept past the end
        return SpecResult(requests, rounds, seconds)


# --------------------------------------------------------------------------- wiring


def depth_schedule(max_num_seqs: int) -> dict[int, int]:
    """Deep speculation for small batches: depth 3 up to a quarter of ``max_num_seqs`` requests, 2 up to half, 1 above
    (the deeper depth where bounds coincide).  Depth 2 has no graph of its own in ``main``: the depth-3 graphs serve it."""
    schedule: dict[int, int] = {}
    for bound, depth in ((max(1, max_num_seqs // 4), 3), (max(1, max_num_seqs // 2), 2), (max_num_seqs, 1)):
        schedule.setdefault(bound, depth)
    return schedule


def engine_shape(max_num_seqs: int, max_depth: int, max_context: int, block_size: int = 8) -> hf.EngineShape:
    """Static inputs for ``max_num_seqs`` requests of up to ``max_depth + 1`` token positions, and room in the cache for
    every request at ``max_context`` tokens (drafts included)."""
    blocks = math.ceil(max_context / block_size)
    return hf.EngineShape(max_num_seqs=max_num_seqs, max_num_tokens=max_num_seqs * (max_depth + 1), block_size=block_size,
                          max_blocks_per_req=blocks)


def plan_depths(schedule: SchedulerConfig, skip: tuple[int, ...] = ()) -> dict[int, tuple[int, ...]]:
    """The depths to capture for each batch size of ``schedule``: 0 and 1 (plain decoding, and the chained form's
    passes) and every depth it schedules there or below, less ``skip`` (depths served by a deeper one's graphs)."""
    bounds = sorted(schedule.spec_schedule or ())
    out = {}
    for bound, _ in bounds:  # a smaller batch may be padded up to a key of this size: its depth too
        depths = {0, 1} | {d for b, d in bounds if b <= bound}
        out[bound] = tuple(sorted(d for d in depths if d not in skip or d in (0, 1)))
    return out


def registries(target: LlamaForCausalLM, drafter: LlamaForCausalLM, shape: hf.EngineShape, schedule: SchedulerConfig,
               backend: str = "auto", skip: tuple[int, ...] = ()) -> tuple[cg.GraphRegistry, cg.GraphRegistry, float, float]:
    """The verify and draft registries, the drafter's in the target's pool, their plans captured (``full``, uniform keys
    per (requests, depth)); and the seconds each capture took."""
    depths = plan_depths(schedule, skip)
    plan = cg.CapturePlan.build(max_num_seqs=shape.max_num_seqs, max_num_tokens=shape.max_num_tokens, mode="full_decode_only",
                                spec_depths=depths)
    verify = cg.GraphRegistry(make_verify_step(target), verify_inputs(shape), backend=backend, name="verify")
    draft = cg.GraphRegistry(make_draft_step(drafter), draft_inputs(shape), backend=backend, output_axis="reqs",
                             name="draft", pool=verify.pool)
    verify.watch(target)
    draft.watch(drafter)
    seconds = []
    with torch.inference_mode():
        for reg in (verify, draft):
            started = time.perf_counter()
            reg.capture(plan)
            seconds.append(time.perf_counter() - started)
    return verify, draft, seconds[0], seconds[1]


def requests_from_trace(count: int, vocab: int, max_prompt: int, max_new: int, seed: int = 0) -> list[Request]:
    """Requests shaped by the bundled trace (``hf_llama.trace_requests``), numbered from 0."""
    shape = hf.EngineShape(max_num_seqs=1, max_num_tokens=max_prompt, block_size=8, max_blocks_per_req=math.ceil((max_prompt + max_new) / 8))
    return [Request(i, len(s.tokens), s.max_new, list(s.tokens))
            for i, s in enumerate(hf.trace_requests(count, shape, vocab, max_prompt, max_new, seed))]


def check_against_hf(target: LlamaForCausalLM, requests: list[Request]) -> float:
    """Largest difference between the logits that decided each token and HF's forward over the final tokens."""
    seqs = [hf.Sequence(r.rid, r.tokens, r.max_new, logits={p: t for p, t in r.logits.items() if p < len(r.tokens) - 1})
            for r in requests]
    return hf.check_against_hf(target, seqs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(hf.CONFIGS))
    parser.add_argument("--drafter-layers", type=hf.positive_int, default=1)
    parser.add_argument("--noise", type=float, default=0.5, help="the drafter's layer weights perturbed by this many stds")
    parser.add_argument("--requests", type=hf.positive_int, default=6)
    parser.add_argument("--max-num-seqs", type=hf.positive_int, default=8)
    parser.add_argument("--max-prompt", type=hf.positive_int, default=12)
    parser.add_argument("--max-new", type=hf.positive_int, default=10)
    parser.add_argument("--forms", default="unrolled,chained,auto,eager", help=f"draft forms to run, of {', '.join(FORMS)}")
    parser.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with Hugging Face's forward")
    args = parser.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    for form in forms:
        if form not in FORMS:
            parser.error(f"argument --forms: {form!r} is not one of {', '.join(FORMS)}")
    device = hf.device_arg(parser, args.device)
    if (args.backend == "cuda") != (device.type == "cuda") and args.backend != "auto":
        parser.error(f"argument --backend: {args.backend!r} does not serve a model on {device}")
    layers = hf.CONFIGS[args.config]["num_hidden_layers"]
    if args.drafter_layers > layers:
        parser.error(f"argument --drafter-layers: {args.drafter_layers}, but the {args.config} target has {layers} layers")
    r = args.max_num_seqs
    schedule = SchedulerConfig(max_num_seqs=r, spec_schedule=depth_schedule(r))
    shape = engine_shape(r, 3, args.max_prompt + args.max_new + 4)
    target = hf.build_model(args.config, device, shape)
    drafter = build_drafter(target, shape, args.drafter_layers, args.noise)
    verify, draft, verify_s, draft_s = registries(target, drafter, shape, schedule, args.backend, skip=(2,))
    print(f"verify: {len(verify)} graphs in {verify_s:.2f} s; draft: {len(draft)} graphs in {draft_s:.2f} s; one pool "
          f"({verify.pool})")
    check = not args.no_check
    reference = None
    for spec, form in [(False, "unrolled"), *((True, f) for f in forms)]:
        plain = SchedulerConfig(max_num_seqs=r, spec_depth=0)
        engine = SpecEngine(target, drafter, shape, schedule if spec else plain, verify, draft, form, keep_logits=check)
        result = engine.generate(requests_from_trace(args.requests, target.config.vocab_size, args.max_prompt, args.max_new))
        label = f"spec decode, {form} drafts" if spec else "plain decode with graphs"
        print(result.summary(label))
        tokens = [r.tokens for r in result.requests]
        if reference is None:
            reference = tokens
        elif tokens != reference:
            bad = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
            raise SystemExit(f"{label}: request {bad}'s tokens differ from the target's own greedy decode: lossy")
        if check:
            error = check_against_hf(target, result.requests)
            if not error < 1e-3:
                raise SystemExit(f"{label}: a logit differs from Hugging Face's forward by {error:.3g}")
    for reg in (verify, draft):
        stats = reg.stats()
        print(f"{reg.name}: {stats.hits} replays, {stats.misses} eager steps; keys used: "
              f"{', '.join(f'{e.key.num_reqs}x{1 + e.key.spec_depth}' for e in reg.entries(used=True, sort='key'))}")
    print("every request's tokens equal the target's greedy decode" + (", every deciding logit HF's forward" if check else ""))


if __name__ == "__main__":
    main()
