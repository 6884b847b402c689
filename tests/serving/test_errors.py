"""Errors cross process boundaries (a multi-process engine forwards a worker's error), and a registry's own
snapshot loads back whatever numbers its constructor accepted."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import numpy as np
import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.backends.cpu import GraphUnsafeOpError
from cgregistry.errors import CaptureError
from cgregistry.errors import CgregistryError


def round_trip(error: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(error))


def test_a_capture_error_from_a_real_capture_unpickles_with_its_key_and_strategy() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("the step broke")

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    with pytest.raises(CaptureError) as caught:
        reg.capture([(B(8, 2), "full")])
    back = round_trip(caught.value)
    assert type(back) is CaptureError and isinstance(back, RuntimeError)
    assert str(back) == str(caught.value) and "ZeroDivisionError: the step broke" in str(back)
    assert (back.descriptor, back.strategy) == (B(8, 2), "full")


def test_a_graph_unsafe_op_error_unpickles_with_op_why_and_where() -> None:
    error = GraphUnsafeOpError("aten::item", "a host sync", "step.py:12: n = x.item()")
    error.add_note("raised while capturing Batch(tokens=8)")
    back = round_trip(error)
    assert type(back) is GraphUnsafeOpError and str(back) == str(error)
    assert (back.op, back.why, back.where) == ("aten::item", "a host sync", "step.py:12: n = x.item()")
    assert back.__notes__ == ["raised while capturing Batch(tokens=8)"]


def all_error_classes() -> list[type[CgregistryError]]:
    """Every CgregistryError subclass the package defines (its modules imported first)."""
    for info in pkgutil.walk_packages(cg.__path__, "cgregistry."):
        if info.name.split(".")[-1] not in ("__main__",):
            importlib.import_module(info.name)
    found, todo = [], [CgregistryError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return [c for c in found if c.__module__.startswith("cgregistry")]


def test_every_error_class_of_the_package_unpickles_as_itself() -> None:
    classes = all_error_classes()
    assert {CaptureError, GraphUnsafeOpError, cg.InputError, cg.SnapshotError} <= set(classes)
    for cls in classes:
        error = cls.__new__(cls, f"a {cls.__name__}")  # whatever its constructor takes, its message
        error.detail = 7
        back = round_trip(error)
        assert type(back) is cls and str(back) == f"a {cls.__name__}" and back.detail == 7, cls


def small_registry(**cap: object) -> cg.GraphRegistry:
    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", **cap)
    reg.capture([(B(8), "full"), (B(16), "full")])
    return reg


def test_a_numpy_padding_ratio_round_trips_through_the_snapshot() -> None:
    reg = small_registry(max_padding_ratio=np.float64(0.5))
    data = reg.snapshot()
    assert type(data["max_padding_ratio"]) is float  # plain JSON, whatever number type the engine passed
    snap = cg.load_snapshot(data)
    assert snap.max_padding_ratio == 0.5
    assert snap.explain(B(6)).match.key == B(8)  # 2 padding tokens for 6 real: within the cap
    assert snap.explain(B(9)).match is None  # 7 padding tokens for 9 real: over it, as the registry refused


@pytest.mark.parametrize("value", [np.float64(0.25), np.float32(0.25), np.int64(1)])
def test_load_snapshot_takes_numpy_numbers_where_json_has_numbers(value: object) -> None:
    data = small_registry().snapshot()
    data["max_padding_ratio"] = value
    data["entries"][0]["capture_seconds"] = value
    snap = cg.load_snapshot(data)
    assert snap.max_padding_ratio == float(value) and snap.entries[0].capture_seconds == float(value)


@pytest.mark.parametrize("value", [True, np.float64("nan"), -0.5, "0.5"])
def test_load_snapshot_still_refuses_what_is_not_a_ratio(value: object) -> None:
    data = small_registry().snapshot()
    data["max_padding_ratio"] = value
    with pytest.raises(cg.SnapshotError, match="snapshot field max_padding_ratio: expected a finite number >= 0"):
        cg.load_snapshot(data)


def test_inputs_passed_by_position_are_refused_naming_the_registry_method() -> None:
    for debug in (False, True):
        reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", debug=debug)
        with pytest.raises(TypeError, match=r"GraphRegistry\.run\(\) takes 2 positional arguments but 3 were given"):
            reg.run(B(2), torch.ones(2))
        torch.testing.assert_close(reg.run(B(2), x=torch.ones(2)), torch.full((2,), 2.0))
