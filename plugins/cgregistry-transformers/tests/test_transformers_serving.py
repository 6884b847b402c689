"""A manager served by cgregistry as transformers users run one: sessions, background capture, inspection, refusals."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from cb_models import cb_config, generate_oracle, greedy, prompts_of, tiny_llama, tokens
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import cgregistry as cg
import cgregistry_transformers as cgt
from cgregistry_transformers.attention import NAME, LiveBatch
from cgregistry_transformers.manager import serving_config
from cgregistry_transformers.switch import served_step
from cgregistry_transformers.versions import check_version


def float_tensors(obj, depth=3):
    """The floating-point tensors ``obj`` holds (the paged cache's K and V, wherever a release keeps them)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if depth == 0:
        return []
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        values = list(getattr(obj, "__dict__", {}).values())
    return [t for v in values for t in float_tensors(v, depth - 1)]


@pytest.fixture
def model():
    m = tiny_llama()
    yield m
    m.__dict__.pop("_cached_continuous_batching_manager", None)


def test_a_persistent_manager_keeps_its_graphs_across_sessions(model):
    prompts = [prompts_of([4, 11, 6], seed) for seed in range(3)]
    config = cb_config(max_batch_tokens=32, max_requests=3)
    first = cgt.generate_batch(model, prompts[0], greedy(6), config, graphs=cgt.GraphSettings(capture="at start"),
                               persistent_manager=True)
    reg = cgt.registry_of(model._cached_continuous_batching_manager)
    graphs = [(e.key, e.strategy) for e in reg.entries()]
    served = reg.stats().hits
    assert tokens(first) == generate_oracle(model, prompts[0], 6)
    for session in prompts[1:]:  # each session runs on a fresh generation thread: the registry moves with it
        again = cgt.generate_batch(model, session, greedy(6), persistent_manager=True)
        assert tokens(again) == generate_oracle(model, session, 6)
    assert cgt.registry_of(model._cached_continuous_batching_manager) is reg
    assert [(e.key, e.strategy) for e in reg.entries()] == graphs  # nothing captured again
    assert reg.stats().hits > served


def test_keys_first_needed_in_a_later_session_are_captured_on_its_thread(model):
    config = cb_config(max_batch_tokens=32, max_requests=4)
    first = cgt.generate_batch(model, prompts_of([3]), greedy(4), config, persistent_manager=True)  # one request
    reg = cgt.registry_of(model)
    captured = {e.key for e in reg.entries()}
    assert tokens(first) == generate_oracle(model, prompts_of([3]), 4) and captured
    wider = prompts_of([9, 2, 14, 5], seed=4)  # a new session (a new generation thread) with wider batches
    again = cgt.generate_batch(model, wider, greedy(5), persistent_manager=True)
    assert tokens(again) == generate_oracle(model, wider, 5)
    assert {e.key for e in reg.entries()} > captured  # new keys, captured inside that session's steps
    assert reg.stats().lazy_captures == len(reg.entries()) and reg.failures() == {}


def test_a_manager_that_is_not_kept_leaves_no_graphs_on_the_model(model):
    prompts = prompts_of([5, 3])
    cgt.generate_batch(model, prompts, greedy(3), cb_config())
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    plain = model.generate_batch(prompts, generation_config=greedy(3), continuous_batching_config=cb_config())
    assert tokens(plain) == generate_oracle(model, prompts, 3)


def test_background_capture_serves_the_first_requests_eagerly_then_from_graphs(model):
    prompts = prompts_of([6, 2, 9, 4])
    manager = cgt.init_continuous_batching(model, greedy(12), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings(capture="background", capture_budget=0.0))
    reg = cgt.registry_of(manager)
    model._cached_continuous_batching_manager = manager
    results = model.generate_batch(prompts, generation_config=greedy(12), persistent_manager=True)
    assert tokens(results) == generate_oracle(model, prompts, 12)
    stats = reg.stats()
    # A budget of 0: nothing is captured while serving, so every step ran eagerly and none waited on a capture.
    assert stats.hits == 0 and stats.misses_by_reason["capturing"] == stats.misses > 0 and reg.entries() == []
    assert reg.capture_pending(None)  # the engine's idle time captures the plan
    again = model.generate_batch(prompts, generation_config=greedy(12), persistent_manager=True)
    assert tokens(again) == tokens(results) and reg.stats().hits > 0


def test_background_capture_with_the_default_budget_captures_the_whole_plan_while_serving(model):
    prompts = prompts_of([6, 2, 9, 4])
    manager = cgt.init_continuous_batching(model, greedy(24), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings(capture="background"))
    reg = cgt.registry_of(manager)
    runner = manager.batch_processor.model_runner
    planned, served, after_each_step = len(runner.plan), runner.forward, []

    def counted(**batch_data):
        out = served(**batch_data)
        after_each_step.append(len(reg.entries()))
        return out

    runner.forward = counted
    model._cached_continuous_batching_manager = manager
    results = model.generate_batch(prompts, generation_config=greedy(24), persistent_manager=True)
    assert tokens(results) == generate_oracle(model, prompts, 24)
    assert after_each_step[0] < planned  # the first step did not wait for the whole plan
    assert after_each_step[-1] == planned and reg.pending() == [] and reg.stats().hits > 0


def test_first_use_captures_only_the_keys_the_batches_needed_inside_their_steps(model):
    prompts = prompts_of([6, 2, 9, 4])
    manager = cgt.init_continuous_batching(model, greedy(10), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings())  # capture="first use"
    reg = cgt.registry_of(manager)
    runner = manager.batch_processor.model_runner
    served, steps = runner.forward, []

    def recorded(**batch_data):
        io = runner.io
        steps.append(cg.BatchDescriptor(io.num_q_tokens, io.num_request_in_batch))
        return served(**batch_data)

    runner.forward = recorded
    model._cached_continuous_batching_manager = manager
    results = model.generate_batch(prompts, generation_config=greedy(10), persistent_manager=True)
    assert tokens(results) == generate_oracle(model, prompts, 10)
    captured = {e.key for e in reg.entries()}
    served_by = {reg.match(actual).key for actual in steps}  # every step's key, live now
    assert captured == served_by < {e.descriptor for e in runner.plan}  # the keys no batch needed stay uncaptured
    assert reg.stats().lazy_captures == len(captured) and reg.stats().hits == len(steps)  # no step ran eagerly


def test_inspection_on_transformers_batches(model):
    manager = cgt.init_continuous_batching(model, greedy(4), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings(capture="at start"))
    reg = cgt.registry_of(manager)
    runner = manager.batch_processor.model_runner
    kv = [t.clone() for t in float_tensors(runner.cache)]
    assert kv and sum(t.numel() for t in kv) >= 2 * 16 * 256  # the KV cache is among them
    estimate = reg.estimate_memory(runner.plan)
    assert estimate.total_bytes > 0 and len(estimate.keys) == len(runner.plan)
    same = [torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(kv, float_tensors(runner.cache))]
    assert all(same)  # the estimate wrote no KV cache (made with torch.empty: NaN where it was never written)
    model._cached_continuous_batching_manager = manager
    model.generate_batch(prompts_of([3, 5, 2]), generation_config=greedy(4), persistent_manager=True)
    why = reg.explain(cg.BatchDescriptor.decode(3))
    assert why.match is not None and why.match.key.covers(cg.BatchDescriptor.decode(3))
    assert reg.stats().hits > 0


@pytest.mark.parametrize("field, value, named", [
    ("use_cuda_graph", True, "use_cuda_graph=True"),
    ("use_cuda_graph", (False, True), "use_cuda_graph=(False, True)"),
    ("use_async_batching", True, "use_async_batching=True"),
])
def test_a_config_asking_for_transformers_own_graphs_is_refused(field, value, named):
    config = ContinuousBatchingConfig(**{field: value})
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        serving_config(config)
    assert getattr(config, field) == value  # the caller's config is not changed


def test_the_served_config_turns_transformers_graphs_off_on_a_copy():
    config = ContinuousBatchingConfig(max_batch_tokens=48)
    served = serving_config(config)
    assert served is not config and served.use_cuda_graph is False and served.use_async_batching is False
    assert served.max_batch_tokens == 48 and config.use_cuda_graph is None


def test_a_manager_the_model_keeps_without_graphs_is_served_with_them(model):
    prompts = prompts_of([3, 8])
    model.generate_batch(prompts, generation_config=greedy(4), continuous_batching_config=cb_config(),
                         persistent_manager=True)  # transformers' own, kept
    again = cgt.generate_batch(model, prompts, greedy(4), persistent_manager=True)
    assert tokens(again) == generate_oracle(model, prompts, 4)
    assert cgt.registry_of(model).stats().hits + cgt.registry_of(model).stats().misses > 0
    model.destroy_cached_continuous_batching_manager()


def test_a_plain_call_between_two_served_calls_does_not_strand_the_next(model):
    prompts = prompts_of([5, 2, 7])
    cgt.generate_batch(model, prompts, greedy(3), cb_config(), persistent_manager=True)
    plain = model.generate_batch(prompts, generation_config=greedy(3))  # transformers drops the kept manager's processor
    served = cgt.generate_batch(model, prompts, greedy(3), cb_config())
    assert tokens(plain) == tokens(served) == generate_oracle(model, prompts, 3)


def test_a_plan_with_keys_the_attention_break_cannot_serve_is_refused():
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=64, max_capture_size=64, mode="full")
    with pytest.raises(ValueError, match=r"strategy \['full'\].*breakable"):
        cgt.GraphSettings(plan=plan)


def test_a_plan_larger_than_the_managers_batches_is_refused_naming_the_limit(model):
    plan = cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=256, max_capture_size=256, mode="breakable")
    with pytest.raises(ValueError, match="max_batch_tokens=64"):
        cgt.init_continuous_batching(model, greedy(2), cb_config(max_batch_tokens=64),
                                     graphs=cgt.GraphSettings(plan=plan))


def test_a_vision_towers_attention_is_left_as_transformers_leaves_it():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    def llava():
        torch.manual_seed(0)
        text = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14)
        m = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_index=97))
        m.set_attn_implementation({"": "sdpa", "text_config": "sdpa", "vision_config": "eager"})
        return m.eval()

    prompts = prompts_of([5, 9])
    theirs, ours = llava(), llava()
    expected = tokens(theirs.generate_batch(prompts, generation_config=greedy(3), continuous_batching_config=cb_config()))
    got = tokens(cgt.generate_batch(ours, prompts, greedy(3), cb_config(), graphs=cgt.GraphSettings(capture="at start")))
    assert got == expected
    assert ours.config.vision_config._attn_implementation == theirs.config.vision_config._attn_implementation


def test_attach_refuses_other_settings_and_a_running_manager(model):
    manager = model.init_continuous_batching(greedy(2), serving_config(cb_config()))
    with pytest.raises(TypeError, match="GraphSettings"):
        cgt.attach(manager, {"capture": "at start"})
    manager.start()
    try:
        with pytest.raises(RuntimeError, match="before manager.start"):
            cgt.attach(manager)
    finally:
        manager.stop(block=True)


def test_attach_names_what_it_takes_and_keeps_a_served_managers_settings(model):
    with pytest.raises(TypeError, match="takes a ContinuousBatchingManager.*LlamaForCausalLM"):
        cgt.attach(model)
    manager = cgt.init_continuous_batching(model, greedy(2), cb_config())
    kept = manager.batch_processor.model_runner.settings
    with pytest.warns(RuntimeWarning, match="served already"):
        assert cgt.attach(manager, cgt.GraphSettings(capture="at start")) is manager
    assert manager.batch_processor.model_runner.settings is kept


def test_a_key_that_fails_at_start_costs_its_batches_speed_not_the_requests(model):
    plain = model.forward

    def forward(*args, **kwargs):  # the 4-token keys fail to capture; served batches (a live batch) run as ever
        live = cg.current_batch()
        if kwargs["input_ids"].shape[1] == 4 and not isinstance(getattr(live, "payload", None), LiveBatch):
            raise RuntimeError("injected: this key cannot be captured")
        return plain(*args, **kwargs)

    prompts = prompts_of([6, 2, 9, 4])
    expected = generate_oracle(model, prompts, 6)
    model.forward = forward
    with pytest.warns(RuntimeWarning, match="serves on"):
        results = cgt.generate_batch(model, prompts, greedy(6), cb_config(max_batch_tokens=32),
                                     graphs=cgt.GraphSettings(capture="at start"), persistent_manager=True)
    assert tokens(results) == expected and all(r.error is None for r in results.values())
    reg = cgt.registry_of(model)
    assert reg.failures() and {k.num_tokens for k, _ in reg.failures()} == {4} and reg.stats().hits > 0


def test_weights_replaced_between_sessions_are_served_after_a_refresh(model):
    prompts = prompts_of([6, 3, 9])
    first = cgt.generate_batch(model, prompts, greedy(5), cb_config(), persistent_manager=True)
    assert tokens(first) == generate_oracle(model, prompts, 5)
    new = tiny_llama(seed=1)
    with torch.no_grad():  # new tensors, as load_state_dict(assign=True) or a reload would make
        model.load_state_dict({k: v.clone() for k, v in new.state_dict().items()}, assign=True)
    again = cgt.generate_batch(model, prompts, greedy(5), persistent_manager=True)
    assert tokens(again) == generate_oracle(new, prompts, 5) != tokens(first)
    assert all(r.error is None for r in again.values()) and cgt.registry_of(model).stats().hits > 0


def test_a_forward_beside_served_steps_attends_its_own_way_and_leaves_the_config_as_it_was(model):
    config, own = model.config, model.config._attn_implementation
    ids = torch.tensor([[5, 17, 3, 9, 11]])
    with torch.no_grad():
        expected = model(ids).logits
    entered, release = threading.Event(), threading.Event()

    def another_managers_step():
        with served_step(config, NAME):
            entered.set()
            release.wait(10)

    other = threading.Thread(target=another_managers_step)
    other.start()
    assert entered.wait(10)
    try:
        with served_step(config, NAME):  # this thread's own step begins and ends while the other is in progress
            pass
        assert config._attn_implementation == NAME  # the other step still attends through the graphs' implementation
        with torch.no_grad():
            beside = model(ids).logits  # a forward outside any served step, meanwhile
    finally:
        release.set()
        other.join(10)
    assert config._attn_implementation == own
    torch.testing.assert_close(beside, expected)


@pytest.mark.parametrize("bad", [dict(max_capture_size=0), dict(capture_budget=-1.0), dict(capture_budget=float("nan")), dict(capture="lazy"), dict(capture=True),
                                 dict(plan=[(cg.BatchDescriptor(4), "breakable")])])
def test_bad_settings_are_refused_naming_the_field(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        cgt.GraphSettings(**bad)


@pytest.mark.parametrize("version", ["5.16.2", "5.25.0", "4.57.1", "6.0.0"])
def test_a_transformers_outside_the_tested_range_is_refused_naming_it(version):
    with pytest.raises(cgt.UnsupportedTransformersVersion, match=rf">=5\.17,<5\.25.*{version}"):
        check_version(version)


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.24.0.dev0"])
def test_a_transformers_in_the_range_is_accepted(version):
    check_version(version)


@pytest.mark.parametrize("dtype, extra, implementation, varlen", [
    (torch.bfloat16, {}, "sdpa", True),
    (torch.float16, {}, "paged|eager", True),
    (torch.float32, {}, "sdpa", False),  # the flash kernel takes half precision only
    (torch.bfloat16, {"layer_types": ["full_attention", "sliding_attention"]}, "sdpa", False),
    (torch.bfloat16, {"attn_logit_softcapping": 50.0}, "sdpa", False),
])
def test_the_varlen_kernel_serves_only_what_it_computes_the_same(model, dtype, extra, implementation, varlen):
    from cgregistry_transformers.attention import TransformersAttention

    manager = model.init_continuous_batching(greedy(2), serving_config(cb_config()))
    cache = cgt.attach(manager).batch_processor.model_runner.cache
    config = type(model.config)(**{**model.config.to_dict(), **extra})
    attention = TransformersAttention(implementation, cache, config, torch.device("cuda"), dtype)
    assert attention.varlen is varlen
    assert not TransformersAttention("sdpa", cache, config, torch.device("cpu"), torch.bfloat16).varlen


def test_capture_writes_nothing_of_the_kv_cache_between_steps_or_inside_them(model):
    """Between calls, as pieces before steps, and at a key's first use inside its step: no capture attends the live
    batch, so the KV cache is written only by the served steps."""
    from cgregistry_transformers.attention import TransformersAttention

    manager = cgt.init_continuous_batching(model, greedy(6), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings(capture="background", capture_budget=0.0))
    runner, reg = manager.batch_processor.model_runner, cgt.registry_of(manager)
    model._cached_continuous_batching_manager = manager
    first = model.generate_batch(prompts_of([6, 2, 9]), generation_config=greedy(6), persistent_manager=True)
    kv = [t.clone() for t in float_tensors(runner.cache)]
    assert reg.capture_pending(None) and reg.entries()  # the whole plan, between calls, on fill values
    same = [torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(kv, float_tensors(runner.cache))]
    assert all(same)

    reg.clear()  # captured again inside the next call's steps, all of it in its first step
    reg.capture_budget = 10.0
    attended, per_step, attend = [0], [], runner.attention

    class Counted(TransformersAttention):
        def __call__(self, *args, **kwargs):
            attended[0] += 1
            return TransformersAttention.__call__(self, *args, **kwargs)

    attend.__class__ = Counted
    served = runner.forward

    def counted(**batch_data):
        attended[0] = 0
        out = served(**batch_data)
        per_step.append(attended[0])
        return out

    runner.forward = counted
    reg.capture(runner.plan, background=True)  # pending: the next call's steps capture it
    assert reg.entries() == []
    again = model.generate_batch(prompts_of([6, 2, 9]), generation_config=greedy(6), persistent_manager=True)
    layers = model.config.num_hidden_layers
    assert per_step and all(n == layers for n in per_step)  # no capture piece attended the live batch
    assert len(reg.entries()) == len(runner.plan)
    assert tokens(again) == tokens(first) == generate_oracle(model, prompts_of([6, 2, 9]), 6)

    reg.clear()  # each key captured inside the step that first needs it, before that step's replay
    per_step.clear()
    reg.capture(runner.plan, lazy=True)
    third = model.generate_batch(prompts_of([6, 2, 9]), generation_config=greedy(6), persistent_manager=True)
    assert reg.stats().lazy_captures > 0 and per_step and all(n == layers for n in per_step)
    assert tokens(third) == tokens(first)


@pytest.mark.parametrize("when", ["first use", "background"])  # captures inside steps, and between them
def test_served_under_inference_mode_and_autocast_as_eager_leaving_the_process_as_it_was(model, when):
    from tests.background.test_process_state import differences, process_state

    prompts = prompts_of([6, 2, 9, 4])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = model.generate_batch(prompts, generation_config=greedy(8), continuous_batching_config=cb_config())
        failed = [r.error for r in theirs.values() if r.error] or [f"{len(theirs)} results"]
        if [len(t) for t in tokens(theirs)] != [8] * len(prompts):  # 5.17 writes inference tensors outside the mode
            pytest.skip(f"transformers {transformers.__version__}'s own continuous batching fails under the caller's "
                        f"inference_mode: {failed[0][:80]}")
        before = process_state()
        ours = cgt.generate_batch(model, prompts, greedy(8), cb_config(), graphs=cgt.GraphSettings(capture=when))
        after = process_state()
    assert [len(t) for t in tokens(ours)] == [8] * len(prompts)
    assert tokens(ours) == tokens(theirs)
    assert differences(before, after) == []
