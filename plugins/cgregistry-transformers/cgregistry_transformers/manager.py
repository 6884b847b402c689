"""The switch: a continuous-batching manager whose forwards cgregistry serves, through transformers' own entry points."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

import cgregistry as cg

from .runner import GraphRunner
from .settings import GraphSettings


def serving_config(config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """A copy of ``config`` (or the default) for a manager cgregistry serves: transformers' own graphs and compiled
    paths off, synchronous batching; asking for any of them is refused, naming it."""
    config = ContinuousBatchingConfig() if config is None else copy.deepcopy(config)
    if not isinstance(config, ContinuousBatchingConfig):
        raise TypeError(f"continuous_batching_config must be a ContinuousBatchingConfig, got {config!r}")
    graphs = config.use_cuda_graph
    if graphs not in (None, False) and any(graphs if isinstance(graphs, tuple) else (graphs,)):
        raise ValueError(f"ContinuousBatchingConfig(use_cuda_graph={graphs!r}) with cgregistry's graphs: choose one "
                         "(leave use_cuda_graph unset)")
    if config.use_async_batching:
        raise ValueError("ContinuousBatchingConfig(use_async_batching=True): cgregistry-transformers serves "
                         "synchronous batching only (leave it unset)")
    for name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(config, name, None) is not None:
            raise ValueError(f"ContinuousBatchingConfig({name}=...) with cgregistry's graphs: a compiled forward is "
                             "not served through the registry; leave it unset")
    config.use_cuda_graph = False
    config.use_async_batching = False
    return config


def attach(manager: Any, graphs: GraphSettings | None = None) -> Any:
    """Serve ``manager``'s forwards through a ``GraphRegistry`` from its next session on; returns the manager.

    Call it before ``manager.start()``.  The manager's batch processor (and its KV cache) is made now, so that
    ``registry_of(manager)`` can estimate memory before serving.  Its own model runner, with its CUDA graphs or compiled
    forwards if its config asked for them, is replaced.  A manager served already keeps the settings it has."""
    if graphs is not None and not isinstance(graphs, GraphSettings):
        raise TypeError(f"graphs must be a cgregistry_transformers.GraphSettings, got {graphs!r}")
    if not all(hasattr(manager, name) for name in ("is_running", "batch_processor", "continuous_batching_config")):
        raise TypeError(f"attach() takes a ContinuousBatchingManager (model.init_continuous_batching(...)), got "
                        f"{type(manager).__name__}")
    if manager.is_running():
        raise RuntimeError("attach() on a running manager: call it before manager.start() (or after manager.stop())")
    if registry_of(manager) is not None:
        kept = manager.batch_processor.model_runner.settings
        if graphs is not None and graphs != kept:
            warnings.warn(f"attach(): the manager is served already, with {kept}; {graphs} is not applied (a new "
                          "manager takes new settings)", RuntimeWarning, stacklevel=2)
        return manager
    if manager.continuous_batching_config.use_async_batching:
        raise ValueError("attach() on a manager with use_async_batching=True: cgregistry-transformers serves "
                         "synchronous batching only")
    if manager.batch_processor is None:
        manager.batch_processor = manager._create_batch_processor()
    processor = manager.batch_processor
    processor.model_runner = GraphRunner(processor.model_runner, manager.model, graphs or GraphSettings())
    return manager


def registry_of(manager: Any) -> cg.GraphRegistry | None:
    """The ``GraphRegistry`` serving ``manager`` (entries, stats, explain, estimate_memory), or None if none does; given
    a model, the one serving the manager it keeps (``persistent_manager=True``)."""
    manager = getattr(manager, "_cached_continuous_batching_manager", manager)  # a model: its kept manager
    processor = getattr(manager, "batch_processor", None)
    runner = getattr(processor, "model_runner", None)
    return runner.registry if isinstance(runner, GraphRunner) else None


def init_continuous_batching(model: Any, generation_config: GenerationConfig | None = None,
                             continuous_batching_config: ContinuousBatchingConfig | None = None, *,
                             graphs: GraphSettings | None = None, **kwargs: Any) -> Any:
    """``model.init_continuous_batching(...)`` with cgregistry serving the manager's forwards.  A manager the model
    keeps is reused, its configs as they are (as transformers reuses it), and served from its next session on."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        return attach(model.init_continuous_batching(generation_config=generation_config, **kwargs), graphs)
    manager = model.init_continuous_batching(generation_config=generation_config,
                                             continuous_batching_config=serving_config(continuous_batching_config),
                                             **kwargs)
    return attach(manager, graphs)


@torch.no_grad()
def generate_batch(model: Any, inputs: Sequence[Sequence[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None, *,
                   graphs: GraphSettings | None = None, persistent_manager: bool = False, **kwargs: Any) -> dict:
    """``model.generate_batch(inputs, ...)`` with cgregistry serving the forwards.  With ``persistent_manager=True`` the
    manager (and its graphs) is kept on the model for the next call, as transformers keeps its own."""
    if not inputs:
        return {}
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is None or registry_of(cached) is None:  # none kept, or one without graphs (or dropped by a stop())
        config = generation_config if generation_config is not None else model.generation_config
        returns = config.num_return_sequences or 1
        new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
        hints = WorkloadHints(max_prompt_length=max(len(p) for p in inputs), max_generated_length=new_tokens or 0,
                              num_requests=len(inputs) * returns)  # as generate_batch sizes a manager of its own
        manager = init_continuous_batching(model, generation_config, continuous_batching_config, graphs=graphs,
                                           workload_hints=hints)
        model._cached_continuous_batching_manager = manager  # generate_batch serves through the cached manager
    elif graphs is not None:
        attach(cached, graphs)  # served already: its own settings stay (a warning if these differ)
    try:
        return model.generate_batch(inputs, generation_config=generation_config, persistent_manager=persistent_manager,
                                    **kwargs)
    finally:
        if not persistent_manager:  # transformers drops the processor (and the graphs) but not the cached reference
            model.__dict__.pop("_cached_continuous_batching_manager", None)
