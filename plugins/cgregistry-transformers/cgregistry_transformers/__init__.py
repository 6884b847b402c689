"""cgregistry as the CUDA-graph layer of transformers' continuous batching.

``attach(manager)`` makes a ``ContinuousBatchingManager`` serve its forwards through a ``GraphRegistry``; 
``init_continuous_batching`` and ``generate_batch`` are transformers' own entry points with that switch on.
"""

from __future__ import annotations

from .versions import SUPPORTED, UnsupportedTransformersVersion, check_version

check_version()

from .manager import attach, generate_batch, init_continuous_batching, registry_of  # noqa: E402
from .runner import GraphRunner  # noqa: E402
from .settings import GraphSettings  # noqa: E402

__all__ = ["SUPPORTED", "GraphRunner", "GraphSettings", "UnsupportedTransformersVersion", "attach", "check_version",
           "generate_batch", "init_continuous_batching", "registry_of"]
__version__ = "0.1.0"
