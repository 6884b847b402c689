"""Inputs and outputs real attention backends need (``reqs+1`` offsets, per-leaf output axes), and how ``run()``
stages inputs into the static buffers: several dtypes, padding, inputs handed in as static rows.

The oracle is always the step run eagerly on the live (unpadded) inputs, as they were when ``run()`` was called.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from tests.conftest import device_of

B = cg.BatchDescriptor
MAX_REQS, MAX_TOKENS = 8, 32


def varlen_step(batch: B, x: torch.Tensor, cu: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token and per-request results from token values and request offsets (``cu_seqlens``).

    Each token finds its request by searching the offsets; a token past the last offset (padding)
    belongs to none.  Offsets that are not monotonic (a padded tail of zeros) give wrong sums.
    """
    num_reqs = cu.shape[0] - 1
    t = torch.arange(x.shape[0], device=x.device)
    req = torch.searchsorted(cu[1:], t, right=True)  # == num_reqs for tokens past the last live one
    sums = torch.zeros(num_reqs + 1, dtype=x.dtype, device=x.device).index_add_(0, req, x)[:num_reqs]
    return {"hidden": x * 2, "per_req": sums, "none": None}


AXES = {"hidden": "tokens", "per_req": "reqs", "none": None}


def make_registry(backend: str, **cu_kw: object) -> cg.GraphRegistry:
    reg = cg.GraphRegistry(varlen_step, {
        "x": cg.StaticInput((MAX_TOKENS,), torch.float64),
        "cu": cg.StaticInput((MAX_REQS + 1,), torch.long, axis="reqs+1", **cu_kw),
    }, backend=backend, output_axis=AXES)
    plan = cg.CapturePlan.build(max_num_seqs=MAX_REQS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4, 8, 16, 32])
    reg.capture(plan)
    return reg


def live_batch(lens: list[int], device: torch.device) -> tuple[B, torch.Tensor, torch.Tensor]:
    tokens = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long, device=device)
    x = torch.arange(1, tokens + 1, dtype=torch.float64, device=device) ** 1.5
    return B(tokens, len(lens), uniform=all(n == 1 for n in lens)), x, cu


def test_reqs_plus_one_defaults_to_repeat_last() -> None:
    spec = cg.StaticInput((9,), torch.int32, axis="reqs+1")
    assert spec.fill is cg.REPEAT_LAST and spec.capture_fill == 0
    with pytest.raises(ValueError, match="needs an explicit fill"):
        cg.StaticInput((9,), torch.int32, axis="reqs")


@pytest.mark.parametrize("fill", [0, -1, 7, 1 << 20, None, 0.0])
def test_reqs_plus_one_refuses_every_fill_that_can_make_offsets_decrease(fill: object) -> None:
    """A constant fill puts (..., 6, 0, 0) after a batch's last offset: the offsets decrease, and a kernel reading
    them gets negative request lengths (wrong logits on the HF engine).  Only REPEAT_LAST keeps them monotonic."""
    dtype = torch.float32 if isinstance(fill, float) or fill is None else torch.int32
    with pytest.raises(ValueError, match=r"axis='reqs\+1'.*offsets would decrease.*REPEAT_LAST"):
        cg.StaticInput((9,), dtype, axis="reqs+1", fill=fill)


def test_reqs_plus_one_shape_error_names_rows(backend: str) -> None:
    reg = make_registry(backend)
    _, x, cu = live_batch([2, 1, 3], device_of(backend))
    with pytest.raises(cg.InputError, match=r"input 'cu' has shape \(3,\), expected \(4,\) \(4 rows: 3 reqs \+ 1 in this batch\)"):
        reg.run(B(6, 3), x=x, cu=cu[:3])


_SHARED: list[cg.GraphRegistry] = []  # one registry for every example: each runs after all the examples before it


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=MAX_REQS), min_size=1, max_size=6))
def test_varlen_batches_match_eager(batches: list[list[int]]) -> None:
    """Padded requests are empty (their offsets repeat the last live one), whatever ran before (the earlier
    examples' batches on the same registry included)."""
    if not _SHARED:
        _SHARED.append(make_registry("cpu"))
    reg = _SHARED[0]
    for lens in batches:
        if sum(lens) > MAX_TOKENS:
            continue
        actual, x, cu = live_batch(lens, torch.device("cpu"))
        expected = varlen_step(actual, x, cu)
        out = reg.run(actual, x=x, cu=cu)
        assert reg.match(actual) is not None, "every batch here has a key"
        assert out["none"] is None
        torch.testing.assert_close(out["hidden"], expected["hidden"], rtol=0, atol=0)
        torch.testing.assert_close(out["per_req"], expected["per_req"], rtol=0, atol=0)
        assert out["per_req"].shape == (len(lens),) and out["hidden"].shape == (sum(lens),)


def test_varlen_on_each_backend(backend: str) -> None:
    reg = make_registry(backend)
    device = device_of(backend)
    for lens in ([5, 5, 5, 5, 5, 5, 1], [1], [3, 1, 2], [1, 1, 1, 1, 1, 1, 1, 1], [2]):
        actual, x, cu = live_batch(lens, device)
        out = reg.run(actual, x=x, cu=cu)
        expected = varlen_step(actual, x, cu)
        assert reg.match(actual).key.num_reqs >= len(lens)
        torch.testing.assert_close(out["per_req"], expected["per_req"], rtol=0, atol=0)
    assert reg.stats().hits == 5


def offsets_registry() -> cg.GraphRegistry:
    """Returns the offsets and, per token, the sum of every offset row the key reads (padding included)."""

    def step(batch: B, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cu.float(), cu.float().sum().expand(batch.num_tokens)

    reg = cg.GraphRegistry(
        step, {"cu": cg.StaticInput((9,), torch.long, axis="reqs+1")}, backend="cpu", output_axis=("reqs+1", "tokens")
    )
    reg.capture([(B(8, 8), "full"), (B(8, 4), "full")])
    return reg


def test_repeat_last_pads_every_row_the_key_reads() -> None:
    reg = offsets_registry()
    reg.run(B(8, 8), cu=torch.arange(9))
    offsets, total = reg.run(B(3, 2), cu=torch.tensor([0, 1, 3]))
    assert offsets.tolist() == [0, 1, 3]
    assert total[0].item() == 0 + 1 + 3 + 3 + 3, "padded requests are empty: their offsets repeat the last live one"
    offsets, total = reg.run(B(7, 5), cu=torch.tensor([0, 1, 2, 4, 6, 7]))
    assert total[0].item() == 0 + 1 + 2 + 4 + 6 + 7 + 7 + 7 + 7  # key B(8, 8) reads 9


def test_capture_runs_offsets_on_zeros() -> None:
    seen: list[torch.Tensor] = []

    def step(batch: B, cu: torch.Tensor) -> torch.Tensor:
        seen.append(cu.clone())
        return cu.float()

    reg = cg.GraphRegistry(step, {"cu": cg.StaticInput((9,), torch.long, axis="reqs+1")}, backend="cpu", output_axis="reqs+1")
    reg.capture([(B(8, 8), "full")])
    assert len(seen) == 2 and all(s.eq(0).all() for s in seen)  # warm-up and capture
    reg.run(B(8, 8), cu=torch.arange(9))
    seen.clear()  # (what capture cloned is graph memory: the replay above rewrote it)
    reg.capture([(B(8, 4), "full")])  # after serving: still a batch of empty requests
    assert len(seen) == 2 and all(s.eq(0).all() for s in seen)


def test_output_axis_tree_is_validated() -> None:
    inputs = {"x": cg.StaticInput((8,), torch.float32)}
    with pytest.raises(ValueError, match=r"output_axis leaves must be among .*'token'"):
        cg.GraphRegistry(lambda b, x: x, inputs, backend="cpu", output_axis={"h": "token"})
    with pytest.raises(ValueError, match="output_axis is a set"):
        cg.GraphRegistry(lambda b, x: x, inputs, backend="cpu", output_axis={"tokens"})
    with pytest.raises(ValueError, match="output_axis must be one of"):
        cg.GraphRegistry(lambda b, x: x, inputs, backend="cpu", output_axis="request")


def test_output_axis_tree_must_mirror_the_output() -> None:
    reg = cg.GraphRegistry(
        lambda b, x: (x, x[:1]), {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", output_axis=["tokens"]
    )
    with pytest.raises(cg.CaptureError, match="is not shaped like the step's output"):
        reg.capture([(B(4, 4), "full")])
    assert len(reg) == 0


def test_per_leaf_axis_checks_each_leaf() -> None:
    reg = cg.GraphRegistry(
        lambda b, x: (x, x), {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", output_axis=("tokens", "reqs")
    )
    with pytest.raises(cg.CaptureError, match=r"output\[1\] \(output leaf 1\) has shape \(4,\); expected a leading dimension of 2 \(reqs of"):
        reg.capture([(B(4, 2), "full")])


def test_a_per_request_output_under_the_token_axis_is_named_with_the_setting_that_fixes_it() -> None:
    """A step returning per-request logits beside per-token hidden states, with no output_axis: the error names the
    output by its key and says which setting serves it."""
    reg = cg.GraphRegistry(lambda b, x: {"hidden": x, "logits": x[: b.num_reqs] * 2},
                           {"x": cg.StaticInput((32,), torch.float32)}, backend="cpu")
    with pytest.raises(cg.CaptureError, match=r"output\['logits'\] \(output leaf 1\) has shape \(4,\); expected a leading "
                                              r"dimension of 8 \(tokens of .*\); an output with a row per request needs "
                                              r"output_axis='reqs' for it"):
        reg.capture([(B(8, 4), "full")])
    reg = cg.GraphRegistry(lambda b, x: {"hidden": x, "logits": x[: b.num_reqs] * 2},
                           {"x": cg.StaticInput((32,), torch.float32)}, backend="cpu",
                           output_axis={"hidden": "tokens", "logits": "reqs"})
    reg.capture([(B(8, 4), "full")])
    x = torch.randn(8)
    torch.testing.assert_close(reg.run(B(8, 4), x=x)["logits"], x[:4] * 2)


def test_per_request_logits_through_logits_indices(backend: str) -> None:
    """Hidden states per token, logits per request picked by ``logits_indices`` (the last token of each)."""
    device = device_of(backend)
    head = torch.nn.Linear(4, 3, dtype=torch.float64).to(device)

    def step(batch: B, h: torch.Tensor, logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(h)
        return hidden, head(hidden[logits_indices])

    reg = cg.GraphRegistry(step, {
        "h": cg.StaticInput((16, 4), torch.float64),
        "logits_indices": cg.StaticInput((4,), torch.long, axis="reqs", fill=0),
    }, backend=backend, output_axis=("tokens", "reqs"))
    with torch.inference_mode():
        reg.capture([(B(16, 4), "full"), (B(8, 2), "full")])
        h = torch.randn(7, 4, dtype=torch.float64, device=device)
        idx = torch.tensor([2, 6], device=device)
        hidden, logits = reg.run(B(7, 2), h=h, logits_indices=idx)
        want_hidden, want_logits = step(B(7, 2), h, idx)
    assert hidden.shape == (7, 4) and logits.shape == (2, 3)
    torch.testing.assert_close(hidden, want_hidden)
    torch.testing.assert_close(logits, want_logits)
    assert reg.stats().hits == 1


def test_repeat_last_is_only_for_offsets_and_survives_copies() -> None:
    import copy
    import pickle

    with pytest.raises(ValueError, match=r"fill=REPEAT_LAST is for offsets \(axis='reqs\+1'\)"):
        cg.StaticInput((16,), torch.long, fill=cg.REPEAT_LAST)  # a slot mapping repeating a live slot
    spec = cg.StaticInput((9,), torch.int32, axis="reqs+1")
    assert pickle.loads(pickle.dumps(spec)).fill is cg.REPEAT_LAST  # a config sent to worker processes
    assert copy.deepcopy(spec).fill is cg.REPEAT_LAST


def mixed_step(batch: B, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
               cu: torch.Tensor) -> torch.Tensor:
    return a + b.sum(1) + ids.float() + pos.float() + cu[-1].float()


MIXED = {
    "a": cg.StaticInput((MAX_TOKENS,), torch.float32),  # fill 0
    "b": cg.StaticInput((MAX_TOKENS, 3), torch.float32, fill=None),  # padded rows left as they are
    "ids": cg.StaticInput((MAX_TOKENS,), torch.long, fill=7),
    "pos": cg.StaticInput((MAX_TOKENS,), torch.long, fill=0),
    "cu": cg.StaticInput((MAX_REQS + 1,), torch.int32, axis="reqs+1"),
}


def mixed_registry(backend: str) -> cg.GraphRegistry:
    reg = cg.GraphRegistry(mixed_step, MIXED, backend=backend)
    reg.capture(cg.CapturePlan.build(max_num_seqs=MAX_REQS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4, 8, 16, 32]))
    return reg


def mixed_inputs(lens: list[int], seed: int, strided: bool, device: torch.device) -> tuple[B, dict[str, torch.Tensor]]:
    """Live inputs of several dtypes, one of them needing grad and, with ``strided``, one laid out unlike its buffer."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    b = torch.randn(3, n, generator=g).t() if strided else torch.randn(n, 3, generator=g)
    live = {
        "a": torch.randn(n, generator=g).to(device).requires_grad_(),
        "b": b.to(device),
        "ids": torch.randint(0, 100, (n,), generator=g).to(device),
        "pos": torch.arange(n).to(device),
        "cu": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
    }
    return B(n, len(lens), uniform=all(k == 1 for k in lens)), live


def check_staged(reg: cg.GraphRegistry, actual: B, live: dict[str, torch.Tensor]) -> None:
    """A replayed batch's output is eager's on its live inputs, needs no grad, and the static inputs hold the live rows
    then the padding: each fill, the last offset repeated, or (fill=None) whatever was there."""
    hits = reg.stats().hits
    out = reg.run(actual, **live)
    assert reg.stats().hits == hits + 1, "every batch here replays a graph"
    with torch.no_grad():
        torch.testing.assert_close(out, mixed_step(actual, **live), rtol=1e-6, atol=1e-5)
    assert not out.requires_grad
    static = reg.static_inputs
    for name, tensor in live.items():
        rows = tensor.shape[0]
        assert torch.equal(static[name][:rows], tensor.detach()), name
        fill = MIXED[name].fill
        if fill is cg.REPEAT_LAST:
            assert bool((static[name][rows:] == tensor[-1]).all()), name
        elif fill is not None:
            assert bool((static[name][rows:] == fill).all()), name


_MIXED: list[cg.GraphRegistry] = []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=MAX_REQS), st.booleans()), min_size=1,
                max_size=6), st.integers(0, 1000))
def test_inputs_of_several_dtypes_are_staged_with_their_padding(batches: list[tuple[list[int], bool]], seed: int) -> None:
    """Whatever ran before (every earlier example shares the registry), larger batches leaving rows to re-fill."""
    if not _MIXED:
        _MIXED.append(mixed_registry("cpu"))
    for i, (lens, strided) in enumerate(batches):
        actual, live = mixed_inputs(lens, seed + i, strided, torch.device("cpu"))
        check_staged(_MIXED[0], actual, live)


def test_inputs_of_several_dtypes_on_each_backend(backend: str) -> None:
    reg = mixed_registry(backend)
    for i, lens in enumerate(([4, 4, 4, 4, 4, 4, 4, 4], [1], [2, 3], [1] * 8, [4, 4, 4, 4, 4, 4, 4, 4], [3])):
        actual, live = mixed_inputs(lens, i, strided=i % 2 == 1, device=device_of(backend))
        check_staged(reg, actual, live)


ALIASES = {
    "rows of a buffer written earlier": lambda static: {"y": static["x"][:32]},
    "rows of a buffer written later": lambda static: {"x": static["y"][:32]},
    "its own buffer, off its rows": lambda static: {"x": static["x"][1:33]},
    "detached rows": lambda static: {"y": static["x"][:32].detach()},
    "a tensor set to the buffer's storage": lambda static: {"y": torch.empty(0, device=static["x"].device).set_(
        static["x"].untyped_storage(), 0, (32, 4))},
    "each the other's rows": lambda static: {"x": static["y"][:32], "y": static["x"][:32]},
    "offsets in another buffer": lambda static: {"cu": static["prev"][:5]},
}


@pytest.mark.parametrize("inference", [False, True], ids=["grad mode", "inference mode"])
@pytest.mark.parametrize("alias", list(ALIASES))
def test_an_input_handed_in_as_static_rows_is_read_as_it_was_when_run_was_called(backend: str, alias: str,
                                                                                   inference: bool) -> None:
    """An engine may hand the registry's own buffers back (the last step's rows, say): every input is read as it was
    when ``run()`` was called, whichever buffer is written first, and an offsets input's padding repeats its own
    last value."""
    def step(batch: B, x: torch.Tensor, y: torch.Tensor, prev: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        return x * 3 + y + (prev[:4] * 10 + cu.sum())[:, None].repeat_interleave(8, 0).float()

    spec = {"x": cg.StaticInput((64, 4), torch.float32), "y": cg.StaticInput((64, 4), torch.float32),
            "prev": cg.StaticInput((9,), torch.long, axis="reqs+1"), "cu": cg.StaticInput((9,), torch.long, axis="reqs+1")}
    with torch.inference_mode(inference):
        reg = cg.GraphRegistry(step, spec, backend=backend)
        reg.capture([(B(32, 4), "full")])
        device = reg.device
        g = torch.Generator().manual_seed(0)

        def fresh() -> dict[str, torch.Tensor]:
            return {"x": torch.randn(32, 4, generator=g).to(device), "y": torch.randn(32, 4, generator=g).to(device),
                    "prev": torch.randint(0, 50, (5,), generator=g).cumsum(0).to(device), "cu": torch.tensor([0, 8, 16, 24, 32], device=device)}

        reg.run(B(32, 4), **fresh())
        for _ in range(3):
            live = {**fresh(), **ALIASES[alias](reg.static_inputs)}
            want = step(B(32, 4), **{name: t.clone() for name, t in live.items()})
            hits = reg.stats().hits
            torch.testing.assert_close(reg.run(B(32, 4), **live), want, rtol=0, atol=0)
            assert reg.stats().hits == hits + 1
            assert torch.equal(reg.static_inputs["cu"][5:], reg.static_inputs["cu"][4].expand(4)), "padding repeats the last offset"


def test_a_run_interrupted_while_staging_leaves_every_padded_row_to_be_filled() -> None:
    """A copy that raises part-way (an interrupt, say) leaves no row an index input's padding must hold unfilled."""
    def step(batch: B, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + slots.float()

    reg = cg.GraphRegistry(step, {"slots": cg.StaticInput((16,), torch.long, fill=99),
                                  "x": cg.StaticInput((16,), torch.float32)}, backend="cpu")
    reg.capture([(B(4), "full"), (B(16), "full")])
    reg.run(B(4), slots=torch.arange(4), x=torch.zeros(4))

    class Interrupting(torch.Tensor):
        """A live input whose copy raises once the slots were copied in."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if func in (torch.Tensor.copy_, torch._foreach_copy_) and any(isinstance(a, cls) for a in args if isinstance(a, torch.Tensor)):
                raise KeyboardInterrupt
            return super().__torch_function__(func, types, args, kwargs or {})

    with pytest.raises(KeyboardInterrupt):
        reg.run(B(16), slots=torch.arange(20, 36), x=torch.zeros(16).as_subclass(Interrupting))
    reg.run(B(3), slots=torch.arange(3), x=torch.zeros(3))
    assert reg.static_inputs["slots"].tolist() == [0, 1, 2, *[99] * 13]


def test_a_step_with_no_static_inputs_replays(backend: str) -> None:
    """A step that reads engine state only (its inputs staged by the engine itself): nothing to copy in."""
    state = torch.arange(32.0, device=device_of(backend))

    def step(batch: B) -> torch.Tensor:
        return state[: batch.num_tokens] * 2

    reg = cg.GraphRegistry(step, {}, backend=backend)
    reg.capture([(B(8), "full"), (B(16), "full")])
    for n in (8, 16):
        state.add_(1)
        torch.testing.assert_close(reg.run(B(n)), step(B(n)), rtol=0, atol=0)
    assert reg.stats().hits == 2


def test_a_lone_input_handed_in_as_rows_of_its_own_buffer_is_read_as_it_was(backend: str) -> None:
    """The rows an earlier, larger batch left (about to be filled back), rows overlapping those being written, and a
    strided view of them (copy_'s own overlap check gives up on it) are all read as they were when ``run()`` was
    called."""
    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((32, 4), torch.float32)}, backend=backend)
    reg.capture([(B(2), "full"), (B(4), "full"), (B(16), "full")])
    static = reg.static_inputs["x"]
    for handed in (lambda: static[8:12], lambda: static[1:5], lambda: static.as_strided((4, 4), (1, 4))):
        reg.run(B(16), x=torch.arange(64.0, device=reg.device).view(16, 4))
        live = handed()
        want = live.clone() * 2
        torch.testing.assert_close(reg.run(B(4), x=live), want, rtol=0, atol=0)
        assert static[4:].eq(0).all(), "the padding was filled back"
    assert reg.stats().hits == 6


@pytest.mark.parametrize("handed", ["another input's static rows", "the previous run's output"])
def test_the_eager_run_after_a_failed_replay_reads_the_inputs_as_they_were_at_run(handed: str) -> None:
    """A replay that raises part-way (here an eager break, once) is answered by the step run eagerly: on the inputs
    as handed in, not on memory the staging or the replay's first segment had already written over."""
    failures: list[Exception] = []

    @cg.eager_break
    def settle(z: torch.Tensor) -> torch.Tensor:
        if failures and cg.current_batch() is not None and cg.current_batch().key is not None:
            raise failures.pop()
        return z + 1

    def step(batch: B, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = x * 3 + y
        settle(out)  # the first segment wrote the output before the break
        return out

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32), "y": cg.StaticInput((16,), torch.float32)},
                           backend="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.capture([(B(8), "breakable")])
        previous = reg.run(B(8), x=torch.arange(8.0), y=torch.ones(8))
        assert reg.stats().hits == 1
        failures.append(RuntimeError("a broken entry"))
        if handed == "another input's static rows":
            x, y = torch.full((8,), 5.0), reg.static_inputs["x"][:8]  # the rows the copy of x overwrites first
        else:
            x, y = previous, torch.full((8,), 2.0)  # sampled tokens fed back, say
        want = step(B(8), x.clone(), y.clone())
        got = reg.run(B(8), x=x, y=y)
    assert reg.failures() and reg.stats().misses_by_reason.get("failed") == 1, "the replay did fail"
    torch.testing.assert_close(got, want, rtol=0, atol=0)