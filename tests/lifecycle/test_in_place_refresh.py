"""``GraphRegistry(in_place_refresh=True)``: a parameter replaced by one of the same layout is copied back into the
memory the graphs read, so ``refresh()`` keeps every graph; anything else is captured again, with the reason; the old
memory is held only while graphs read it, and never without the option.  Every output equals eager."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.conftest import device_of

WIDTH, MAX_TOKENS = 16, 32
KEYS = [(B(8, 8), "full"), (B(16, 16), "full")]


class Tied(nn.Module):
    """Two layers sharing one weight (as tied embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def make(backend: str, module: nn.Module | None = None, **kwargs: object) -> tuple[cg.GraphRegistry, nn.Module]:
    torch.manual_seed(0)
    model = (module if module is not None else nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)))
    model = model.to(device_of(backend))

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:  # a closure over the model, as the README's step
        return model(x)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend=backend,
                           in_place_refresh=kwargs.pop("in_place_refresh", True), **kwargs)
    with torch.inference_mode():
        reg.capture(KEYS)
    return reg, model


def new_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(v.device) for k, v in model.state_dict().items()}


def served_by_graph(reg: cg.GraphRegistry, model: nn.Module, n: int = 8, seed: int = 1) -> bool:
    """Run one batch; assert it equals eager with the weights the model holds now; whether a graph served it."""
    device = next(model.parameters()).device
    x = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)).to(device)
    misses = reg.stats().misses
    with torch.inference_mode():
        out = reg.run(B(n, n), x=x).clone()
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    return reg.stats().misses == misses


@pytest.mark.parametrize("background", [False, True])
def test_a_replacement_of_the_same_layout_is_copied_back_and_every_graph_kept(backend: str, background: bool) -> None:
    reg, model = make(backend)
    addresses = {name: p.data_ptr() for name, p in model.named_parameters()}
    state = new_state(model, 1)
    model.load_state_dict(state, assign=True)
    assigned = dict(model.named_parameters())
    with pytest.raises(cg.WeightsMovedError):
        served_by_graph(reg, model)

    result = reg.refresh(background=background)

    assert sorted(result.copied) == sorted(f"model.{n}" for n in addresses)
    assert (len(result.kept), result.recaptured, result.not_copied) == (len(KEYS), (), ())
    assert len(result.moved) == len(addresses)
    for name, p in model.named_parameters():  # the objects the engine assigned, over the memory the graphs read
        assert p is assigned[name] and p.data_ptr() == addresses[name]
        torch.testing.assert_close(p, state[name], rtol=0, atol=0)
    assert served_by_graph(reg, model) and served_by_graph(reg, model, 16)
    assert reg.capturing() == []


def test_a_parameter_given_other_memory_by_data_is_copied_back(backend: str) -> None:
    reg, model = make(backend)
    weight = model[0].weight
    address = weight.data_ptr()
    weight.data = torch.randn(WIDTH, WIDTH, device=weight.device)  # no registration: seen by refresh()'s comparison

    result = reg.refresh()

    assert result.copied == ("model.0.weight",) and result.recaptured == ()
    assert model[0].weight is weight and weight.data_ptr() == address
    assert served_by_graph(reg, model)


def test_a_replacement_of_another_layout_is_captured_again_and_says_why(backend: str) -> None:
    reg, model = make(backend)
    state = new_state(model, 2)
    state["0.weight"] = state["0.weight"].t().contiguous().t()  # the same values, column-major

    model.load_state_dict(state, assign=True)
    result = reg.refresh()

    assert "model.0.weight" not in result.copied and len(result.copied) == 3
    assert [why for why in result.not_copied if "model.0.weight changed its layout" in why and "strides" in why]
    assert sorted(map(str, result.recaptured)) == sorted(map(str, KEYS)) and result.kept == ()
    assert model[0].weight.stride() == (1, WIDTH)
    assert served_by_graph(reg, model) and served_by_graph(reg, model, 16)


def test_tied_parameters_stay_tied_when_copied_back_and_an_untying_update_is_captured_again(backend: str) -> None:
    reg, model = make(backend, Tied())
    shared = new_state(model, 3)
    shared["second.weight"] = shared["first.weight"]  # still tied: one tensor for both names
    model.load_state_dict(shared, assign=True)
    model.second.weight = model.first.weight

    result = reg.refresh()

    assert result.recaptured == () and result.not_copied == ()
    assert model.first.weight.data_ptr() == model.second.weight.data_ptr()
    assert served_by_graph(reg, model)

    untied = new_state(model, 4)  # two tensors where the graphs read one
    model.load_state_dict(untied, assign=True)
    model.second.weight = nn.Parameter(untied["second.weight"])

    result = reg.refresh()

    assert [why for why in result.not_copied if "shares memory" in why and "first.weight" in why]
    assert model.first.weight.data_ptr() != model.second.weight.data_ptr()
    assert len(result.recaptured) == len(KEYS)
    assert served_by_graph(reg, model)


def test_a_parameter_moved_onto_memory_another_tensor_still_uses_is_captured_again(backend: str) -> None:
    reg, model = make(backend)
    bias = model[2].bias
    model[0].bias = nn.Parameter(bias.detach()[:WIDTH])  # now a view of the other layer's bias

    result = reg.refresh()

    assert "model.0.bias" not in result.copied
    assert [why for why in result.not_copied if "model.0.bias shares memory" in why]
    torch.testing.assert_close(model[2].bias, bias)  # the other layer's values are untouched
    assert served_by_graph(reg, model)


def test_inference_tensors_on_both_sides_are_copied_back(backend: str) -> None:
    with torch.inference_mode():
        reg, model = make(backend)
        state = new_state(model, 5)
        model.load_state_dict(state, assign=True)  # an inference tensor takes requires_grad only in here
    assert next(model.parameters()).is_inference() and state["0.weight"].is_inference()

    result = reg.refresh()

    assert len(result.copied) == 4 and result.recaptured == ()
    assert served_by_graph(reg, model)


def _storages(model: nn.Module) -> list[weakref.ref[torch.UntypedStorage]]:
    return [weakref.ref(p.untyped_storage()) for p in model.parameters()]


def test_the_memory_graphs_read_is_held_only_while_graphs_read_it(backend: str) -> None:
    reg, model = make(backend)
    old = _storages(model)
    model.load_state_dict(new_state(model, 6), assign=True)
    gc.collect()
    assert all(ref() is not None for ref in old)  # the graphs read it: held for refresh() to copy back into (on cpu the
    # emulator's recorded ops hold it too; on cuda only the option does, see the test below)

    reg.clear()
    gc.collect()
    assert all(ref() is None for ref in old)

    with torch.inference_mode():
        reg.capture(KEYS)
    old = _storages(model)
    model.load_state_dict(new_state(model, 7), assign=True)
    reg.sleep()
    gc.collect()
    assert all(ref() is None for ref in old)
    reg.wake(background=False)
    assert served_by_graph(reg, model)


@pytest.mark.cuda
def test_without_in_place_refresh_nothing_holds_a_replaced_parameter() -> None:
    reg, model = make("cuda", in_place_refresh=False)  # the cpu emulator's recorded ops hold what they read
    old = _storages(model)
    model.load_state_dict(new_state(model, 8), assign=True)
    gc.collect()
    assert all(ref() is None for ref in old)  # a loader replacing layer by layer peaks at one layer, not a model

    result = reg.refresh()

    assert result.copied == () and len(result.recaptured) == len(KEYS)
    assert served_by_graph(reg, model)


def test_in_place_refresh_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="in_place_refresh"):
        cg.GraphRegistry(lambda batch, x: x, {"x": cg.StaticInput((4, 4), torch.float32)}, backend="cpu",
                         in_place_refresh="yes")  # type: ignore[arg-type]


@pytest.mark.cuda
def test_once_the_engine_drops_what_it_assigned_the_device_holds_one_copy_of_the_weights() -> None:
    reg, model = make("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    state = new_state(model, 9)
    model.load_state_dict(state, assign=True)

    assert len(reg.refresh().copied) == 4

    del state
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    assert served_by_graph(reg, model)


def test_another_registry_reading_the_memory_left_behind_is_refused_until_its_refresh(backend: str) -> None:
    copying, model = make(backend)
    device = next(model.parameters()).device
    other = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                             backend=backend)
    with torch.inference_mode():
        other.capture(KEYS)
    model.load_state_dict(new_state(model, 10), assign=True)
    assert len(other.refresh().recaptured) == len(KEYS)  # its graphs now read the tensors just assigned

    assert len(copying.refresh().copied) == 4  # which go back to the first memory: the other's graphs read freed memory

    x = torch.randn(8, WIDTH, device=device)
    with pytest.raises(cg.WeightsMovedError), torch.inference_mode():
        other.run(B(8, 8), x=x)
    assert len(other.refresh().recaptured) == len(KEYS)
    assert served_by_graph(other, model) and served_by_graph(copying, model)


@pytest.mark.parametrize("let_go", ["clear", "sleep"])
def test_once_no_graph_is_held_a_parameter_replaced_after_is_freed_at_once(backend: str, let_go: str) -> None:
    reg, model = make(backend)
    getattr(reg, let_go)()
    old = _storages(model)

    model.load_state_dict(new_state(model, 11), assign=True)
    gc.collect()

    assert all(ref() is None for ref in old)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_parameters_that_trade_memory_are_captured_again_with_the_values_assigned(backend: str) -> None:
    reg, model = make(backend)
    before = _values(model)
    model[0].weight, model[2].weight = model[2].weight, model[0].weight  # a swap: each new one is the other's old memory

    result = reg.refresh()

    assert result.copied == () and len(result.recaptured) == len(KEYS)
    torch.testing.assert_close(model[0].weight, before["2.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight, before["0.weight"], rtol=0, atol=0)
    assert served_by_graph(reg, model)


def test_a_parameter_given_another_ones_old_values_keeps_them(backend: str) -> None:
    reg, model = make(backend)
    before = _values(model)
    fresh = torch.randn(WIDTH, WIDTH, device=before["0.weight"].device)
    model.load_state_dict({"0.weight": fresh, "2.weight": model[0].weight.detach()}, strict=False, assign=True)

    result = reg.refresh()

    assert "model.0.weight" not in result.copied and "model.2.weight" not in result.copied
    torch.testing.assert_close(model[0].weight, fresh, rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight, before["0.weight"], rtol=0, atol=0)
    assert served_by_graph(reg, model)


def test_a_refused_parameter_reading_another_ones_old_memory_keeps_its_values(backend: str) -> None:
    reg, model = make(backend)
    before = _values(model)
    model[0].weight = nn.Parameter(model[2].weight.detach().t())  # another layout (refused), over layer 2's memory
    model[2].weight = nn.Parameter(torch.randn(WIDTH, WIDTH, device=before["2.weight"].device))

    result = reg.refresh()

    assert "model.2.weight" not in result.copied
    torch.testing.assert_close(model[0].weight, before["2.weight"].t(), rtol=0, atol=0)
    assert served_by_graph(reg, model)


@pytest.mark.parametrize("holder", ["state_dict snapshot", "drafter sharing the parameter"])
def test_old_memory_another_tensor_still_uses_is_left_alone(backend: str, holder: str) -> None:
    reg, model = make(backend)
    before = _values(model)
    if holder == "state_dict snapshot":
        kept = model.state_dict()  # detached views of the old memory: a rollback point
    else:
        kept = nn.Linear(WIDTH, WIDTH, bias=False).to(before["0.weight"].device)
        kept.weight = model[0].weight  # a drafter using the target's parameter object
    model.load_state_dict(new_state(model, 12), assign=True)

    result = reg.refresh()

    assert [why for why in result.not_copied if why.startswith("model.0.weight")]
    assert "model.0.weight" not in result.copied
    still = kept["0.weight"] if holder == "state_dict snapshot" else kept.weight
    torch.testing.assert_close(still, before["0.weight"], rtol=0, atol=0)
    assert served_by_graph(reg, model)


def test_a_tensor_subclass_and_a_stride_0_parameter_are_captured_again_and_say_why(backend: str) -> None:
    class Scaled(nn.Parameter):
        pass

    device = device_of(backend)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).to(device)
    model[0].weight = Scaled(torch.randn(WIDTH, WIDTH, device=device))
    model[2].bias = nn.Parameter(torch.randn(1, device=device).expand(WIDTH))
    reg, model = make(backend, model)  # captured with the subclass and the stride-0 bias
    assert type(model[0].weight) is Scaled and model[2].bias.stride() == (0,)
    model[0].weight = nn.Parameter(torch.randn(WIDTH, WIDTH, device=device))
    model[2].bias = nn.Parameter(torch.randn(1, device=device).expand(WIDTH))

    result = reg.refresh()

    reasons = " | ".join(result.not_copied)
    assert "model.0.weight: no graph holds the memory" in reasons
    assert "model.2.bias has elements that share memory (a stride of 0)" in reasons
    assert served_by_graph(reg, model)


def test_a_storage_object_the_engine_holds_over_the_old_memory_is_left_alone(backend: str) -> None:
    reg, model = make(backend)
    held = model[0].weight.untyped_storage()  # one Python object per storage: the engine's and the registry's are one
    before = model[0].weight.detach().clone()
    model.load_state_dict(new_state(model, 14), assign=True)

    result = reg.refresh()

    assert [why for why in result.not_copied if why.startswith("model.0.weight: 1 other reference")]
    kept = torch.empty(0, device=before.device).set_(held, 0, before.shape, before.stride())
    torch.testing.assert_close(kept, before, rtol=0, atol=0)
    assert served_by_graph(reg, model)


def test_memory_shared_with_other_processes_is_left_alone() -> None:
    reg, model = make("cpu")
    model[0].weight.share_memory_()  # as torch.multiprocessing hands a tensor to a drafter process
    with torch.inference_mode():
        reg.clear()
        reg.capture(KEYS)
    model.load_state_dict(new_state(model, 15), assign=True)

    result = reg.refresh()

    assert [why for why in result.not_copied if "model.0.weight: the memory the graphs read is shared with other processes"
            in why]
    assert served_by_graph(reg, model)


def test_a_weight_the_step_reads_through_a_view_is_copied_back(backend: str) -> None:
    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.t()  # the recorded graph holds the view, and through it the parameter

    reg, model = make(backend, Transposed())
    model.load_state_dict(new_state(model, 16), assign=True)

    result = reg.refresh()

    assert result.copied == ("model.w",) and result.recaptured == ()
    assert served_by_graph(reg, model)


def test_two_registries_copying_back_one_model_settle_after_one_refresh_each(backend: str) -> None:
    first, model = make(backend)
    second = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                              backend=backend, in_place_refresh=True)
    with torch.inference_mode():
        second.capture(KEYS)
    for seed in (17, 18):
        model.load_state_dict(new_state(model, seed), assign=True)
        first.refresh()
        second.refresh()

        assert served_by_graph(first, model) and served_by_graph(second, model)
        assert first.refresh().recaptured == () and second.refresh().recaptured == ()  # settled: nothing moves again


def test_a_copy_back_beside_pending_captures_finishes(backend: str) -> None:
    reg, model = make(backend)
    more = [(B(n, n), "full") for n in (1, 2, 3, 4, 5, 6)]
    with torch.inference_mode():
        reg.capture(more, background=True)  # pending while refresh() copies
    model.load_state_dict(new_state(model, 21), assign=True)

    reg.refresh()
    assert reg.wait_captured(timeout=60)
    reg.refresh()

    assert reg.wait_captured(timeout=60)
    assert all(served_by_graph(reg, model, n) for n in (1, 4, 6, 8, 16))
