"""Descriptors built from positional values are interned: the same values give the same object, checked once.

The oracle is the keyword form, which always builds afresh: interning may change which object comes back,
never whether a descriptor is accepted, what it equals, or the error a bad one raises.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.descriptor import INTERNED_MAX

FIELDS = ("num_tokens", "num_reqs", "num_active_loras", "spec_depth", "uniform")


class Count(int):
    """An int subclass: equal to an int and hashing like one, but not an int to the checks."""


def built(make, *args):  # type: ignore[no-untyped-def]
    """What ``make(*args)`` gives: the descriptor, or the error's type and message."""
    try:
        return make(*args)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


def by_keywords(*args):  # type: ignore[no-untyped-def]
    return B(**dict(zip(FIELDS, args)))


counts = st.one_of(st.integers(-1, 9), st.sampled_from([4.0, True, False, Count(4), None]))
flags = st.one_of(st.booleans(), st.sampled_from([0, 1, None]))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(counts, counts, counts, counts, flags), min_size=1, max_size=12), st.integers(1, 5))
def test_positional_descriptors_are_what_keywords_build(batches: list[tuple], width: int) -> None:
    for values in batches * 2:  # each twice: the second build of a good one is the interned one
        args = values[:width]
        got, expected = built(B, *args), built(by_keywords, *args)
        assert type(got) is type(expected) and got == expected, args
        if isinstance(got, B):
            assert hash(got) == hash(expected) and {expected: 1}[got] == 1
            assert all(type(getattr(got, f)) is type(getattr(expected, f)) for f in FIELDS)


def test_the_same_values_give_the_same_descriptor_and_other_types_are_still_refused() -> None:
    first = B(8, 8, 0, 0, True)
    assert B(8, 8, 0, 0, True) is first and B.decode(8) is first and first.relaxed() is B(8, None, 0, 0, False)
    assert B(num_tokens=8, num_reqs=8, uniform=True) == first  # keywords build afresh, equal all the same
    with pytest.raises(TypeError, match="uniform must be a bool, got 1"):
        B(8, 8, 0, 0, 1)  # equal to first's values, and hashing alike: the types tell them apart
    with pytest.raises(TypeError, match="num_tokens must be an int, got 8.0"):
        B(8.0, 8, 0, 0, True)
    with pytest.raises(TypeError, match="num_tokens must be an int, got 8"):
        B(Count(8), 8, 0, 0, True)
    for _ in range(2):  # a refused descriptor is never kept
        with pytest.raises(ValueError, match="num_reqs=9 exceeds num_tokens=8"):
            B(8, 9)


def test_the_table_is_bounded_and_starts_again_when_full() -> None:
    first = B(1, 1)
    assert B(1, 1) is first
    for tokens in range(2, INTERNED_MAX + 3):  # more distinct descriptors than the table keeps
        B(tokens, 1)
    again = B(1, 1)
    assert again == first and again is not first  # built afresh after the table started again
    assert B(1, 1) is again


def test_subclasses_pickles_and_copies_build_as_usual() -> None:
    class Tagged(B):  # type: ignore[misc]
        pass

    tagged = Tagged(4, 2)
    assert type(tagged) is Tagged and tagged is not Tagged(4, 2) and tagged == Tagged(4, 2)
    plain = B(4, 2)
    copy = pickle.loads(pickle.dumps(plain))
    assert copy == plain and hash(copy) == hash(plain) and type(copy) is B


def test_a_registry_serves_a_descriptor_built_anew_each_step() -> None:
    """An engine's loop: a new descriptor every step, served by the key captured for an equal one."""
    import torch

    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    reg.capture([(B.decode(8), "full")], progress=False)
    for step in range(1, 9):
        x = torch.arange(float(step))
        torch.testing.assert_close(reg.run(B.decode(step), x=x), x * 2)
        torch.testing.assert_close(reg.run(B(step, step, 0, 0, True), x=x), x * 2)
    assert reg.stats().eager_fallbacks == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(counts, counts, counts), min_size=1, max_size=8))
def test_decode_is_the_uniform_descriptor_or_names_its_first_bad_argument(calls: list[tuple]) -> None:
    for args in calls * 2:
        got = built(B.decode, *args)
        fields = zip(("num_reqs", "spec_depth", "num_active_loras"), args, (1, 0, 0))
        bad = [(name, value) for name, value, least in fields if type(value) is not int or value < least]
        if bad:  # the first bad argument named, with its value
            name, value = bad[0]
            if type(value) is not int:
                assert got == (TypeError, f"BatchDescriptor.{name} must be an int, got {value!r} ({type(value).__name__})")
            else:
                assert got[0] is ValueError and got[1].startswith(f"BatchDescriptor.{name} must be") and got[1].endswith(f"got {value}")
            continue
        reqs, spec, loras = args
        expected = B(num_tokens=reqs * (1 + spec), num_reqs=reqs, num_active_loras=loras, spec_depth=spec, uniform=True)
        assert got == expected and hash(got) == hash(expected)
        assert B.decode(*args) is got  # built once
