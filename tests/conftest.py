"""Shared fixtures: backends to run strategy tests on (cpu always, cuda when present)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cgregistry as cg

HAS_CUDA = torch.cuda.is_available()

pytest_plugins = ["cgregistry.testing"]  # its fixtures, as a plugin author would use them


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """CUDA tests are skipped without a GPU (slow tests are left out by pyproject's ``-m 'not slow'``)."""
    if HAS_CUDA:
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(no_gpu)


BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each graph backend in turn: the emulator everywhere, CUDA where there is a GPU."""
    return request.param


@pytest.fixture
def plugins() -> cg.Plugins:
    return cg.Plugins()


def device_of(backend: str) -> torch.device:
    return torch.device("cuda") if backend == "cuda" else torch.device("cpu")


def capture_warned_of_attributes(reg: cg.GraphRegistry, plan: object) -> None:
    """``reg.capture(plan)`` of a step that reads its model through an engine object's attributes: the one warning is
    that run() does not see the attribute rebound (and nothing else is warned about)."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        reg.capture(plan)  # type: ignore[arg-type]
    said = [str(w.message) for w in warned]
    assert len(said) == 1 and "through attributes of plain objects: a weight replaced inside is caught" in said[0], said


def capture_quietly(reg: cg.GraphRegistry, plan: object) -> None:
    """``reg.capture(plan)``, failing the test on any warning it gives (a false alarm is a defect too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg.capture(plan)  # type: ignore[arg-type]
