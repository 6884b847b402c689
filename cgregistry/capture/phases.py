"""Where a capture's seconds go: compiling, the warm-up, recording the step, and ending the graphs (the driver
instantiates them then), so that an engine author sees what to tune.

The capture job sets a phase clock for each key (``runtime.phase_clock``); the code that compiles or ends a graph
adds its span to it, and a compile by dynamo (``torch.compile``, ``reg.compile``: its trace and the backend's
compile) is timed by dynamo's own compile callbacks, registered here once the process has imported dynamo."""

from __future__ import annotations

import sys
import threading
from typing import Any

from cgregistry.state import runtime

__all__ = ["compile_ended", "compile_started", "watch_dynamo_compiles", "watching"]

_lock = threading.Lock()


def watching() -> bool:
    """Whether dynamo's compile callbacks are registered now (``torch._dynamo.reset()`` clears them: they go back
    at the next capture)."""
    callback = sys.modules.get("torch._dynamo.callback")
    return callback is not None and compile_started in callback.callback_handler.start_callbacks


def watch_dynamo_compiles() -> None:
    """Time dynamo's compiles into the capture in progress on their thread, from now on; does nothing until the
    process has imported dynamo (nothing compiles before that)."""
    if "torch._dynamo" not in sys.modules:
        return
    with _lock:
        if watching():
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(compile_started)
        callback_handler.register_end_callback(compile_ended)


def compile_started(args: Any = None) -> None:
    """Dynamo's start-of-compile callback: the compile phase of the capture on this thread begins."""
    runtime.begin_phase("compile")


def compile_ended(args: Any = None) -> None:
    """Dynamo's end-of-compile callback."""
    runtime.end_phase("compile")
