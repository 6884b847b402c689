"""``BatchDescriptor.decode`` keeps what it built: the same arguments give the same descriptor, checked once.

The oracle is the keyword form, which always builds afresh: the table may change which object comes back,
never whether a batch is accepted, what it equals, or the error a bad argument raises.
"""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.key.descriptor import DECODED_MAX


class Count(int):
    """An int subclass: equal to an int and hashing like one, but not an int to the checks."""


def built(make, *args):  # type: ignore[no-untyped-def]
    """What ``make(*args)`` gives: the descriptor, or the error's type and message."""
    try:
        return make(*args)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


counts = st.one_of(st.integers(-1, 9), st.sampled_from([4.0, True, False, Count(4), None, [4], 4 + 0j]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(counts, counts, counts), min_size=1, max_size=8))
def test_decode_is_the_uniform_descriptor_or_names_its_first_bad_argument(calls: list[tuple]) -> None:
    for args in calls * 2:  # each twice: the second call of a good one is served from the table
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
        assert got == expected and hash(got) == hash(expected) and {expected: 1}[got] == 1
        assert B.decode(*args) is got  # built once


def test_the_same_arguments_give_the_same_descriptor_and_other_types_are_still_refused() -> None:
    first = B.decode(8, 1)
    assert B.decode(8, 1) is first and B.decode(8, spec_depth=1, num_active_loras=0) is first
    assert B(16, 8, 0, 1, True) == first and B(16, 8, 0, 1, True) is not first  # the constructor builds afresh
    for bad in (8.0, Count(8), True):  # equal to 8 or 1, and hashing alike: refused all the same
        try:
            B.decode(bad, 1)
        except TypeError as exc:
            assert str(exc).startswith("BatchDescriptor.num_reqs must be an int")
        else:
            raise AssertionError(f"decode({bad!r}, 1) was accepted")


def test_the_table_is_bounded_and_starts_again_when_full() -> None:
    first = B.decode(1)
    assert B.decode(1) is first
    for reqs in range(2, DECODED_MAX + 3):  # more distinct decode shapes than the table keeps
        B.decode(reqs)
    again = B.decode(1)
    assert again == first and again is not first  # built afresh after the table started again
    assert B.decode(1) is again


def test_subclasses_and_pickles_build_as_usual() -> None:
    class Tagged(B):  # type: ignore[misc]
        pass

    tagged = Tagged.decode(4)
    assert type(tagged) is Tagged and tagged is not Tagged.decode(4) and tagged == Tagged.decode(4)
    copy = pickle.loads(pickle.dumps(B.decode(4)))
    assert copy == B.decode(4) and hash(copy) == hash(B.decode(4)) and type(copy) is B


def test_a_registry_serves_a_descriptor_built_each_step() -> None:
    """An engine's loop: a descriptor built every step, served by the key captured for an equal one."""
    reg = cg.GraphRegistry(lambda b, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu")
    reg.capture([(B.decode(8), "full")], progress=False)
    for step in range(1, 9):
        x = torch.arange(float(step))
        torch.testing.assert_close(reg.run(B.decode(step), x=x), x * 2)
        torch.testing.assert_close(reg.run(B(step, step, 0, 0, True), x=x), x * 2)
    assert reg.stats().eager_fallbacks == 0
