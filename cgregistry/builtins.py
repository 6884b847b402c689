"""The strategies and backends that ship with cgregistry, in one table: the default plugin modules, the matcher's
default preference, the plan modes and each strategy's ``relaxes_num_reqs`` derive from it.  A leaf module, so plans
read it without importing a strategy or the plugin manager; a new built-in strategy is one row here plus its module.
"""

from __future__ import annotations

import attrs

__all__ = ["BACKEND_MODULES", "BUILTIN_RELAXES", "DEFAULT_PLUGINS", "DEFAULT_PREFERENCE", "MODES", "STRATEGIES", "BuiltinStrategy"]


@attrs.frozen
class BuiltinStrategy:
    """One built-in strategy: its name, the module that registers it, and what plans need to know of it."""

    name: str
    module: str
    relaxes_num_reqs: bool  # its mixed keys carry no request count (one graph serves any number of requests)
    whole_step: bool  # one graph holds the whole step: it serves uniform decode keys in the plan modes


STRATEGIES: tuple[BuiltinStrategy, ...] = (  # most preferred first: the matcher's default preference
    BuiltinStrategy("full", "cgregistry.strategies.full", relaxes_num_reqs=False, whole_step=True),
    BuiltinStrategy("piecewise", "cgregistry.strategies.piecewise", relaxes_num_reqs=True, whole_step=False),
    BuiltinStrategy("breakable", "cgregistry.strategies.breakable", relaxes_num_reqs=True, whole_step=False),
)
BACKEND_MODULES: tuple[str, ...] = ("cgregistry.backends.cuda", "cgregistry.backends.cpu")

DEFAULT_PLUGINS: tuple[str, ...] = BACKEND_MODULES + tuple(s.module for s in STRATEGIES)
DEFAULT_PREFERENCE: tuple[str, ...] = tuple(s.name for s in STRATEGIES)
BUILTIN_RELAXES: dict[str, bool] = {s.name: s.relaxes_num_reqs for s in STRATEGIES}


def _modes() -> dict[str, tuple[str | None, str | None]]:
    """mode -> (strategy for uniform decode keys, strategy for mixed-batch keys): each whole-step strategy alone, for
    decode only, and paired with each partial one; each partial strategy alone for mixed batches."""
    whole = [s.name for s in STRATEGIES if s.whole_step]
    partial = [s.name for s in STRATEGIES if not s.whole_step]
    modes: dict[str, tuple[str | None, str | None]] = {"none": (None, None)}
    modes.update({name: (name, name) for name in whole})
    modes.update({name: (None, name) for name in partial})
    modes.update({f"{name}_decode_only": (name, None) for name in whole})
    modes.update({f"{w}_and_{p}": (w, p) for w in whole for p in partial})
    return modes


MODES: dict[str, tuple[str | None, str | None]] = _modes()
