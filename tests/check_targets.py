"""Targets for `cgregistry check` in tests: one step with graph-unsafe ops, one without."""

import torch


def _step(x: torch.Tensor) -> torch.Tensor:
    n = int(x.sum().item())  # host sync
    kept = x[x > 0]  # data-dependent shape
    return kept * n


def unsafe() -> None:
    _step(torch.arange(4.0))


def safe() -> None:
    x = torch.arange(4.0)
    torch.where(x > 1, x, torch.zeros_like(x)).softmax(0)


def needs_args(x):  # noqa: ANN001, ANN201
    return x
