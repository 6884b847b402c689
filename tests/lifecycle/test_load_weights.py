"""reg.load_weights: a weight sync that keeps every graph.  A state dict, or (name, tensor) pairs streamed as a trainer
sends them, copied into the parameters and buffers the graphs read; checked whole before anything is written; tied
weights stay tied; under inference_mode and no_grad; never into memory torch did not allocate.  Eager is the oracle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.errors import OwnerThreadError
from cgregistry.testing import make_plugins
from cgregistry.weights.load import load_in_place
from tests.conftest import device_of
from tests.serving_threads import run_in_thread

WIDTH, VOCAB, MAX_TOKENS = 16, 50, 32
PLAN = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[8, 16, 32])


class TiedModel(torch.nn.Module):
    """An embedding and an LM head that share one weight (as Llama-3.2-1B's do), a layer and a buffer."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH, device=device)
        self.layer = torch.nn.Linear(WIDTH, WIDTH, device=device)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False, device=device)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((WIDTH,), 0.5, device=device))

    def forward(self, batch: B, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(self.embed(ids))) * self.scale)


class Captures:
    """Counts the captures that start."""

    def __init__(self) -> None:
        self.started = 0

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
        self.started += 1


def make(backend: str, captures: Captures | None = None) -> tuple[cg.GraphRegistry, TiedModel]:
    model = TiedModel(device_of(backend))
    reg = cg.GraphRegistry(model, {"ids": cg.StaticInput((MAX_TOKENS,), torch.long, fill=0)}, backend=backend,
                           plugins=make_plugins(captures or Captures()))
    with torch.inference_mode():
        reg.capture(PLAN)
    return reg, model


def trainer_state(model: torch.nn.Module, seed: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """New values for every name, in tensors of the trainer's own (tied names as two tensors of equal values, as a
    sync over the wire brings them)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "head.weight":
            state[name] = state["embed.weight"].clone()
        else:
            state[name] = torch.randn(tensor.shape, generator=g, dtype=tensor.dtype).to(device or tensor.device)
    return state


def served_equals_eager(reg: cg.GraphRegistry, model: TiedModel, n: int, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).to(model.scale.device)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(n), ids=ids), model(B.decode(n), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["state dict", "stream"])
def test_a_sync_loaded_in_place_keeps_every_graph_and_the_next_replay_computes_with_the_new_weights(backend: str, how: str) -> None:
    captures = Captures()
    reg, model = make(backend, captures)
    addresses = {name: t.data_ptr() for name, t in model.state_dict().items()}
    assert captures.started == len(reg) == len(PLAN)
    for sync in range(3):
        state = trainer_state(model, sync)
        with torch.inference_mode():
            loaded = reg.load_weights(state if how == "state dict" else iter(state.items()))
        assert loaded == tuple(state)
        for n in (3, 9, 20):
            served_equals_eager(reg, model, n, seed=sync * 10 + n)
        torch.testing.assert_close(model.layer.weight, state["layer.weight"])
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == addresses, "nothing moved"
    assert captures.started == len(reg) == len(PLAN), "no graph was captured again"
    assert reg.stats().hits == 9 and reg.stats().misses == 0
    assert reg.refresh().recaptured == ()


def test_the_models_own_forward_and_backward_work_after_a_sync_under_inference_mode() -> None:
    """Engines whose workers run under inference_mode load weights that way: the parameters stay ordinary tensors, so
    the model's own eager forward (and a backward, for a trainer sharing it) works after the sync."""
    reg, model = make("cpu")
    with torch.inference_mode():
        reg.load_weights(trainer_state(model, 1))
    assert not any(p.is_inference() for p in model.parameters())
    out = model(B.decode(4), torch.arange(4))
    out.sum().backward()
    assert model.layer.weight.grad is not None and model.layer.weight.requires_grad
    with torch.no_grad():
        reg.load_weights(trainer_state(model, 2))
    served_equals_eager(reg, model, 5, seed=3)


def test_tied_weights_stay_tied_and_two_values_for_them_are_refused() -> None:
    """A trainer sends both names of a tied tensor, as two tensors of one value (over the wire): one copy.  Two
    different values for one tensor cannot both be loaded: refused, nothing written."""
    reg, model = make("cpu")
    state = trainer_state(model, 4)
    assert state["head.weight"] is not state["embed.weight"]
    assert reg.load_weights(state) == tuple(state)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, state["embed.weight"])
    served_equals_eager(reg, model, 6, seed=4)
    before = model.layer.weight.clone()
    other = trainer_state(model, 5)
    other["head.weight"] = other["embed.weight"] + 1.0
    with pytest.raises(ValueError, match=r"head.weight: tied to embed.weight \(one tensor\), but given another value"):
        reg.load_weights(other)
    assert torch.equal(model.layer.weight, before), "nothing written"


def test_a_bad_sync_is_refused_whole_naming_every_problem_and_writes_nothing() -> None:
    reg, model = make("cpu")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    state = trainer_state(model, 5)
    state["layer.weight"] = torch.zeros(WIDTH, WIDTH + 1)
    state["layer.bias"] = state["layer.bias"].double()
    state["lyaer.bias"] = torch.zeros(WIDTH)
    with pytest.raises(ValueError, match="nothing written") as info:
        reg.load_weights(state)
    said = str(info.value)
    assert f"layer.weight: shape [{WIDTH}, {WIDTH + 1}], expected [{WIDTH}, {WIDTH}]" in said
    assert "layer.bias: dtype torch.float64, expected torch.float32" in said
    assert "lyaer.bias: no such parameter or buffer" in said
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items()), "a refused sync wrote nothing"
    with pytest.raises(ValueError, match="scale: given twice"):
        reg.load_weights([("scale", torch.ones(WIDTH)), ("scale", torch.ones(WIDTH))])
    with pytest.raises(TypeError, match="takes a state dict or \\(name, tensor\\) pairs"):
        reg.load_weights([("scale", [1.0] * WIDTH)])  # type: ignore[list-item]
    served_equals_eager(reg, model, 7, seed=5)


@pytest.mark.cuda
def test_a_source_on_another_device_is_refused_and_one_on_the_cpu_is_copied_over() -> None:
    reg, model = make("cuda")
    with pytest.raises(ValueError, match="device cuda:0, expected cpu|device .*, expected"):
        load_in_place(torch.nn.Linear(2, 2), {"weight": torch.zeros(2, 2, device="cuda")})
    reg.load_weights(trainer_state(model, 6, device=torch.device("cpu")))
    served_equals_eager(reg, model, 8, seed=6)


def test_the_module_loaded_is_the_one_the_step_reads_or_the_one_named() -> None:
    first, second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: second(first(x)), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                           backend="cpu")
    reg.capture(PLAN)
    with pytest.raises(ValueError, match=r"name the one to load into, module=...: the step reads 2 modules \['first', 'second'\]"):
        reg.load_weights({"weight": torch.zeros(WIDTH, WIDTH)})
    reg.load_weights({"weight": torch.eye(WIDTH), "bias": torch.zeros(WIDTH)}, module=second)
    x = torch.randn(5, WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(reg.run(B.decode(5), x=x), first(x))


def test_a_sync_from_another_thread_is_refused_and_handed_over_runs_before_the_next_step() -> None:
    reg, model = make("cpu")
    state = trainer_state(model, 7)
    finished, outcome = run_in_thread(lambda: reg.load_weights(state), timeout=30)
    assert finished and isinstance(outcome.get("error"), OwnerThreadError), outcome
    finished, outcome = run_in_thread(lambda: reg.call_on_owner(reg.load_weights, state), timeout=30)
    future = outcome["value"]
    assert not future.done()
    served_equals_eager(reg, model, 5, seed=7)  # the sync runs first: the step computes with the new weights
    assert future.result(timeout=0) == tuple(state)
    torch.testing.assert_close(model.layer.weight, state["layer.weight"])


def test_a_parameter_in_a_memory_mapped_file_is_refused_and_the_file_is_untouched(tmp_path: Path) -> None:
    """A weight loaded zero-copy from ``np.memmap(mode="r+")`` is the checkpoint on disk: writing it would change the
    file.  The loader refuses before anything is written."""
    path = tmp_path / "weights.bin"
    np.arange(WIDTH * WIDTH, dtype=np.float32).tofile(path)
    model = torch.nn.Linear(WIDTH, WIDTH, bias=False)
    model.weight = torch.nn.Parameter(torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+", shape=(WIDTH, WIDTH))))
    reg = cg.GraphRegistry(lambda batch, x: model(x), {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)},
                           backend="cpu", watch=[model])
    reg.capture(PLAN)
    with pytest.raises(ValueError, match=r"weight: its memory is mapped from .*weights\.bin \(shared\)"):
        reg.load_weights({"weight": torch.zeros(WIDTH, WIDTH)})
    assert np.array_equal(np.fromfile(path, dtype=np.float32), np.arange(WIDTH * WIDTH, dtype=np.float32))


READ_ONLY_MAPPING = """
import warnings
import numpy as np
import torch
from cgregistry.weights.load import load_in_place

np.arange(64, dtype=np.float32).tofile(PATH)
model = torch.nn.Linear(8, 8, bias=False)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that the array is not writable
    model.weight = torch.nn.Parameter(torch.from_numpy(np.memmap(PATH, dtype=np.float32, mode="r", shape=(8, 8))))
try:
    load_in_place(model, {"weight": torch.zeros(8, 8)})
except ValueError as exc:
    assert "weights.bin (read-only)" in str(exc), exc
    print("refused")
"""


def test_a_parameter_in_a_read_only_mapping_is_refused_without_a_crash(tmp_path: Path) -> None:
    """With ``mode="r"`` a write would fault and kill the process: the loader refuses first (in a process of its own)."""
    code = READ_ONLY_MAPPING.replace("PATH", repr(str(tmp_path / "weights.bin")))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "refused", (done.returncode, done.stderr[-2000:])


def test_an_inference_tensor_outside_inference_mode_is_refused_before_anything_is_written() -> None:
    """A buffer the step registers at its first call, under the inference mode capture ran in, is an inference tensor:
    torch refuses an update to it outside inference mode, so the loader refuses the whole sync first, naming it."""

    class Lazy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
            if not hasattr(self, "scale"):
                self.register_buffer("scale", torch.ones(WIDTH), persistent=False)
            return self.lin(x) * self.scale

    model = Lazy()
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu")
    with torch.inference_mode():
        reg.capture(PLAN)
    assert model.scale.is_inference()
    before = model.lin.weight.clone()
    state = {"lin.weight": torch.zeros(WIDTH, WIDTH), "scale": torch.full((WIDTH,), 2.0)}
    with pytest.raises(ValueError, match=r"scale: an inference tensor .*load under torch.inference_mode\(\)"):
        reg.load_weights(state)
    assert torch.equal(model.lin.weight, before), "nothing written"
    with torch.inference_mode():
        assert reg.load_weights(state) == ("lin.weight", "scale")
        x = torch.randn(5, WIDTH)
        torch.testing.assert_close(reg.run(B.decode(5), x=x), model(B.decode(5), x))


def test_weights_loaded_by_torch_load_are_written_and_shared_memory_is_refused(tmp_path: Path) -> None:
    """A model loaded from a checkpoint (torch.load, memory-mapped copy-on-write too) holds memory of its own: the
    loader writes it, and the file stays as it was.  Memory shared with other processes (share_memory_()) is not
    written."""
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(WIDTH, WIDTH).state_dict(), path)
    for mmap in (False, True):
        model = torch.nn.Linear(WIDTH, WIDTH)
        model.load_state_dict(torch.load(path, mmap=mmap), assign=True)
        load_in_place(model, {"weight": torch.ones(WIDTH, WIDTH)})
        assert torch.equal(model.weight, torch.ones(WIDTH, WIDTH))
        assert not torch.equal(torch.load(path)["weight"], torch.ones(WIDTH, WIDTH)), "the checkpoint is untouched"
    shared = torch.nn.Linear(WIDTH, WIDTH).share_memory()
    with pytest.raises(ValueError, match=r"weight: its memory is mapped from /dev/shm/.*\(shared\)"):
        load_in_place(shared, {"weight": torch.ones(WIDTH, WIDTH)})


def test_a_module_the_step_does_not_read_is_refused() -> None:
    reg, model = make("cpu")
    stranger = torch.nn.Linear(WIDTH, WIDTH)
    with pytest.raises(ValueError, match=r"module=... is not a module the step reads: the step reads 1 modules \['step'\]"):
        reg.load_weights({"weight": torch.zeros(WIDTH, WIDTH)}, module=stranger)
    reg.load_weights({"weight": torch.eye(WIDTH), "bias": torch.zeros(WIDTH)}, module=model.layer)  # a part of it: fine
    torch.testing.assert_close(model.layer.weight, torch.eye(WIDTH))
