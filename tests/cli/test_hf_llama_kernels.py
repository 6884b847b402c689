"""The example engine's faster step (examples/hf_llama.py): fused projections, and its attention's Triton kernels on
CUDA, each against the plain path it replaces (HF's own modules; the gather-and-SDPA attention)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cgregistry as cg
from tests.example_modules import load_example

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

hf = load_example("hf_llama.py")

SHAPE = hf.EngineShape(max_num_seqs=4, max_num_tokens=16, block_size=4, max_blocks_per_req=4)
CPU = torch.device("cpu")


class CountMatmuls(TorchDispatchMode):
    """How many matrix products run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def decode_inputs(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    table = 1 + torch.randperm(SHAPE.num_blocks - 1, generator=g)[: n * SHAPE.max_blocks_per_req].view(n, -1)
    pos = torch.randint(0, SHAPE.max_context, (n,), generator=g)
    return dict(input_ids=torch.randint(0, 256, (n,), generator=g), positions=pos,
                slot_mapping=table.gather(1, (pos // SHAPE.block_size)[:, None])[:, 0] * SHAPE.block_size + pos % SHAPE.block_size,
                query_start_loc=torch.arange(n + 1), seq_lens=pos + 1, block_table=table, logits_indices=torch.arange(n))


def test_fused_projections_compute_what_hf_modules_compute_in_fewer_matmuls() -> None:
    plain, fused = hf.build_model("tiny", CPU, SHAPE), hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    layers = len(plain.model.layers)
    g = torch.Generator().manual_seed(1)
    for n in (1, 3):
        batch, inputs = cg.BatchDescriptor.decode(n), decode_inputs(n, g)
        counts = []
        outs = []
        for model in (plain, fused):
            with torch.no_grad(), cg.eager_batch(batch), CountMatmuls() as mode:
                outs.append(hf.make_step(model, hf.decoder(model))(batch, **inputs))
            counts.append(mode.count)
        torch.testing.assert_close(outs[1]["logits"], outs[0]["logits"], rtol=1e-5, atol=1e-5)
        for ours, theirs in zip(fused.model.layers, plain.model.layers):
            torch.testing.assert_close(ours.self_attn.k_cache, theirs.self_attn.k_cache, rtol=1e-5, atol=1e-6)
        assert counts == [7 * layers + 1, 4 * layers + 1], counts  # the LM head is the + 1


def test_a_copy_into_a_projection_reaches_the_fused_matmul() -> None:
    """HF's names load by copy: the projection's weight is a view of the fused one."""
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in reference.state_dict().items() if "proj" in k}
    reference.load_state_dict(new, strict=False)
    model.load_state_dict(new, strict=False)
    g = torch.Generator().manual_seed(2)
    batch, inputs = cg.BatchDescriptor.decode(2), decode_inputs(2, g)
    with torch.no_grad(), cg.eager_batch(batch):
        got = hf.make_step(model, hf.decoder(model))(batch, **inputs)["logits"]
        want = hf.make_step(reference, hf.decoder(reference))(batch, **inputs)["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hf.unfused_projections(model) == []


def logits_of(model, inputs, batch):  # type: ignore[no-untyped-def]
    with torch.no_grad(), cg.eager_batch(batch):
        return hf.make_step(model, hf.decoder(model))(batch, **inputs)["logits"]


def test_an_assigned_parameter_is_copied_in_and_the_graphs_keep_serving_without_a_refresh() -> None:
    """A sync by assignment (a new nn.Parameter, load_state_dict(assign=True)) onto a projection or a fused weight
    becomes a copy into the memory the graphs read: the parameter already there stays."""
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    reg = cg.GraphRegistry(hf.make_step(model, hf.decoder(model)), hf.static_inputs(SHAPE), backend="cpu", output_axis=hf.OUTPUT_AXES)
    batch = cg.BatchDescriptor.decode(2)
    reg.capture([(batch, "full")])
    reg.watch(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[0].mlp
    held = attn.k_proj.weight
    g = torch.Generator().manual_seed(3)
    new_k = torch.randn(attn.k_proj.weight.shape, generator=g)
    attn.k_proj.weight = torch.nn.Parameter(new_k.clone(), requires_grad=False)
    reference.model.layers[1].self_attn.k_proj.weight.data.copy_(new_k)
    new_gate_up = torch.randn(mlp.gate_up_weight.shape, generator=g)
    mlp.gate_up_weight = torch.nn.Parameter(new_gate_up.clone(), requires_grad=False)  # the fused weight itself
    half = new_gate_up.shape[0] // 2
    reference.model.layers[0].mlp.gate_proj.weight.data.copy_(new_gate_up[:half])
    reference.model.layers[0].mlp.up_proj.weight.data.copy_(new_gate_up[half:])
    assert attn.k_proj.weight is held and hf.unfused_projections(model) == []
    inputs = decode_inputs(2, g)
    torch.testing.assert_close(reg.run(batch, **inputs)["logits"], logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)
    assert reg.stats().hits == 1


@pytest.mark.parametrize("how", ["data swap", "module replaced", "another dtype"])
def test_what_does_not_reach_the_fused_weight_is_refused_until_fused_again(how: str) -> None:
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    attn = model.model.layers[1].self_attn
    new = torch.randn(attn.v_proj.weight.shape, generator=torch.Generator().manual_seed(5))
    if how == "data swap":
        attn.v_proj.weight.data = new.clone()
    elif how == "module replaced":
        fresh = torch.nn.Linear(attn.v_proj.in_features, attn.v_proj.out_features, bias=False)
        fresh.weight.data.copy_(new)
        attn.v_proj = fresh
    else:
        attn.v_proj.weight = torch.nn.Parameter(new.double(), requires_grad=False)
    reference.model.layers[1].self_attn.v_proj.weight.data.copy_(new)
    problems = hf.unfused_projections(model)
    assert problems and all(p.startswith("model.layers.1.self_attn.v_proj") for p in problems), problems
    batch, inputs = cg.BatchDescriptor.decode(2), decode_inputs(2, torch.Generator().manual_seed(6))
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.v_proj.*no longer read through the fused weights"):
        logits_of(model, inputs, batch)
    if how == "another dtype":
        attn.v_proj.weight = torch.nn.Parameter(new, requires_grad=False)  # the engine's fix: the model's dtype
    hf.fuse_projections(model)
    assert hf.unfused_projections(model) == []
    torch.testing.assert_close(logits_of(model, inputs, batch), logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)


def test_a_wrapped_projection_is_not_fused() -> None:
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    model.model.layers[0].mlp.up_proj = torch.nn.Sequential(model.model.layers[0].mlp.up_proj)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj is not a plain nn\.Linear"):
        hf.fuse_projections(model)


@pytest.mark.parametrize("how", ["deepcopy", "to", "pickle", "to_empty"])
def test_moves_and_copies_keep_the_projections_views_of_the_fused_weight(how: str) -> None:
    """What moves parameters one by one (deepcopy, .to, pickling, to_empty then a strict load of an HF checkpoint)
    leaves the projections views of the fused weight: a load by HF's names still reaches the fused matmul."""
    import copy
    import io

    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE, seed=7)
    if how == "deepcopy":
        model = copy.deepcopy(model)
    elif how == "to":
        model = model.double().float()
    elif how == "pickle":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        model = torch.load(buffer, weights_only=False)
    else:
        model.to_empty(device=CPU)
        with torch.no_grad():  # buffers are no checkpoint's: the engine makes them again (caches, RoPE frequencies)
            for mine, theirs in zip(model.buffers(), reference.buffers()):
                mine.copy_(theirs)
    before = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
    model.load_state_dict(reference.state_dict(), strict=how == "to_empty")  # HF's names only
    assert hf.unfused_projections(model) == []
    after = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
    assert after == before
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    batch, inputs = cg.BatchDescriptor.decode(2), decode_inputs(2, torch.Generator().manual_seed(8))
    torch.testing.assert_close(logits_of(model, inputs, batch), logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)


def test_shard_model_refuses_a_fused_model() -> None:
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    with pytest.raises(ValueError, match="shard it first, then fuse_projections"):
        hf.shard_model(model, 0, 2)


def test_the_hf_check_runs_hf_own_modules_on_a_fused_model() -> None:
    """Under SDPA (the HF check) a fused layer is HF's forward: a fused weight that disagreed would show."""
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    ids = torch.randint(0, 256, (1, 6))
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad(), CountMatmuls() as mode:
            model(input_ids=ids, use_cache=False)
    finally:
        model.config._attn_implementation = hf.ATTENTION
    assert mode.count >= 7 * len(model.model.layers)


needs_triton = pytest.mark.skipif(hf.triton is None, reason="Triton (the CUDA kernels)")


def reference_attention(caches, q, slots, lens, scaling):  # type: ignore[no-untyped-def]
    hf.KERNELS = False
    try:
        return hf.static_attention(caches, q, slots, lens, scaling)
    finally:
        hf.KERNELS = True


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "dim"), [
    (torch.bfloat16, 32, 8, 64), (torch.float16, 8, 8, 128), (torch.float32, 4, 2, 16), (torch.bfloat16, 12, 4, 64),
])
def test_the_attention_kernels_match_gather_and_sdpa(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    """Every token at its own length (1 to the whole row), slots scattered over the cache, batches that split the
    context over programs (few tokens) and that do not (many)."""
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(heads + dim)
    slots_total, context = 4096, 1024
    for tokens in (1, 2, 7, 33, 300):
        k_cache = torch.randn(slots_total, kv_heads, dim, generator=g).to(device, dtype)
        v_cache = torch.randn(slots_total, kv_heads, dim, generator=g).to(device, dtype)
        q = torch.randn(heads, tokens, dim, generator=g).to(device, dtype).transpose(0, 1)  # HF's layout, as the op sees it
        slots = torch.stack([torch.randperm(slots_total, generator=g)[:context] for _ in range(tokens)]).to(device)
        lens = torch.randint(1, context + 1, (tokens,), generator=g)
        lens[0], lens[-1] = 1, context
        lens = lens.to(device)
        caches = (k_cache, v_cache, 16)
        got = hf.static_attention(caches, q, slots, lens, None)
        want = reference_attention(caches, q, slots, lens, None)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{tokens} tokens")
        k_new = torch.randn(kv_heads, tokens, dim, generator=g).to(device, dtype).transpose(0, 1)
        v_new = torch.randn(kv_heads, tokens, dim, generator=g).to(device, dtype).transpose(0, 1)
        at = torch.randperm(slots_total, generator=g)[:tokens].to(device)
        hf.write_kv(k_cache, v_cache, at, k_new, v_new)
        assert torch.equal(k_cache[at], k_new) and torch.equal(v_cache[at], v_new)


@pytest.mark.cuda
@needs_triton
def test_the_kernels_stay_inside_the_cache_and_the_slot_rows() -> None:
    """A slot off the cache writes nothing (a graph cannot raise); a length past the row of slots reads the row."""
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(3)
    k_cache, v_cache = (torch.randn(64, 2, 16, generator=g).to(device) for _ in range(2))
    before = (k_cache.clone(), v_cache.clone())
    k_new, v_new = (torch.randn(3, 2, 16, generator=g).to(device) for _ in range(2))
    hf.write_kv(k_cache, v_cache, torch.tensor([64, -1, 5], device=device), k_new, v_new)
    others = torch.arange(64, device=device) != 5
    assert torch.equal(k_cache[others], before[0][others]) and torch.equal(v_cache[others], before[1][others])
    assert torch.equal(k_cache[5], k_new[2]) and torch.equal(v_cache[5], v_new[2])
    q = torch.randn(2, 4, 16, generator=g).to(device)
    slots = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(2)]).to(device)
    caches = (k_cache, v_cache, 16)
    past = hf.static_attention(caches, q, slots, torch.tensor([9, 1000], device=device), None)
    whole = hf.static_attention(caches, q, slots, torch.tensor([8, 8], device=device), None)
    torch.testing.assert_close(past, whole, rtol=0, atol=0)


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full"])
def test_the_fused_engine_on_cuda_serves_the_trace_like_hugging_face(mode: str) -> None:
    result, reg = hf.serve("tiny", mode, device=torch.device("cuda"), shape=SHAPE, requests=6, max_prompt=12, max_new=4,
                           backend="cuda", fuse=True)
    assert len(result.finished) == 6 and all(s.generated == s.max_new for s in result.finished)
    assert result.max_abs_error < 1e-3
    stats = reg.stats()
    assert stats.hits == result.steps and stats.misses == 0



@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("mode", ["full", "full_and_breakable", "full_and_piecewise"])
def test_capture_through_the_kernels_writes_only_the_scratch_slot(mode: str) -> None:
    """Warm-up and capture write K and V through the Triton write kernel: at the scratch slot only."""
    device = torch.device("cuda")
    model = hf.build_model("tiny", device, SHAPE)
    hf.fuse_projections(model)
    caches = [c for layer in model.model.layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
    q = torch.empty(1, 1, model.config.hidden_size // model.config.num_attention_heads, device=device)
    assert hf.uses_kernels(q, caches[0], caches[1]), "the tiny model's attention takes the kernels on CUDA"
    for cache in caches:
        cache.fill_(7.0)  # a live server's cache
    reg = hf.build_registry(model, SHAPE, mode, "cuda")
    assert reg is not None and len(reg) > 0
    torch.cuda.synchronize()
    scratch = SHAPE.scratch_slot
    for cache in caches:
        others = torch.ones(cache.shape[0], dtype=torch.bool, device=device)
        others[scratch] = False
        assert cache[others].eq(7.0).all(), "no request's slot was written by capture"
        assert not cache[scratch].eq(7.0).all(), "capture did run the step (it wrote the scratch slot)"


def test_the_command_line_serves_fused_projections_within_the_hf_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    hf.main(["--fuse-projections", "--mode", "full_and_piecewise", "--mode", "none", "--requests", "3"])
    out = capsys.readouterr().out
    assert "full_and_piecewise" in out and "none" in out and "max |logit - HF|" in out


@pytest.mark.parametrize("how", ["data swap", "another dtype"])
def test_a_fused_weight_changed_on_its_own_is_what_fusing_again_keeps(how: str) -> None:
    """The refusal says: fuse again.  Where the fused weight itself changed, the projections follow it."""
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    attn = model.model.layers[0].self_attn
    new = torch.randn(attn.qkv_weight.shape, generator=torch.Generator().manual_seed(9))
    if how == "data swap":
        attn.qkv_weight.data = new.clone()
    else:
        attn.qkv_weight = torch.nn.Parameter(new.double(), requires_grad=False)
    assert hf.unfused_projections(model) == ["model.layers.0.self_attn.qkv_weight"]
    if how == "another dtype":
        attn.qkv_weight = torch.nn.Parameter(new.clone(), requires_grad=False)  # the engine's fix: the model's dtype
    hf.fuse_projections(model)
    rows = [p.weight.shape[0] for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    for proj, part in zip(("q_proj", "k_proj", "v_proj"), new.split(rows)):
        getattr(reference.model.layers[0].self_attn, proj).weight.data.copy_(part)
    batch, inputs = cg.BatchDescriptor.decode(2), decode_inputs(2, torch.Generator().manual_seed(10))
    torch.testing.assert_close(logits_of(model, inputs, batch), logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)


def test_a_replaced_projection_survives_a_move_before_fusing_again() -> None:
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    attn = model.model.layers[1].self_attn
    fresh = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    reference.model.layers[1].self_attn.q_proj.weight.data.copy_(fresh.weight)
    attn.q_proj = fresh
    model = model.double().float()
    hf.fuse_projections(model)
    batch, inputs = cg.BatchDescriptor.decode(2), decode_inputs(2, torch.Generator().manual_seed(11))
    torch.testing.assert_close(logits_of(model, inputs, batch), logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)


def test_moves_keep_the_parameter_objects_an_engine_holds_and_a_dropped_model_frees_at_once() -> None:
    import gc
    import weakref

    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    held = dict(model.named_parameters())
    model = model.double().float()
    assert all(p is held[name] for name, p in model.named_parameters())
    assert hf.unfused_projections(model) == []
    gc.disable()
    try:
        weight = weakref.ref(model.model.layers[0].self_attn.qkv_weight)
        del model, held
        assert weight() is None, "the fused weights wait for the cyclic collector"
    finally:
        gc.enable()


def test_a_projection_replaced_behind_setattr_is_refused() -> None:
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    attn = model.model.layers[0].self_attn
    # as transformers' quantizer integrations replace modules: into the module dict, no __setattr__
    vars(attn)["_modules"]["k_proj"] = torch.nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    assert "model.layers.0.self_attn.k_proj" in hf.unfused_projections(model)


def test_a_fused_model_through_syncs_a_later_capture_a_refresh_and_another_autocast_serves_eager_or_refuses() -> None:
    """Every output equals the eager step of an unfused model given the same weights, or is refused with a named error."""
    model = hf.fuse_projections(hf.build_model("tiny", CPU, SHAPE))
    reference = hf.build_model("tiny", CPU, SHAPE)
    reg = cg.GraphRegistry(hf.make_step(model, hf.decoder(model)), hf.static_inputs(SHAPE), backend="cpu", output_axis=hf.OUTPUT_AXES)
    reg.watch(model)
    two, four = cg.BatchDescriptor.decode(2), cg.BatchDescriptor.decode(4)
    reg.capture([(two, "full")])
    g = torch.Generator().manual_seed(12)

    def sync(layer: int) -> None:  # an assignment on the fused model, a copy on the reference
        new = torch.randn(model.model.layers[layer].mlp.gate_proj.weight.shape, generator=g)
        model.model.layers[layer].mlp.gate_proj.weight = torch.nn.Parameter(new.clone(), requires_grad=False)
        reference.model.layers[layer].mlp.gate_proj.weight.data.copy_(new)

    def served_like_eager(batch: cg.BatchDescriptor) -> None:
        inputs = decode_inputs(batch.num_tokens, g)
        torch.testing.assert_close(reg.run(batch, **inputs)["logits"], logits_of(reference, inputs, batch), rtol=1e-5, atol=1e-5)

    sync(0)
    served_like_eager(two)
    reg.capture([(four, "full")])  # a later capture, after the sync
    sync(1)
    served_like_eager(four)
    assert reg.refresh().recaptured == ()  # copies moved nothing
    served_like_eager(two)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(cg.errors.CgregistryError, match="autocast"):
            reg.run(two, **decode_inputs(2, g))
    served_like_eager(two)
    assert reg.stats().hits == 4
