"""BatchDescriptor: the hashable shape of one model step, and padding arithmetic.

The engine describes the batch it has (the *actual* batch); the registry holds captured descriptors (*keys*).  A key
*covers* an actual batch when the graph captured for the key can serve the batch after padding.
"""

from __future__ import annotations

import numbers

from collections.abc import Sequence
from typing import NamedTuple

import attrs

__all__ = ["BatchDescriptor", "Padding"]


class Padding(NamedTuple):
    """How much a key pads an actual batch: tokens, requests, LoRA slots."""

    tokens: int
    reqs: int
    loras: int


def _check_count(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True tokens is a bug, not a batch of one.
    if type(value) is not int:
        raise TypeError(f"BatchDescriptor.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        bound = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"BatchDescriptor.{name} must be {bound}, got {value}")


DECODED_MAX = 16384  # distinct decode shapes kept; past it the table starts again (more than requests x depths x LoRA counts)
_decoded: dict[tuple[int, int, int], BatchDescriptor] = {}  # decode()'s checked arguments: the descriptor built for them


@attrs.frozen(slots=True, cache_hash=True, repr=False)
class BatchDescriptor:
    """The shape of one model step.  ``num_reqs=None``: any request count (a relaxed key); ``uniform``: every request
    has query length ``1 + spec_depth`` (pure decode or speculative verify); ``num_ubatches``: the step's micro-batches
    (2 under dual-batch overlap), baked into a graph, so matched exactly."""

    num_tokens: int
    num_reqs: int | None = None
    num_active_loras: int = 0
    spec_depth: int = 0
    uniform: bool = False
    num_ubatches: int = 1

    def __attrs_post_init__(self) -> None:
        _check_count("num_tokens", self.num_tokens, 1)
        if self.num_reqs is not None:
            _check_count("num_reqs", self.num_reqs, 1)
            if self.num_reqs > self.num_tokens:
                raise ValueError(f"BatchDescriptor.num_reqs={self.num_reqs} exceeds num_tokens={self.num_tokens}: "
                                 "every request contributes at least one token")
        _check_count("num_active_loras", self.num_active_loras, 0)
        _check_count("spec_depth", self.spec_depth, 0)
        _check_count("num_ubatches", self.num_ubatches, 1)
        if self.num_ubatches > self.num_tokens:
            raise ValueError(f"BatchDescriptor.num_ubatches={self.num_ubatches} exceeds num_tokens={self.num_tokens}: "
                             "every micro-batch holds at least one token")
        if type(self.uniform) is not bool:
            raise TypeError(f"BatchDescriptor.uniform must be a bool, got {self.uniform!r}")
        if self.uniform:
            if self.num_reqs is None:
                raise ValueError("BatchDescriptor.uniform=True needs num_reqs: a uniform batch has exactly "
                                 "num_tokens / (1 + spec_depth) requests")
            query_len = 1 + self.spec_depth
            if self.num_tokens != self.num_reqs * query_len:
                raise ValueError(f"uniform BatchDescriptor needs num_tokens == num_reqs * (1 + spec_depth) = "
                                 f"{self.num_reqs} * {query_len} = {self.num_reqs * query_len}, "
                                 f"got num_tokens={self.num_tokens}")

    @classmethod
    def decode(cls, num_reqs: int, spec_depth: int = 0, num_active_loras: int = 0) -> BatchDescriptor:
        """A uniform batch of ``num_reqs`` requests, each with ``1 + spec_depth`` tokens.  The same arguments give back
        the descriptor built before (hash cached): an engine builds one every decode step, and this skips attrs'
        ``__init__``, the checks and the first hash (more than ``run()``'s overhead); ``run()`` routes by identity."""
        if not (type(num_reqs) is int and type(spec_depth) is int and type(num_active_loras) is int
                and num_reqs >= 1 and spec_depth >= 0 and num_active_loras >= 0):  # one test on the hot path
            _check_count("num_reqs", num_reqs, 1)  # before the arithmetic, so the error names what was passed
            _check_count("spec_depth", spec_depth, 0)
            _check_count("num_active_loras", num_active_loras, 0)
        if cls is not BatchDescriptor:  # a subclass builds its own
            return cls(num_reqs * (1 + spec_depth), num_reqs, num_active_loras, spec_depth, True)
        key = (num_reqs, spec_depth, num_active_loras)  # exact ints, checked above: equal keys are equal batches
        made = _decoded.get(key)
        if made is None:
            made = cls(num_reqs * (1 + spec_depth), num_reqs, num_active_loras, spec_depth, True)
            if len(_decoded) >= DECODED_MAX:
                _decoded.clear()
            _decoded[key] = made
        return made

    @classmethod
    def from_query_lens(cls, query_lens: Sequence[int], num_active_loras: int = 0, *,
                        spec_depth: int | None = 0, num_ubatches: int = 1) -> BatchDescriptor:
        """The batch of requests with these query lengths (new tokens per request this step): uniform when every
        request has ``1 + spec_depth`` tokens, mixed otherwise.

        ``spec_depth``: the drafts per request this step verifies.  The default, 0, makes only pure decode uniform:
        equal lengths above one are as often prefill chunks (``[18]``: one 18-token prompt chunk) as verify steps, so a
        verify step of depth ``d`` passes ``spec_depth=d``.  ``None`` reads any common length ``1 + d`` as depth ``d``
        (only for an engine whose every such step verifies).  ``num_ubatches``: the step's micro-batches."""
        lens = list(query_lens)
        if not lens:
            raise ValueError("from_query_lens() needs at least one request's query length, got none")
        bad = [n for n in lens if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1]
        if bad:
            raise ValueError(f"from_query_lens() takes query lengths as ints >= 1, got {bad[0]!r} (of {lens[:8]}"
                             f"{' ...' if len(lens) > 8 else ''})")
        if spec_depth is not None:
            _check_count("spec_depth", spec_depth, 0)
        lens = [int(n) for n in lens]  # numpy's integers too (an engine's scheduler keeps them so)
        first = lens[0]
        if all(n == first for n in lens) and (spec_depth is None or first == 1 + spec_depth):
            if num_ubatches == 1:
                return cls.decode(len(lens), first - 1, num_active_loras)
            return cls(sum(lens), len(lens), num_active_loras, first - 1, True, num_ubatches)
        return cls(sum(lens), len(lens), num_active_loras, num_ubatches=num_ubatches)

    @property
    def query_len(self) -> int | None:
        """Tokens per request for a uniform batch, None otherwise."""
        return 1 + self.spec_depth if self.uniform else None

    def covers(self, actual: BatchDescriptor) -> bool:
        """Whether a graph captured for this key can serve ``actual`` after padding."""
        if self.num_tokens < actual.num_tokens or self.num_active_loras < actual.num_active_loras:
            return False
        if self.num_reqs is not None and (actual.num_reqs is None or self.num_reqs < actual.num_reqs):
            return False
        return self.serves_form(actual)

    # The key's form: the axes a graph bakes in and a key therefore matches exactly (every other axis is a count that
    # padding fills).  Every part of the package that groups, matches, labels or encodes keys by form asks here, so a
    # new exact axis is added in this block and the fields above.

    @property
    def form(self) -> tuple[object, ...]:
        """The exact-match axes as one hashable value: keys of one form differ only in tokens, requests and LoRA slots."""
        return (self.uniform, self.spec_depth if self.uniform else None, self.num_ubatches)

    @property
    def form_label(self) -> str:
        """The form in words, for statistics and tables: ``mixed`` or ``uniform-d<spec depth>``, then ``-ub<n>`` for
        ``n`` micro-batches."""
        shape = f"uniform-d{self.spec_depth}" if self.uniform else "mixed"
        return shape if self.num_ubatches == 1 else f"{shape}-ub{self.num_ubatches}"

    def serves_form(self, actual: BatchDescriptor) -> bool:
        """Whether a key of this form may serve ``actual``'s form (a uniform graph bakes in the query length)."""
        return self.num_ubatches == actual.num_ubatches and (
            not self.uniform or (actual.uniform and actual.spec_depth == self.spec_depth))

    def form_mismatch(self, actual: BatchDescriptor) -> str | None:
        """Why a key of this form cannot serve ``actual`` (None when it can), for ``explain()``."""
        if self.serves_form(actual):
            return None
        if self.num_ubatches != actual.num_ubatches:
            return f"key runs {self.num_ubatches} micro-batch(es), batch has {actual.num_ubatches}"
        if not actual.uniform:
            return "uniform key cannot serve a non-uniform batch"
        return f"uniform key of spec depth {self.spec_depth}, batch has depth {actual.spec_depth}"

    def encode(self) -> list[int]:
        """Eight integers whose elementwise MAX over several batches decodes (:meth:`from_encoded`) to a descriptor
        covering each of them: what a distributed group all-reduces to agree on one key."""
        reqs = self.num_reqs
        return [
            self.num_tokens,
            0 if reqs is None else reqs,
            1 if reqs is None else 0,  # any batch without a request count makes the combined one unknown
            self.num_active_loras,
            self.spec_depth if self.uniform else -1,  # max over batches ...
            -self.spec_depth if self.uniform else -(1 << 30),  # ... and min, through -max(-x)
            0 if self.uniform else 1,
            self.num_ubatches,  # the batches of a group are split alike (the engine's rule); max keeps one that is
        ]

    @classmethod
    def from_encoded(cls, values: Sequence[int]) -> BatchDescriptor:
        """The descriptor of combined :meth:`encode` values: uniform only if every batch was, at one spec depth."""
        tokens, reqs, no_reqs, loras, max_depth, neg_min_depth, mixed, ubatches = values
        num_reqs = None if no_reqs else reqs
        uniform = not mixed and num_reqs is not None and max_depth == -neg_min_depth
        if uniform and tokens != num_reqs * (1 + max_depth):  # cannot happen for valid uniform batches; be safe
            uniform = False
        return cls(tokens, num_reqs, loras, max(max_depth, 0) if uniform else 0, uniform, ubatches)

    def padding(self, actual: BatchDescriptor) -> Padding:
        """Slots this key adds to ``actual``; raises if the key does not cover it."""
        if not self.covers(actual):
            raise ValueError(f"{self} does not cover {actual}")
        reqs = 0 if self.num_reqs is None else self.num_reqs - actual.num_reqs  # type: ignore[operator]
        return Padding(self.num_tokens - actual.num_tokens, reqs, self.num_active_loras - actual.num_active_loras)

    def relaxed(self) -> BatchDescriptor:
        """The same batch with any request count (and therefore not uniform)."""
        if self.num_reqs is None and not self.uniform:
            return self
        return BatchDescriptor(self.num_tokens, None, self.num_active_loras, self.spec_depth, False, self.num_ubatches)

    def __repr__(self) -> str:
        shown = {f"loras={self.num_active_loras}": self.num_active_loras, f"spec={self.spec_depth}": self.spec_depth,
                 "uniform": self.uniform, f"ubatches={self.num_ubatches}": self.num_ubatches != 1}  # the non-defaults
        parts = [f"tokens={self.num_tokens}", f"reqs={'any' if self.num_reqs is None else self.num_reqs}"]
        return f"Batch({', '.join([*parts, *(part for part, show in shown.items() if show)])})"

    __str__ = __repr__
