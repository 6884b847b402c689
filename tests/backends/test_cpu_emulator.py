"""The cpu backend behaves like a CUDA graph: frozen control flow, stale inputs, forbidden ops."""

from __future__ import annotations

import pytest
import torch

from cgregistry.errors import GraphUnsafeOpError
from cgregistry.backends.cpu import CpuBackend, find_graph_unsafe_ops

backend = CpuBackend()


def capture(fn):
    with torch.inference_mode():
        return backend.capture(fn, backend.new_pool())


def test_replay_recomputes_from_static_input() -> None:
    x = torch.ones(4)
    w = torch.full((4,), 2.0)
    graph, out = capture(lambda: (x * w).sum(0, keepdim=True) + 1)
    assert out.item() == 9.0
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert out.item() == 13.0  # 2 * (0+1+2+3) + 1


def test_forgotten_copy_gives_stale_result_like_cuda() -> None:
    x = torch.ones(3)
    graph, out = capture(lambda: x * 3)
    new_x = torch.full((3,), 5.0)  # the bug: rebinding instead of copying into the static input
    graph.replay()
    assert torch.equal(out, torch.full((3,), 3.0)), "replay reads the captured tensor, not the new one"
    x.copy_(new_x)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 15.0))


def test_python_control_flow_is_frozen() -> None:
    x = torch.ones(2)
    flag = {"double": True}

    def fn():
        return x * 2 if flag["double"] else x * 10

    graph, out = capture(fn)
    flag["double"] = False
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 6.0))


def test_inplace_and_view_ops_replay_in_order() -> None:
    x = torch.zeros(2, 3)

    def fn():
        y = x.t().contiguous()  # a real copy: x.t() is not contiguous
        z = y.reshape(6)  # a view of y
        z.add_(1)
        acc = torch.zeros(6)
        acc.index_add_(0, torch.tensor([0, 0, 1, 1, 2, 2]), z)
        return acc

    graph, out = capture(fn)
    x.copy_(torch.arange(6.0).view(2, 3))
    graph.replay()
    expected = fn()
    assert torch.equal(out, expected)


def test_reshape_that_copies_is_refreshed() -> None:
    x = torch.zeros(3, 2)

    def fn():
        return x.t().reshape(6) * 1  # reshape of a transposed tensor must copy

    graph, out = capture(fn)
    x.copy_(torch.arange(6.0).view(3, 2))
    graph.replay()
    assert torch.equal(out, torch.tensor([0.0, 2, 4, 1, 3, 5]))


def test_memory_counts_fresh_storage_only() -> None:
    x = torch.ones(1000)
    graph, _ = capture(lambda: (x * 2).view(10, 100) + 1)
    assert graph.memory_bytes == 2 * 1000 * 4, "two fresh float tensors; views and inputs are not counted"


def _unsafe_item(x):
    return x * x.sum().item()


@pytest.mark.parametrize(
    ("fn", "op", "why"),
    [
        (_unsafe_item, "item", "host"),
        (lambda x: torch.nonzero(x), "nonzero", "data"),
        (lambda x: x[x > 0], "index", "boolean-mask"),
        (lambda x: x * 2 if x.sum() > 0 else x, "is_nonzero", "host"),
        (lambda x: x.cpu() * 1, "Tensor.cpu", "host"),
        (lambda x: x * len(x.tolist()), "Tensor.tolist", "host"),
        (lambda x: x * float(x.numpy()[0]), "Tensor.numpy", "host"),
        (lambda x: x.to("cpu") * 1, "Tensor.to", "host"),
        (lambda x: x.to(device="cpu", non_blocking=True) * 1, "Tensor.to", "host"),
        (lambda x: torch.unique(x), "unique", "data"),
        (lambda x: torch.masked_select(x, x > 1), "masked_select", "data"),
    ],
)
def test_graph_unsafe_ops_raise_with_op_and_line(fn, op: str, why: str) -> None:
    x = torch.arange(4.0)
    with pytest.raises(GraphUnsafeOpError) as info:
        capture(lambda: fn(x))
    err = info.value
    assert op in err.op
    assert why in err.why
    assert "test_cpu_emulator.py" in err.where and err.where.split(":")[1].isdigit()


def test_explicit_device_copy_to_host_is_flagged() -> None:
    x = torch.arange(4.0)
    with pytest.raises(GraphUnsafeOpError, match="copies device memory to the host"):
        capture(lambda: x.to(device="cpu", dtype=torch.float64))


@pytest.mark.parametrize(
    "move",
    [
        lambda x: x.to(x.device, torch.float64),
        lambda x: x.to(device=x.device, dtype=torch.float64),
        lambda x: x.to(device=x.device).double(),
        lambda x: x.to(dtype=torch.float64, device=torch.device(x.device.type)),  # how dynamo's code spells it
        lambda x: x.to(torch.empty(0, dtype=torch.float64)),
    ],
)
def test_same_device_moves_are_not_flagged(move) -> None:
    """What the op does decides, not how the line is spelled: a move to the tensor's own device is legal."""
    x = torch.arange(4.0)
    graph, out = capture(lambda: move(x) * 2)
    x.fill_(1.0)
    graph.replay()
    assert torch.equal(out, torch.full((4,), 2.0, dtype=torch.float64))


def test_checker_lists_python_level_host_transfers() -> None:
    x = torch.arange(4.0)
    found = find_graph_unsafe_ops(lambda: (x.cpu(), x.tolist(), x.to(x.device, torch.float64)))
    assert [e.op for e in found] == ["Tensor.cpu", "Tensor.tolist"]


def test_error_points_at_the_users_line() -> None:
    x = torch.arange(4.0)
    with pytest.raises(GraphUnsafeOpError) as info:
        capture(lambda: _unsafe_item(x))
    assert "return x * x.sum().item()" in info.value.where


def test_find_graph_unsafe_ops_lists_all() -> None:
    x = torch.arange(4.0)

    def step():
        a = x.sum().item()
        b = torch.nonzero(x)
        return a, b

    found = find_graph_unsafe_ops(step)
    assert [f.op.split(".")[1] for f in found] == ["item", "nonzero"]


def test_nested_capture_is_refused() -> None:
    x = torch.ones(2)

    def outer():
        capture(lambda: x + 1)
        return x * 2

    with pytest.raises(RuntimeError, match="nested capture"):
        capture(outer)


def test_random_ops_draw_again_on_replay() -> None:
    graph, out = capture(lambda: torch.rand(1000))
    before = out.clone()
    graph.replay()
    assert not torch.equal(before, out)
