"""The pieces' Inductor pass: a residual folded into a matmul is unfolded where the next pointwise op can take the add."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from cgregistry.strategies.inductor_passes import ResidualAddsUnfolded, pieces_config

aten = torch.ops.aten

# Inductor's first use in a process imports torch modules that still define TorchScript methods.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def passed(fn: Callable[..., object], device: str, *shapes: tuple[int, ...]) -> fx.GraphModule:
    """``fn`` traced to aten ops on fake tensors of ``device`` (no GPU needed), then the pass run over it.  Its
    ``addmm`` calls stand for Inductor's folds of the model's ``x + a @ b``."""
    mode = FakeTensorMode()
    with mode:
        gm = make_fx(fn)(*[torch.empty(shape, device=device) for shape in shapes])
        ResidualAddsUnfolded()(gm.graph)
    return gm


def calls(gm: fx.GraphModule) -> list[object]:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def residual_and_norm(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A piece's end: the residual stream is returned (it crosses the split) and feeds the next norm."""
    y = aten.addmm(x, a, b)
    return y.pow(2).mean(-1), y


def test_a_residual_feeding_a_norm_becomes_a_matmul_and_an_add() -> None:
    gm = passed(residual_and_norm, "cuda", (4, 8), (4, 16), (16, 8))
    assert aten.addmm.default not in calls(gm)
    assert calls(gm).count(aten.mm.default) == 1 and calls(gm).count(aten.add.Tensor) == 1


def test_a_residual_through_a_view_to_a_pointwise_op_is_unfolded() -> None:
    gm = passed(lambda x, a, b: aten.addmm(x, a, b).view(2, 16).relu(), "cuda", (4, 8), (4, 16), (16, 8))
    assert aten.addmm.default not in calls(gm) and aten.add.Tensor in calls(gm)


def test_a_bias_row_stays_folded() -> None:
    gm = passed(lambda bias, a, b: aten.addmm(bias, a, b).relu(), "cuda", (8,), (4, 16), (16, 8))
    assert calls(gm).count(aten.addmm.default) == 1


@pytest.mark.parametrize("scales", [{"beta": 2.0}, {"alpha": 0.5}, {"beta": 1.0, "alpha": 3.0}])
def test_a_scaled_addmm_stays_folded(scales: dict[str, float]) -> None:
    gm = passed(lambda x, a, b: aten.addmm(x, a, b, **scales).relu(), "cuda", (4, 8), (4, 16), (16, 8))
    assert aten.addmm.default in calls(gm)


def test_an_addmm_scaled_by_one_is_unfolded() -> None:
    gm = passed(lambda x, a, b: aten.addmm(x, a, b, beta=1, alpha=1).relu(), "cuda", (4, 8), (4, 16), (16, 8))
    assert aten.addmm.default not in calls(gm)


def test_a_sum_only_returned_stays_folded() -> None:
    # No kernel would take the add: unfolding would trade the copy for an add kernel of its own.
    gm = passed(lambda x, a, b: aten.addmm(x, a, b), "cuda", (4, 8), (4, 16), (16, 8))
    assert calls(gm) == [aten.addmm.default]


def test_a_sum_feeding_only_another_matmul_stays_folded() -> None:
    gm = passed(lambda x, a, b, c: aten.mm(aten.addmm(x, a, b), c), "cuda", (4, 8), (4, 16), (16, 8), (8, 8))
    assert aten.addmm.default in calls(gm)


def test_cpu_graphs_are_left_as_inductor_folds_them() -> None:
    gm = passed(lambda x, a, b: aten.addmm(x, a, b).relu(), "cpu", (4, 8), (4, 16), (16, 8))
    assert aten.addmm.default in calls(gm)


def test_the_rewrite_computes_the_same_values() -> None:
    x, a, b = torch.randn(4, 8), torch.randn(4, 16), torch.randn(16, 8)
    gm = passed(lambda x, a, b: aten.addmm(x, a, b).relu(), "cuda", (4, 8), (4, 16), (16, 8))
    gm.recompile()
    assert aten.addmm.default not in calls(gm)
    torch.testing.assert_close(gm(x, a, b), torch.addmm(x, a, b).relu())


def test_pieces_get_the_pass_and_the_config_is_restored() -> None:
    assert inductor_config.post_grad_custom_post_pass is None
    with pieces_config():
        assert isinstance(inductor_config.post_grad_custom_post_pass, ResidualAddsUnfolded)
    assert inductor_config.post_grad_custom_post_pass is None


def test_a_post_pass_of_the_process_is_kept() -> None:
    def own(graph: fx.Graph) -> None:
        pass

    with inductor_config.patch(post_grad_custom_post_pass=own):
        with pieces_config():
            assert inductor_config.post_grad_custom_post_pass is own
        assert inductor_config.post_grad_custom_post_pass is own


def test_the_pass_has_a_cache_key() -> None:
    # Inductor's FX graph cache keys on it; None would turn caching off for every piece.
    assert ResidualAddsUnfolded().uuid() is not None


def test_graphs_without_a_matmul_are_untouched() -> None:
    gm = passed(lambda x: (x * 2).relu(), "cuda", (4, 8))
    assert calls(gm) == [aten.mul.Tensor, aten.relu.default]
