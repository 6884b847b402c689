"""The cuda backend replays a graph through its C++ method, skipping torch's Python wrapper only where the wrapper
would do nothing (``direct_replay``): the rule on stand-ins here, the real CUDAGraph on a GPU."""

from __future__ import annotations

import types

import pytest
import torch

import cgregistry as cg
from cgregistry.backends.cuda import direct_replay

from .test_serving_safety import B


class Graph:
    """A stand-in for torch.cuda.CUDAGraph: what ran, in order."""

    def __init__(self, tracker: object = None) -> None:
        self._tracker = tracker
        self.ran: list[str] = []


def c_replay(graph: Graph) -> None:
    graph.ran.append("c++")


def torch_like_wrapper(self: Graph) -> None:  # torch's CUDAGraph.replay, name for name (never called here)
    if self._tracker is not None:
        self._tracker.check_alive(self.pool())
    super().replay()  # type: ignore[misc]


def wrapper_with_more_work(self: Graph) -> None:
    self.ran.append("wrapper")
    self.sync_after_replay = True


def test_a_wrapper_that_only_checks_the_liveness_tracker_is_skipped() -> None:
    graph = Graph()
    replay = direct_replay(graph, wrapper=torch_like_wrapper, c_replay=c_replay)
    replay()
    replay()
    assert graph.ran == ["c++", "c++"]
    assert isinstance(replay, types.MethodType) and replay.__self__ is graph


@pytest.mark.parametrize(("graph", "wrapper", "c", "why"), [
    (Graph(tracker=object()), torch_like_wrapper, c_replay, "the graph was captured with check_input_liveness=True"),
    (Graph(), wrapper_with_more_work, c_replay, "the wrapper does more than the tracker check"),
    (Graph(), len, c_replay, "the wrapper's code cannot be read"),
    (Graph(), torch_like_wrapper, None, "no C++ replay to call"),
])
def test_the_wrapper_is_kept_where_it_has_work(graph: Graph, wrapper: object, c: object, why: str) -> None:
    graph.replay = lambda: graph.ran.append("wrapper")  # type: ignore[attr-defined]
    direct_replay(graph, wrapper=wrapper, c_replay=c)()
    assert graph.ran == ["wrapper"], why


def test_a_class_without_a_wrapper_binds_the_cpp_method_itself() -> None:
    graph = Graph()
    direct_replay(graph, wrapper=c_replay, c_replay=c_replay)()
    assert graph.ran == ["c++"]


def test_this_torchs_wrapper_is_one_the_rule_skips() -> None:
    """Fails when torch's CUDAGraph.replay starts doing more: the cuda backend then keeps calling it (look again)."""
    wrapper = torch.cuda.CUDAGraph.replay
    names = set(getattr(wrapper, "__code__", types.SimpleNamespace(co_names=())).co_names)
    assert names <= {"_tracker", "check_alive", "pool", "super", "replay"}, names


@pytest.mark.cuda
def test_a_captured_graph_replays_through_the_cpp_method_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.zeros(8, 3, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2 + 1  # warm-up off the default stream, as torch's recipe asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    replay = direct_replay(graph)
    assert isinstance(replay, types.MethodType) and replay.__self__ is graph
    assert replay.__func__ is torch._C._CUDAGraph.replay
    for _ in range(3):
        fresh = torch.randn(8, 3, device="cuda")
        x.copy_(fresh)
        replay()
        torch.testing.assert_close(y, fresh * 2 + 1)


@pytest.mark.cuda
def test_the_registry_serves_through_the_direct_replay() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reg = cg.GraphRegistry(lambda b, x: x * 2 + 1, {"x": cg.StaticInput((8, 3), torch.float32)}, backend="cuda")
    reg.capture([(B(8), "full"), (B(4), "breakable")])
    for n in (5, 3, 8, 2):
        x = torch.randn(n, 3, device="cuda")
        torch.testing.assert_close(reg.run(B(n), x=x), x * 2 + 1)
    assert reg.stats().hits == 4
