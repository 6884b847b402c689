"""Every hook a cgregistry plugin can implement, and nothing else.

Hooks are prefixed ``cgregistry_``.  Registration hooks receive a ``register``
callback so that cgregistry owns storage and duplicate rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "cgregistry"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def cgregistry_register_strategies(register: Callable[[Any], None]) -> None:
    """Register capture strategies by calling ``register(strategy)`` once per strategy.

    :param register: takes an object with ``name: str``, ``relaxes_num_reqs: bool``
        and ``capture(body, backend, pool) -> (graph, outputs)``.  A name already
        registered by another plugin is an error that names both plugins.

    Called once per plugin manager, each plugin in turn.  Since 0.1.
    """


@hookspec
def cgregistry_register_backends(register: Callable[[Any], None]) -> None:
    """Register graph backends by calling ``register(backend)`` once per backend.

    :param register: takes an object implementing :class:`cgregistry.backends.Backend`
        (``name``, ``is_available``, ``device``, ``new_pool``, ``warmup``,
        ``capture``, ``share_outputs``, ``recover_pool``, ``synchronize``).  Duplicate names are an
        error that names both plugins.

    Called once per plugin manager, each plugin in turn.  Since 0.1.
    """
