"""An Inductor graph pass for the pieces: residual adds left to the next kernel instead of folded into a matmul.

Inductor folds ``x + a @ b`` into ``addmm(x, a, b)`` unless every use of the sum is pointwise.  A piece's residual
stream is also a piece output, so the fold is taken, and cuBLAS's ``addmm`` first copies ``x`` into its output (two
device copies a decoder layer).  Where the sum also feeds a pointwise op (the next norm) the add is free there: this
pass undoes the fold, as a whole-model compile would, the product rounded before the add as eagerly.  On CUDA the graph
cannot tell the fold from an ``addmm`` the model wrote (both originate in ``aten.addmm``), so a written one with a
residual-shaped input is unfolded too: in half precision it rounds like mm-then-add, not fused.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import fx

try:  # torch >= 2.6; before it, the pieces compile without the pass
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # pragma: no cover - the tests pin a newer torch
    CustomGraphPass = object  # type: ignore[assignment,misc]
    get_hash_for_files = None

__all__ = ["ResidualAddsUnfolded", "pieces_config"]

aten = torch.ops.aten


def _feeds_pointwise(node: fx.Node) -> bool:
    """Whether some use of ``node`` (through views) is a pointwise op, into whose kernel an add can go."""
    for use in node.users:
        if use.op != "call_function" or not isinstance(use.target, torch._ops.OpOverload):
            continue
        if torch.Tag.pointwise in use.target.tags:
            return True
        if use.target.is_view and _feeds_pointwise(use):
            return True
    return False


def _same_shape(a: torch.Size, b: torch.Size) -> bool:
    """Shapes known equal without a guard (symbolic sizes are compared, never specialised)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _is_residual_fold(match: Any) -> bool:
    """An unscaled ``addmm`` whose added tensor has the product's own shape and dtype (a residual, not a bias row),
    on a GPU, whose sum feeds a pointwise op."""
    node = match.output_node()
    if len(node.args) != 3 or any(node.kwargs.get(scale, 1) != 1 for scale in ("beta", "alpha")):
        return False  # a scaled addmm is not a plain add (the pattern would match it all the same)
    if set(node.kwargs) - {"beta", "alpha"}:
        return False
    inp = match.kwargs["inp"]
    value = node.meta.get("val")
    added = inp.meta.get("val") if isinstance(inp, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(added, torch.Tensor):
        return False
    if value.device.type != "cuda" or added.dtype != value.dtype or not _same_shape(added.shape, value.shape):
        return False
    return _feeds_pointwise(node)


@functools.cache
def _patterns() -> Any:
    """The pattern pass (built on first use: Inductor's pattern matcher is a heavy import)."""
    from torch._inductor.pattern_matcher import Arg, CallFunction, KeywordArg, PatternMatcherPass, register_graph_pattern

    patterns = PatternMatcherPass(pass_name="cgregistry_residual_adds")

    @register_graph_pattern(
        CallFunction(aten.addmm, KeywordArg("inp"), Arg(), Arg()), pass_dict=patterns, extra_check=_is_residual_fold
    )
    def unfold(match: Any, mat1: Any, mat2: Any, *, inp: Any) -> None:
        match.replace_by_example(lambda inp, mat1, mat2: inp + mat1 @ mat2, [inp, mat1, mat2])

    return patterns


class ResidualAddsUnfolded(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass`` for the pieces (it runs after Inductor's own folds)."""

    def __call__(self, graph: fx.Graph) -> None:
        _patterns().apply(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def pieces_config() -> contextlib.AbstractContextManager[Any]:
    """Inductor's config for compiling pieces: the pass above, unless the process set a post pass of its own (kept
    as it is) or torch predates custom graph passes."""
    from torch._inductor import config

    if get_hash_for_files is None or config.post_grad_custom_post_pass is not None:
        return contextlib.nullcontext()
    return config.patch(post_grad_custom_post_pass=ResidualAddsUnfolded())
