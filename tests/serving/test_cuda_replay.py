"""The cuda backend replays a graph through its C++ method, skipping torch's Python wrapper only where the wrapper
would do nothing (``direct_replay``): the rule on stand-ins here, the real CUDAGraph on a GPU."""

from __future__ import annotations

import functools
import types

import pytest
import torch

import cgregistry as cg
from cgregistry.backends.cuda import direct_replay

from .test_serving_safety import B


class Base:
    """Stands in for torch._C._CUDAGraph."""

    def replay(self) -> None:
        self.ran.append("c++")  # type: ignore[attr-defined]


class Graph(Base):
    """A stand-in for torch.cuda.CUDAGraph: what ran, in order; its ``replay`` has the code of torch 2.13's."""

    def __init__(self, tracker: object = None) -> None:
        self._tracker = tracker
        self.ran: list[str] = []

    def replay(self) -> None:
        if self._tracker is not None:
            self._tracker.check_alive(self.pool())  # type: ignore[attr-defined]
        super().replay()

    def torch_211_replay(self) -> None:
        super().replay()

    def replay_twice(self) -> None:  # the same names as torch's, one more call: not a known shape either way
        self.ran.append("wrapper")
        super().replay()


def hooked(fn: object) -> object:
    """A decorated replay (an NVTX range, a counter): the hook lives in a closure, not in the code's names."""
    ran: list[str] = []

    @functools.wraps(fn)  # type: ignore[arg-type]
    def wrapper(self: Graph) -> None:
        ran.append("hook")
        fn(self)  # type: ignore[operator]

    return wrapper


def replay_helper(self: Graph) -> None:
    replay(self)


def replay(graph: Graph) -> None:  # a module-level helper named like the method
    graph.ran.append("helper")


def direct(graph: Graph, wrapper: object, c: object = Base.replay) -> None:
    graph.replay = lambda: graph.ran.append("wrapper")  # type: ignore[method-assign]
    direct_replay(graph, wrapper=wrapper, c_replay=c)()


@pytest.mark.parametrize("wrapper", [Graph.replay, Graph.torch_211_replay], ids=["torch 2.13", "torch 2.11"])
def test_a_wrapper_that_only_checks_the_liveness_tracker_is_skipped(wrapper: object) -> None:
    graph = Graph()
    replay = direct_replay(graph, wrapper=wrapper, c_replay=Base.replay)
    replay()
    replay()
    assert graph.ran == ["c++", "c++"]
    assert isinstance(replay, types.MethodType) and replay.__self__ is graph


@pytest.mark.parametrize(("tracker", "wrapper", "c", "why"), [
    (object(), Graph.replay, Base.replay, "the graph was captured with check_input_liveness=True"),
    (None, hooked(Graph.replay), Base.replay, "a decorated wrapper: the hook is in a closure"),
    (None, replay_helper, Base.replay, "the wrapper calls a module-level helper"),
    (None, Graph.replay_twice, Base.replay, "the wrapper does more than torch's"),
    (None, len, Base.replay, "the wrapper's code cannot be read"),
    (None, Graph.replay, None, "no C++ replay to call"),
])
def test_the_wrapper_is_kept_where_it_may_have_work(tracker: object, wrapper: object, c: object, why: str) -> None:
    graph = Graph(tracker)
    direct(graph, wrapper, c)
    assert graph.ran == ["wrapper"], why


def test_a_class_without_a_wrapper_binds_the_cpp_method_itself() -> None:
    graph = Graph()
    direct_replay(graph, wrapper=Base.replay, c_replay=Base.replay)()
    assert graph.ran == ["c++"]


def test_only_torchs_own_class_is_bypassed() -> None:
    """Any other class (a stand-in here; a subclass of CUDAGraph in the GPU test) keeps its own replay."""
    graph = Graph()
    graph.replay = lambda: graph.ran.append("own")  # type: ignore[method-assign]
    direct_replay(graph)()
    assert graph.ran == ["own"]


def test_this_torchs_wrapper_is_one_the_rule_skips() -> None:
    """The installed torch's own CUDAGraph.replay, through the rule: fails when torch changes it (the cuda backend
    then keeps calling the wrapper; look again)."""
    graph = Graph()
    direct(graph, torch.cuda.CUDAGraph.replay)
    assert graph.ran == ["c++"]


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

    class Spy(torch.cuda.CUDAGraph):  # a profiler's or a test's subclass keeps its replay
        pass

    spy = Spy()
    assert direct_replay(spy) == spy.replay
    for _ in range(3):
        fresh = torch.randn(8, 3, device="cuda")
        x.copy_(fresh)
        replay()
        torch.testing.assert_close(y, fresh * 2 + 1)


@pytest.mark.cuda
def test_the_registrys_full_and_breakable_graphs_replay_right() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reg = cg.GraphRegistry(lambda b, x: x * 2 + 1, {"x": cg.StaticInput((8, 3), torch.float32)}, backend="cuda")
    reg.capture([(B(8), "full"), (B(4), "breakable")])
    for n in (5, 3, 8, 2):
        x = torch.randn(n, 3, device="cuda")
        torch.testing.assert_close(reg.run(B(n), x=x), x * 2 + 1)
    assert reg.stats().hits == 4
