"""The ``piecewise`` strategy: the pieces of a piecewise-compiled model, graphed per descriptor.

``torch.compile`` with the piecewise compiler (:mod:`cgregistry.strategies.compiler`) traces the model once and cuts
it at splitting ops.  Capture runs the step once: each piece a graph segment in the registry's pool, each splitting op
run eagerly between them, as ``breakable``'s eager breaks (same replay, same pool rules).  Only the split points differ:
found in the traced graph by op, function or module type, and the pieces may be Inductor kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cgregistry.contracts import runtime
from cgregistry.backends import Backend
from cgregistry.builtins import BUILTIN_RELAXES
from cgregistry.contracts.markers import hookimpl
from cgregistry.strategies.breakable import BreakableGraph, BreakableStrategy, CaptureSite
from cgregistry.errors import PiecewiseError

if TYPE_CHECKING:
    from cgregistry.hooks.manager import StrategyRegistrar

__all__ = ["PiecewiseStrategy"]


class PiecewiseStrategy(BreakableStrategy):
    """Segments from a model compiled with ``cgregistry.compile_piecewise`` (or ``reg.compile_backend()``)."""

    name = "piecewise"
    relaxes_num_reqs = BUILTIN_RELAXES["piecewise"]

    def capture(self, body: Callable[[], Any], backend: Backend, pool: object) -> tuple[BreakableGraph, Any]:
        token = runtime.see_compiled.set(True)  # the cpu emulator records the split graph's ops as compiled
        try:
            return super().capture(body, backend, pool)
        finally:
            runtime.see_compiled.reset(token)

    def check_capture(self, site: CaptureSite) -> None:
        if site.compiled_runs == 0:
            raise PiecewiseError(
                "the step ran no model compiled with the piecewise backend, so there are no pieces: compile it with "
                "compiled = reg.compile(model) (or cgregistry.compile_piecewise(model)) and call compiled(...) in the "
                "step (or torch.compile(model, backend=reg.compile_backend(), dynamic=True)), or plan this key with the "
                "'breakable' strategy, which needs no compile (mode='full_and_breakable', the default mode)"
            )


@hookimpl
def cgregistry_register_strategies(register: StrategyRegistrar) -> None:
    register(PiecewiseStrategy())
