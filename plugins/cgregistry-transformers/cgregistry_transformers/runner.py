"""The model runner a continuous-batching manager calls each step, serving the forward through a ``GraphRegistry``.

transformers' ``ContinuousBatchProcessor`` asks its ``model_runner`` four things: ``pad_inputs``,
``maybe_pad_inputs``, ``compute_batch`` and ``warmup``.  ``GraphRunner`` answers them and leaves the rest (logits
processing, sampling, the output tensors) to transformers' own runner: its batches stay unpadded (the matcher pads),
and the forward inside its ``compute_batch`` is a registry ``run()``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import torch
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

import cgregistry as cg

from .attention import NAME, LiveBatch, TransformersAttention
from .settings import GraphSettings
from .switch import own_implementation, served_step


class Logits:
    """What transformers reads of a model's output here: ``.logits``, (1, requests, vocab)."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class GraphRunner:
    """transformers' model runner with the forward served by cgregistry's graphs (attention as eager breaks)."""

    def __init__(self, runner: Any, model: torch.nn.Module, settings: GraphSettings) -> None:
        io = runner.inputs_and_outputs
        if not isinstance(io, ContinuousBatchingIOs):  # the asynchronous pair of IOs is another class
            raise ValueError(f"cgregistry-transformers serves synchronous batching only; the manager uses "
                             f"{type(io).__name__}: pass ContinuousBatchingConfig(use_async_batching=False)")
        self.runner = runner  # transformers' own: logits processing, sampling, the output tensors
        self.model = model
        self.settings = settings
        self.io = io
        self.pad_inputs = False  # batches stay unpadded: the registry pads them to the closest captured key
        text = model.config.get_text_config()  # the decoder's config (the model's own, unless it has a vision tower)
        self.attention = TransformersAttention(own_implementation(text), runner.cache, text, io.device, model.dtype)
        self.max_requests = runner.cb_config.max_requests_per_batch
        self.max_tokens = runner.cache.max_batch_tokens
        self.plan = settings.plan_for(self.max_requests, self.max_tokens)
        too_large = [e.descriptor for e in self.plan if e.descriptor.num_tokens > self.max_tokens
                     or (e.descriptor.num_reqs or 0) > self.max_requests]
        if too_large:
            raise ValueError(f"GraphSettings.plan key {too_large[0]} does not fit the manager's batches: "
                             f"max_batch_tokens={self.max_tokens}, max_requests_per_batch={self.max_requests} "
                             "(ContinuousBatchingConfig); build the plan with those limits")
        self.registry = self._registry(model, io.input_ids.dtype, io.device)
        self._serving = threading.current_thread()  # the thread object, not its ident: idents are reused
        self._captured = False

    def _registry(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> cg.GraphRegistry:
        config = model.config.get_text_config()  # the decoder's layers read theirs; a vision tower's is left alone

        def step(batch: cg.BatchDescriptor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 logits_indices: torch.Tensor) -> torch.Tensor:
            with served_step(config, NAME):
                out = model(input_ids=input_ids[None], position_ids=position_ids[None], logits_to_keep=logits_indices,
                            use_cache=False)
            return out.logits[0]  # (requests, vocab): the logits of each request's last token

        inputs = {
            "input_ids": cg.StaticInput((self.max_tokens,), dtype, fill=0),
            "position_ids": cg.StaticInput((self.max_tokens,), dtype, fill=0),
            "logits_indices": cg.StaticInput((self.max_requests,), dtype, axis="reqs", fill=0),
        }
        backend = "cuda" if device.type == "cuda" else "cpu"
        return cg.GraphRegistry(step, inputs, backend=backend, output_axis="reqs", debug=self.settings.debug,
                                capture_budget=self.settings.capture_budget, name="transformers-cb")

    # ------------------------------------------------------------------ what the batch processor calls

    def maybe_pad_inputs(self, num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool) -> tuple[int, int]:
        """No interval or power-of-two padding: the matcher pads each batch to the closest key."""
        return num_q_tokens, max_kv_read

    def warmup(self, model: torch.nn.Module) -> None:
        """Nothing ahead of serving: the plan is captured on the serving thread, from its first step."""

    def compute_batch(self, model: torch.nn.Module, batch_data: dict[str, Any]) -> None:
        """One step: the forward through the registry, then transformers' own logits processing and sampling."""
        if model is not self.model:
            raise ValueError("this GraphRunner serves the model it was attached with, not another one")
        if threading.current_thread() is not self._serving:  # the manager serves each session from a fresh thread
            self.registry.adopt()
            self._serving = threading.current_thread()
        if not self._captured:
            self._captured = True
            when = self.settings.capture
            try:
                self.registry.capture(self.plan, background=when == "background", lazy=when == "first use")
            except cg.CaptureError as exc:  # the keys captured serve; a failed key costs its batches speed, not requests
                warnings.warn(f"cgregistry-transformers: {exc}; the manager serves on, the batches no captured key "
                              "serves run eagerly (registry_of(manager).failures())", RuntimeWarning, stacklevel=2)
        io = self.io
        carry_over_ids, prev_output_ids, output_ids = io.get_cb_kwargs()
        batch_data["logits_to_keep"] = batch_data["logits_indices"]  # the step keeps only these rows' logits
        stream = io.compute_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.runner._forward_process_and_sample(self.forward, batch_data, carry_over_ids, prev_output_ids,
                                                    output_ids)

    def forward(self, **batch_data: Any) -> Logits:
        """The model's forward for the batch transformers prepared, served by the registry."""
        io = self.io
        tokens, requests = io.num_q_tokens, io.num_request_in_batch
        actual = cg.BatchDescriptor.decode(requests) if tokens == requests else cg.BatchDescriptor(tokens, requests)
        live = LiveBatch(batch_data, tokens, self.attention)
        inputs = dict(input_ids=batch_data["input_ids"][0], position_ids=batch_data["position_ids"][0],
                      logits_indices=batch_data["logits_indices"])
        try:
            logits = self.registry.run(actual, context=live, **inputs)
        except cg.WeightsMovedError:  # weights replaced while the manager was paused or stopped: capture them again
            self.registry.refresh()
            logits = self.registry.run(actual, context=live, **inputs)
        return Logits(logits[None])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)  # anything else transformers asks of its runner
