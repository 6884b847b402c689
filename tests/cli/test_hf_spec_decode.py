"""Speculative decoding on the Hugging Face Llama engine (examples/hf_spec_decode.py): drafter graphs in the target's
pool, several draft passes in one replay, the depth chosen per round, a real draft-accept-verify loop.

Greedy acceptance makes speculation lossless, so the oracle is the target's own greedy decode without speculation;
each deciding logit is checked against Hugging Face's forward, and each replay against the same step run eagerly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry.plan.workload import SchedulerConfig
from tests.example_modules import load_example

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

sd = load_example("hf_spec_decode.py")

CPU = torch.device("cpu")
MAX_SEQS, MAX_DEPTH = 8, 3
SCHEDULE = SchedulerConfig(max_num_seqs=MAX_SEQS, spec_schedule={2: 3, 4: 2, MAX_SEQS: 1})
SHAPE = sd.engine_shape(MAX_SEQS, MAX_DEPTH, 12 + 10 + MAX_DEPTH + 1, block_size=4)


@pytest.fixture(scope="module")
def models() -> tuple[object, object, cg.GraphRegistry, cg.GraphRegistry]:
    target = sd.hf.build_model("tiny", CPU, SHAPE)
    drafter = sd.build_drafter(target, SHAPE, layers=1, noise=0.5)
    verify, draft, _, _ = sd.registries(target, drafter, SHAPE, SCHEDULE, "cpu", skip=(2,))  # depth 2: no graph of its own
    return target, drafter, verify, draft


def generate(models: tuple, form: str, spec: bool = True, requests: int = 6) -> sd.SpecResult:
    target, drafter, verify, draft = models
    schedule = SCHEDULE if spec else SchedulerConfig(max_num_seqs=MAX_SEQS, spec_depth=0)
    engine = sd.SpecEngine(target, drafter, SHAPE, schedule, verify, draft, form, keep_logits=True)
    return engine.generate(sd.requests_from_trace(requests, target.config.vocab_size, max_prompt=12, max_new=10))


def test_speculation_is_lossless_in_every_draft_form_and_every_deciding_logit_is_hugging_faces(models: tuple) -> None:
    target = models[0]
    plain = generate(models, "unrolled", spec=False)
    assert all(r.depth == 0 for r in plain.rounds)
    assert sd.check_against_hf(target, plain.requests) < 1e-4
    for form in ("unrolled", "chained", "eager"):
        result = generate(models, form)
        assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests], form
        assert all(len(r.tokens) - r.prompt_len == r.max_new for r in result.requests)
        assert sd.check_against_hf(target, result.requests) < 1e-4, form
        proposed = sum(r.num_reqs * r.depth for r in result.rounds)
        accepted = sum(r.accepted for r in result.rounds)
        assert 0 < accepted < proposed, "both the accept and the reject paths ran"
        assert len(result.rounds) < len(plain.rounds), "accepted drafts save target steps"
        graphed = [r.verify_key is not None and all(k is not None for k in r.draft_keys) for r in result.rounds]
        assert all(graphed) if form != "eager" else not any(graphed), form


def test_a_depth_without_graphs_is_served_by_the_nearest_deeper_ones(models: tuple) -> None:
    _, _, verify, draft = models
    assert verify.match(cg.BatchDescriptor.decode(3, 2)) is None and draft.match(cg.BatchDescriptor.decode(3, 2)) is None
    result = generate(models, "unrolled")
    deeper = [r for r in result.rounds if r.ran != r.depth]
    assert deeper and all(r.depth == 2 and r.ran == 3 for r in deeper)
    assert all(r.verify_key.spec_depth == 3 and r.draft_keys[0].spec_depth == 3 for r in deeper)
    assert all(r.accepted <= r.num_reqs * r.depth for r in deeper), "acceptance stops at the scheduled depth"


def test_one_unrolled_replay_stands_for_k_chained_ones(models: tuple) -> None:
    _, _, verify, draft = models
    before = draft.stats().hits
    result = generate(models, "unrolled")
    rounds = [r for r in result.rounds if r.ran]
    assert draft.stats().hits - before == len(rounds)
    before = draft.stats().hits
    result = generate(models, "chained")
    assert draft.stats().hits - before == sum(r.ran for r in result.rounds if r.ran)
    assert {e.key.spec_depth for e in draft.entries(used=True)} >= {0, 1, 3}


def test_both_registries_share_one_pool(models: tuple) -> None:
    _, _, verify, draft = models
    assert draft.pool is verify.pool and verify.pool.live_graphs == len(verify) + len(draft)


@settings(max_examples=12, deadline=None)
@given(num_reqs=st.integers(1, MAX_SEQS), depth=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2**16))
def test_draft_and_verify_replays_equal_their_eager_steps(models: tuple, num_reqs: int, depth: int, seed: int) -> None:
    """Random batch sizes and depths (their keys padded up the ladder): each replay equals the step run eagerly on the
    same inputs, against the same caches."""
    target, drafter, verify, draft = models
    gen = torch.Generator().manual_seed(seed)
    batch = cg.BatchDescriptor.decode(num_reqs, depth)
    width, block = SHAPE.max_blocks_per_req, SHAPE.block_size
    table = torch.stack([1 + i * width + torch.arange(width) for i in range(num_reqs)])
    lengths = torch.randint(2, (width - 1) * block - MAX_DEPTH, (num_reqs,), generator=gen)
    positions = (lengths[:, None] - 2 + torch.arange(depth + 1)).reshape(-1)
    req = torch.arange(num_reqs).repeat_interleave(depth + 1)
    slots = table[req, positions // block] * block + positions % block
    with torch.inference_mode():
        draft_inputs = dict(last_tokens=torch.randint(0, 256, (num_reqs, 2), generator=gen), positions=positions,
                            slot_mapping=slots, block_table=table)
        got = draft.run(batch, **draft_inputs).clone()
        assert draft.match(batch) is not None
        torch.testing.assert_close(got, sd.make_draft_step(drafter)(batch, **draft_inputs))
        verify_inputs = dict(input_ids=torch.randint(0, 256, (num_reqs * (depth + 1),), generator=gen), positions=positions + 1,
                             slot_mapping=table[req, (positions + 1) // block] * block + (positions + 1) % block,
                             query_start_loc=torch.arange(0, num_reqs * (depth + 1) + 1, depth + 1),
                             seq_lens=lengths + depth, block_table=table)
        got = verify.run(batch, **verify_inputs).clone()
        assert verify.match(batch) is not None
        torch.testing.assert_close(got, sd.make_verify_step(target)(batch, **verify_inputs), rtol=1e-4, atol=1e-4)


def test_auto_picks_the_unrolled_graph_where_it_exists_else_the_chained_passes(models: tuple) -> None:
    target, drafter, verify, _ = models
    one_pass = cg.GraphRegistry(sd.make_draft_step(drafter), sd.draft_inputs(SHAPE), backend="cpu", output_axis="reqs",
                                pool=verify.pool)  # the one-pass keys only: depths 0 and 1
    with torch.inference_mode():
        one_pass.capture(cg.CapturePlan.build(max_num_seqs=MAX_SEQS, max_num_tokens=SHAPE.max_num_tokens,
                                              mode="full_decode_only", spec_depths=(0, 1)))
    plain = generate(models, "unrolled", spec=False)
    engine = sd.SpecEngine(target, drafter, SHAPE, SCHEDULE, verify, one_pass, "auto", keep_logits=True)
    result = engine.generate(sd.requests_from_trace(6, target.config.vocab_size, max_prompt=12, max_new=10))
    assert [r.tokens for r in result.requests] == [r.tokens for r in plain.requests]
    forms = {(r.ran, r.form) for r in result.rounds}
    assert (3, "chained") in forms and (1, "unrolled") in forms, forms
    assert all(k is not None for r in result.rounds for k in r.draft_keys), "every round graph-served"


def test_every_draft_is_the_drafters_own_greedy_continuation_also_after_rounds_at_depth_0(models: tuple) -> None:
    """The drafter's cache holds what its first pass assumes, also after plain rounds (depth 0 for the larger batches):
    each proposed draft equals the drafter's greedy continuation computed by Hugging Face's forward with no cache.
    (A stale drafter cache stays lossless, so only this check, or the acceptance rate, sees it.)"""
    target, drafter, verify, draft = models
    schedule = SchedulerConfig(max_num_seqs=MAX_SEQS, spec_schedule={2: 3, 4: 1, MAX_SEQS: 0})
    engine = sd.SpecEngine(target, drafter, SHAPE, schedule, verify, draft, "unrolled")
    checked, wrong = [0], []
    propose = engine.propose

    def checked_propose(reqs: list, k: int, form: str) -> tuple:
        drafts, keys = propose(reqs, k, form)
        drafter.config._attn_implementation = "sdpa"
        try:
            for req, row in zip(reqs, drafts.tolist()):
                seq = list(req.tokens)
                for _ in range(k):
                    seq.append(int(drafter(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
                checked[0] += 1
                if row[:k] != seq[len(req.tokens):]:
                    wrong.append((req.rid, len(req.tokens), row[:k], seq[len(req.tokens):]))
        finally:
            drafter.config._attn_implementation = sd.hf.ATTENTION
        return drafts, keys

    engine.propose = checked_propose
    with torch.inference_mode():
        result = engine.generate(sd.requests_from_trace(6, target.config.vocab_size, max_prompt=12, max_new=10))
    depths = [r.depth for r in result.rounds]
    assert 0 in depths and any(d > 0 for d in depths[depths.index(0):]), depths  # a draft round after a plain one
    assert checked[0] > 0 and not wrong, wrong


def test_capturing_both_registries_writes_only_the_scratch_slot_of_either_cache() -> None:
    """Warm-up and capture run both steps, which write K/V (the drafter's k passes too): only at the scratch slot."""
    target = sd.hf.build_model("tiny", CPU, SHAPE)
    drafter = sd.build_drafter(target, SHAPE, layers=1, noise=0.5)
    caches = [layer.self_attn.k_cache for model in (target, drafter) for layer in model.model.layers]
    for cache in caches:
        cache.fill_(7.0)  # a live server's caches
    verify, draft, _, _ = sd.registries(target, drafter, SHAPE, SCHEDULE, "cpu", skip=(2,))
    assert len(verify) > 0 and len(draft) > 0
    others = torch.ones(caches[0].shape[0], dtype=torch.bool)
    others[SHAPE.scratch_slot] = False
    for cache in caches:
        assert cache[others].eq(7.0).all(), "no request's slot was written by capture"
        assert not cache[SHAPE.scratch_slot].eq(7.0).all(), "capture did run the step (it wrote the scratch slot)"
