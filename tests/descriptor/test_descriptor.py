from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgregistry import BatchDescriptor
from cgregistry.key import Padding

B = BatchDescriptor


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_tokens": 0}, ValueError, "num_tokens must be positive, got 0"),
        ({"num_tokens": -3}, ValueError, "num_tokens must be positive, got -3"),
        ({"num_tokens": True}, TypeError, "num_tokens must be an int, got True"),
        ({"num_tokens": 4.0}, TypeError, "num_tokens must be an int, got 4.0"),
        ({"num_tokens": 4, "num_reqs": 0}, ValueError, "num_reqs must be positive, got 0"),
        ({"num_tokens": 4, "num_reqs": 5}, ValueError, "num_reqs=5 exceeds num_tokens=4"),
        ({"num_tokens": 4, "num_active_loras": -1}, ValueError, "num_active_loras must be non-negative, got -1"),
        ({"num_tokens": 4, "spec_depth": -2}, ValueError, "spec_depth must be non-negative, got -2"),
        ({"num_tokens": 4, "uniform": 1}, TypeError, "uniform must be a bool, got 1"),
        ({"num_tokens": 4, "uniform": True}, ValueError, "uniform=True needs num_reqs"),
        ({"num_tokens": 8, "num_reqs": 3, "spec_depth": 1, "uniform": True}, ValueError, "3 \\* 2 = 6, got num_tokens=8"),
    ],
)
def test_invalid_descriptors_name_field_and_value(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        B(**kwargs)


def test_equal_descriptors_hash_equal_and_are_immutable() -> None:
    a = B(8, 4, 0, 1, True)
    b = B(num_tokens=8, num_reqs=4, num_active_loras=0, spec_depth=1, uniform=True)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != B(8, 4, 0, 1, False)
    with pytest.raises(AttributeError):
        a.num_tokens = 9  # type: ignore[misc]


def test_decode_builds_uniform_batch() -> None:
    assert BatchDescriptor.decode(4, spec_depth=1) == B(8, 4, 0, 1, True)
    assert BatchDescriptor.decode(3).query_len == 1
    assert B(5, 2).query_len is None


def test_covers_tokens_requests_and_loras() -> None:
    key = B(16, 8, num_active_loras=2)
    assert key.covers(B(16, 8, 2))
    assert key.covers(B(10, 3, 1))
    assert not key.covers(B(17, 8))
    assert not key.covers(B(16, 9))
    assert not key.covers(B(8, 4, 3))
    assert not key.covers(B(8, None)), "a key with an exact request count needs the batch's count"


def test_relaxed_key_covers_any_request_count() -> None:
    key = B(16)
    assert key.covers(B(16, 16)) and key.covers(B(3, 1)) and key.covers(B(5))


def test_uniform_key_needs_uniform_batch_of_same_depth() -> None:
    key = BatchDescriptor.decode(4, spec_depth=1)  # 8 tokens
    assert key.covers(BatchDescriptor.decode(3, spec_depth=1))
    assert not key.covers(BatchDescriptor.decode(2, spec_depth=3)), "8 tokens but another query length"
    assert not key.covers(B(6, 3, spec_depth=1)), "a non-uniform batch never gets a uniform key"
    assert B(8, 8).covers(BatchDescriptor.decode(4, spec_depth=1)), "a uniform batch may use a non-uniform key"


def test_padding_counts_slots_and_refuses_non_covering() -> None:
    assert B(16, 8, 2).padding(B(10, 3, 1)) == Padding(6, 5, 1)
    assert B(16).padding(B(10, 3)) == Padding(6, 0, 0)
    with pytest.raises(ValueError, match="does not cover"):
        B(4).padding(B(5))


def test_relaxed_drops_request_count_and_uniformity() -> None:
    d = BatchDescriptor.decode(4, spec_depth=1, num_active_loras=2)
    r = d.relaxed()
    assert r == B(8, None, 2, 1, False)
    assert r.relaxed() is r
    assert r.covers(d)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 5)))
def test_from_query_lens_agrees_with_a_brute_force_reading_of_the_lengths(lens: list[int], loras: int, depth: int | None) -> None:
    made = B.from_query_lens(lens, loras, spec_depth=depth)
    uniform = len(set(lens)) == 1 and (depth is None or lens[0] == 1 + depth)
    assert made.uniform == uniform and made.num_tokens == sum(lens) and made.num_reqs == len(lens)
    assert made.num_active_loras == loras and made.spec_depth == (lens[0] - 1 if uniform else 0)
    assert made == (B.decode(len(lens), lens[0] - 1, loras) if uniform else B(sum(lens), len(lens), loras))


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(0, 3))
def test_from_query_lens_by_default_makes_only_a_pure_decode_step_uniform(lens: list[int], loras: int) -> None:
    made = B.from_query_lens(lens, loras)
    assert made == B.from_query_lens(lens, loras, spec_depth=0)
    assert made == (B.decode(len(lens), 0, loras) if set(lens) == {1} else B(sum(lens), len(lens), loras))


def test_one_prefill_chunk_is_a_mixed_batch_unless_the_caller_says_it_verifies_drafts() -> None:
    chunk = B.from_query_lens([18])  # one request's 18-token prompt chunk
    assert chunk == B(18, 1) and not chunk.uniform and chunk.spec_depth == 0
    assert repr(chunk) == "Batch(tokens=18, reqs=1)" and chunk.form_label == "mixed"
    assert B.from_query_lens([5, 5]) == B(10, 2)  # two equal prompt chunks: still prefill
    assert B.from_query_lens([18], spec_depth=17) == B.decode(1, spec_depth=17)  # the caller says it is a verify step
    assert B.from_query_lens([2, 2, 2], spec_depth=1) is B.decode(3, spec_depth=1)
    assert B.from_query_lens([2, 2, 2], spec_depth=None) is B.decode(3, spec_depth=1)  # asked to read the depth off


def test_a_warning_labels_a_prefill_chunk_as_a_prefill(recwarn: pytest.WarningsRecorder) -> None:
    import torch

    import cgregistry as cg
    from cgregistry.server import ABOVE_LARGEST_HINT_AFTER

    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((32, 4), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=16, mode="full"), progress=False)
    chunk = B.from_query_lens([18])
    for _ in range(ABOVE_LARGEST_HINT_AFTER):
        reg.run(chunk, x=torch.ones(18, 4))
    messages = [str(w.message) for w in recwarn if "no key of their form is that large" in str(w.message)]
    assert len(messages) == 1 and "such as Batch(tokens=18, reqs=1))" in messages[0], messages
    assert "spec=" not in messages[0] and "uniform" not in messages[0]
    assert reg.stats().misses_by_form == {"uniform": 0, "mixed": ABOVE_LARGEST_HINT_AFTER}


@pytest.mark.parametrize(("lens", "message"), [([], "at least one"), ([1, 0], "got 0"), ([1, 2.0], "got 2.0")])
def test_from_query_lens_names_a_bad_length(lens: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        B.from_query_lens(lens)  # type: ignore[arg-type]


def test_from_query_lens_takes_numpy_integers_as_an_engine_keeps_them() -> None:
    import numpy as np

    assert B.from_query_lens(np.array([1, 1, 1])) == B.decode(3)
    assert B.from_query_lens(np.array([3, 5], dtype=np.int32)) == B(8, 2)
    with pytest.raises(ValueError, match=r"query lengths as ints >= 1, got np.int64\(0\)"):
        B.from_query_lens(np.array([1, 0]))
