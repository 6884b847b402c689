"""Matcher: the best captured key for an actual batch, in table time.

Rule: among covering keys the most preferred strategy wins, then the least padding (tokens, requests, LoRA slots);
ties go to uniform keys, then to exact request counts.  With a padding cap, a strategy whose best key pads more is
skipped for the next (or eager).  Pure: no plugin or torch import.  Keys are grouped into *families* differing only
in token (and request) count (strategy, form, LoRA count, exact-reqs); per family a table maps an actual token count
to the first key at or above it, so a lookup is a few list indexings whatever the number of keys.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import attrs

from cgregistry.builtins import DEFAULT_PREFERENCE
from cgregistry.key.descriptor import BatchDescriptor, Padding
from cgregistry.messages import text_table

__all__ = ["DEFAULT_PREFERENCE", "Candidate", "Explanation", "Match", "Matcher", "PaddingCap", "Verdict", "excluded"]


# Above this many token slots a family falls back to bisect instead of a dense table.
_DENSE_TABLE_LIMIT = 1 << 20
# Distinct actual shapes remembered by match() before its memo starts over.
_MEMO_LIMIT = 1 << 16


class Match(NamedTuple):
    """The key chosen for an actual batch, its strategy and the padding it adds."""

    key: BatchDescriptor
    strategy: str
    padding: Padding


@attrs.frozen(slots=True)
class Candidate:
    """One key considered by ``explain``: whether it won and why."""

    key: BatchDescriptor
    strategy: str
    covers: bool
    chosen: bool
    reason: str
    padding: Padding | None
    capturing: bool = False  # a key pending capture between steps: listed, but it serves nothing until captured


@attrs.frozen(slots=True)
class Explanation:
    """Every key considered for ``actual``; prints as a table."""

    actual: BatchDescriptor
    match: Match | None
    candidates: tuple[Candidate, ...]
    refused: str | None = None  # why no key may serve the batch at all (more requests than a static input holds, say)
    hint: str | None = None  # how the engine may describe the batch so that a key serves it (a decode batch not marked uniform)
    # No captured key serves the batch, and this key pending capture will once captured: until then the batch runs
    # eagerly (run() counts it under the miss reason "capturing").
    capturing: Match | None = None

    def to_dict(self) -> dict:
        """The explanation as JSON-serialisable data."""

        def key(d: BatchDescriptor) -> dict:
            return attrs.asdict(d)

        def match(m: Match | None) -> dict | None:
            return None if m is None else {"key": key(m.key), "strategy": m.strategy, "padding": list(m.padding)}

        return {
            "actual": key(self.actual),
            "refused": self.refused,
            "hint": self.hint,
            "match": match(self.match),
            "capturing": match(self.capturing),
            "candidates": [
                {"key": key(c.key), "strategy": c.strategy, "covers": c.covers, "chosen": c.chosen, "reason": c.reason,
                 "padding": None if c.padding is None else list(c.padding), "capturing": c.capturing}
                for c in self.candidates
            ],
        }

    def __str__(self) -> str:
        waits = self.capturing
        head = f"actual {self.actual}: " + (
            f"matched {self.match.key} [{self.match.strategy}], padding {tuple(self.match.padding)}"
            if self.match
            else f"runs eagerly: {self.refused}" if self.refused
            else (f"runs eagerly until a key pending capture is captured: {waits.key} [{waits.strategy}] will serve it, "
                  f"padding {tuple(waits.padding)} (miss reason 'capturing')") if waits
            else "every covering key is excluded or over the padding cap (runs eagerly)" if any(c.covers for c in self.candidates)
            else "no covering key (runs eagerly)"
        )
        rows = [("", "key", "strategy", "padding (tok, req, lora)", "reason")]
        for c in self.candidates:
            pad = "-" if c.padding is None else str(tuple(c.padding))
            rows.append(("*" if c.chosen else "", str(c.key), c.strategy, pad, c.reason))
        return "\n".join([head, *text_table(rows), *([f"hint: {self.hint}"] if self.hint else [])])


@attrs.frozen(slots=True)
class PaddingCap:
    """The most token padding a key may add to a batch; None for either: no such limit.

    ``max_tokens``: padding token slots; ``max_ratio``: per real token (``0.25``: a 16-token batch may take a 20-token
    key, not a 24-token one); a key must meet both.  Why: a 129-token batch in a 256-token full graph computes twice
    its tokens; capped, it goes to a less padded key of the next strategy, or eager.  Request and LoRA padding cost
    little, so only tokens are capped.
    """

    max_tokens: int | None = None
    max_ratio: float | None = None

    def __attrs_post_init__(self) -> None:
        t = self.max_tokens
        if t is not None and (type(t) is not int or t < 0):
            raise ValueError(f"max_padding_tokens must be an int >= 0 or None, got {t!r}")
        r = self.max_ratio
        if r is None:
            return
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < float("inf"):
            raise ValueError(f"max_padding_ratio must be a finite number >= 0 (padding tokens per real token) or None, got {r!r}")
        object.__setattr__(self, "max_ratio", float(r))  # an np.float64 or int kept as a plain float: snapshots stay plain JSON

    def __bool__(self) -> bool:
        return self.max_tokens is not None or self.max_ratio is not None

    def allows(self, pad_tokens: int, actual_tokens: int) -> bool:
        """Whether a key adding ``pad_tokens`` slots to a batch of ``actual_tokens`` tokens is within the cap."""
        if self.max_tokens is not None and pad_tokens > self.max_tokens:
            return False
        return self.max_ratio is None or pad_tokens <= self.max_ratio * actual_tokens

    def serves(self, key: BatchDescriptor, actual: BatchDescriptor) -> bool:
        """Whether ``key`` covers ``actual`` within the cap (what a key must meet to be matched to the batch)."""
        return key.covers(actual) and self.allows(key.num_tokens - actual.num_tokens, actual.num_tokens)

    def describe(self) -> str:
        parts = []
        if self.max_tokens is not None:
            parts.append(f"max_padding_tokens={self.max_tokens}")
        if self.max_ratio is not None:
            parts.append(f"max_padding_ratio={self.max_ratio:g}")
        return ", ".join(parts) or "no cap"


class _Family:
    """Keys that differ only in token/request count, sorted, with a token lookup table."""

    __slots__ = ("strategy", "form", "loras", "exact_reqs", "keys", "tokens", "first_at")

    def __init__(self, strategy: str, form: tuple[object, ...], loras: int, exact_reqs: bool) -> None:
        self.strategy = strategy
        self.form = form  # BatchDescriptor.form of every key here
        self.loras = loras
        self.exact_reqs = exact_reqs
        self.keys: list[BatchDescriptor] = []
        self.tokens: list[int] = []
        self.first_at: list[int] | None = None

    def freeze(self) -> None:
        self.keys.sort(key=lambda d: (d.num_tokens, d.num_reqs or 0, d.spec_depth))
        self.tokens = [d.num_tokens for d in self.keys]
        top = self.tokens[-1]
        if top <= _DENSE_TABLE_LIMIT:
            table = [0] * (top + 1)
            i = 0
            for t in range(top + 1):
                while self.tokens[i] < t:
                    i += 1
                table[t] = i
            self.first_at = table

    def best(self, actual: BatchDescriptor) -> BatchDescriptor | None:
        """The smallest key of this family covering ``actual`` (the family's own fields already checked)."""
        t = actual.num_tokens
        tokens = self.tokens
        if t > tokens[-1]:
            return None
        i = self.first_at[t] if self.first_at is not None else bisect_left(tokens, t)
        if not self.exact_reqs:
            return self.keys[i]
        reqs = actual.num_reqs
        if reqs is None:
            return None
        keys = self.keys
        # Uniform keys: request count grows with tokens, so the first key covers.
        # Non-uniform exact keys: scan forward to the first with enough requests.
        for j in range(i, len(keys)):
            if keys[j].num_reqs >= reqs:  # type: ignore[operator]
                return keys[j]
        return None


@attrs.frozen(slots=True)
class Verdict:
    """The matcher's answer for a batch: the key that serves it, or why none does (a miss reason,
    ``inspection.MISS_REASONS``) and, where the engine could describe the batch so that a key serves it, how."""

    match: Match | None
    reason: str | None = None
    hint: str | None = None


class Matcher:
    """Chooses covering keys; built once from (key, strategy) pairs.

    ``preference``: strategy names, most preferred first (others follow in key order).  ``max_padding_tokens`` /
    ``max_padding_ratio``: a :class:`PaddingCap` (None: no cap).  ``capturing`` and ``failed``: keys pending or failed,
    which serve nothing but say why a batch runs eagerly (``verdict``).
    """

    def __init__(
        self, keys: Iterable[tuple[BatchDescriptor, str]], preference: Sequence[str] = DEFAULT_PREFERENCE, *,
        max_padding_tokens: int | None = None, max_padding_ratio: float | None = None,
        capturing: Iterable[tuple[BatchDescriptor, str]] = (), failed: Iterable[tuple[BatchDescriptor, str]] = (),
    ) -> None:
        self.cap = PaddingCap(max_padding_tokens, max_padding_ratio)  # validated before anything else is built
        pairs = list(dict.fromkeys(keys))
        self._pairs = pairs
        self._capturing = tuple(capturing)
        self._failed = tuple(failed)
        strategies = list(dict.fromkeys(s for _, s in pairs))
        order = list(dict.fromkeys([*preference, *strategies]))
        self._rank = {s: i for i, s in enumerate(order)}
        families: dict[tuple[str, tuple[object, ...], int, bool], _Family] = {}
        for key, strategy in pairs:
            sig = (strategy, key.form, key.num_active_loras, key.num_reqs is not None)
            family = families.get(sig)
            if family is None:
                family = families[sig] = _Family(*sig)
            family.keys.append(key)
        for family in families.values():
            family.freeze()
        self._families = sorted(families.values(), key=lambda f: (self._rank[f.strategy], f.loras))
        # (form, loras) of an actual batch -> applicable families grouped by strategy rank
        self._plans: dict[tuple[tuple[object, ...], int], list[list[_Family]]] = {}
        self._memo: dict[BatchDescriptor, Match | None] = {}
        self._excluded_memo: dict[tuple[BatchDescriptor, frozenset[str]], Match | None] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    @property
    def preference(self) -> list[str]:
        """Strategy names, most preferred first."""
        return sorted(self._rank, key=self._rank.__getitem__)

    def refused_for_padding(self, key: BatchDescriptor, actual: BatchDescriptor) -> bool:
        """Whether this matcher's padding cap refuses ``key`` (which covers ``actual``)."""
        return bool(self.cap) and not self.cap.allows(key.num_tokens - actual.num_tokens, actual.num_tokens)

    def _groups_for(self, actual: BatchDescriptor) -> list[list[_Family]]:
        sig = (actual.form, actual.num_active_loras)
        groups = self._plans.get(sig)
        if groups is None:
            by_rank: dict[int, list[_Family]] = {}
            for family in self._families:
                if family.loras < actual.num_active_loras:
                    continue
                if not family.keys[0].serves_form(actual):
                    continue
                by_rank.setdefault(self._rank[family.strategy], []).append(family)
            groups = self._plans[sig] = [by_rank[r] for r in sorted(by_rank)]
        return groups

    def match(self, actual: BatchDescriptor, exclude: Iterable[str] = ()) -> Match | None:
        """The best covering key for ``actual``, or None; memoised, so a seen shape costs one dict lookup.  ``exclude``:
        strategies this call may not use (``("full",)`` for vLLM's ``disable_full``), memoised apart."""
        if exclude:
            return self._match_excluding(actual, excluded(exclude))
        try:
            return self._memo[actual]
        except KeyError:
            pass
        found = self.match_uncached(actual)
        if len(self._memo) >= _MEMO_LIMIT:
            self._memo.clear()
        self._memo[actual] = found
        return found

    def _match_excluding(self, actual: BatchDescriptor, exclude: frozenset[str]) -> Match | None:
        memo = self._excluded_memo
        try:
            return memo[(actual, exclude)]
        except KeyError:
            pass
        found = self.match_uncached(actual, exclude)
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[(actual, exclude)] = found
        return found

    def match_uncached(self, actual: BatchDescriptor, exclude: frozenset[str] = frozenset()) -> Match | None:
        """``match`` without the memo: a table index per applicable key family."""
        for group in self._groups_for(actual):
            if exclude and group[0].strategy in exclude:
                continue
            best: BatchDescriptor | None = None
            best_order: tuple[int, int, int, int, int] | None = None
            for family in group:
                key = family.best(actual)
                if key is None:
                    continue
                order = _order(key, actual)
                if best_order is None or order < best_order:
                    best, best_order = key, order
            if best is not None:
                # The best key has the group's least token padding: over the cap, the whole strategy is.
                if self.cap and not self.cap.allows(best_order[0], actual.num_tokens):  # type: ignore[index]
                    continue
                # Each strategy has its own rank, so a group holds one strategy.
                return Match(best, group[0].strategy, Padding(*best_order[:3]))  # type: ignore[index]
        return None

    def verdict(self, actual: BatchDescriptor, exclude: frozenset[str] = frozenset()) -> Verdict:
        """The key that serves ``actual`` (``match``), or why none does and how the engine could describe the batch
        so that one does: the one question a route asks."""
        match = self.match(actual, exclude)
        if match is not None:
            return Verdict(match)
        reason = self._why_not(actual, exclude)
        return Verdict(None, reason, self.uniform_hint(actual, exclude) if reason == "no_key_for_class" else None)

    def _why_not(self, actual: BatchDescriptor, exclude: frozenset[str]) -> str:
        """Why no key serves ``actual``: a key pending capture would (its strategy allowed, within the padding cap);
        a key covers it but the padding cap refused every allowed strategy, or every covering key's strategy is
        excluded; or a failed key covered it, none is of its form and LoRA count, none gives a request count, none is
        large enough."""
        if any(strategy not in exclude and self.cap.serves(key, actual) for key, strategy in self._capturing):
            return "capturing"
        pairs = [*self._pairs, *self._capturing]  # keys pending capture count as keys for the reasons below
        if not pairs:
            return "no_graphs" if not self._failed else "failed"
        covering = {strategy for key, strategy in pairs if key.covers(actual)}
        if covering - exclude:
            return "padding_cap"
        if covering:
            return "excluded"
        if any(key.covers(actual) for key, _ in self._failed):
            return "failed"
        same_form = [key for key, _ in pairs if key.num_active_loras >= actual.num_active_loras and key.serves_form(actual)]
        if not same_form:
            return "no_key_for_class"
        if actual.num_reqs is None and all(key.num_reqs is not None for key in same_form):
            return "no_request_count"
        return "above_largest_key"

    def candidates(self, actual: BatchDescriptor, exclude: Iterable[str] = ()) -> list[Match]:
        """Every key that may serve ``actual`` as a Match, best first by this matcher's rule (a scan: not for
        the hot path); keys of excluded strategies and keys over the padding cap are left out."""
        skip = excluded(exclude)
        found = [
            (self._rank[strategy], _order(key, actual), Match(key, strategy, key.padding(actual)))
            for key, strategy in self._pairs
            if strategy not in skip and key.covers(actual) and not self.refused_for_padding(key, actual)
        ]
        found.sort(key=lambda item: (item[0], item[1]))
        return [m for _, _, m in found]

    def explain(
        self, actual: BatchDescriptor, exclude: Iterable[str] = (), capturing: Iterable[tuple[BatchDescriptor, str]] = (),
    ) -> Explanation:
        """Every key with the reason it won or lost against ``actual`` (``exclude`` as for ``match``).

        ``capturing``: keys pending capture, listed as such; when no key serves the batch, the best of them that would is
        the explanation's ``capturing`` (the batch runs eagerly until it is captured)."""
        skip = excluded(exclude)
        chosen = self.match(actual, skip)
        rows: list[tuple[tuple[int, ...], Candidate]] = []
        for key, strategy in self._pairs:
            if not key.covers(actual):
                rows.append(((2, self._rank[strategy], key.num_tokens), Candidate(key, strategy, False, False, _why_not(key, actual), None)))
                continue
            pad = key.padding(actual)
            if strategy in skip:
                reason = f"covers, but strategy {strategy!r} is excluded for this call"
                rows.append(((0, len(self._rank), *pad), Candidate(key, strategy, True, False, reason, pad)))
                continue
            if self.refused_for_padding(key, actual):
                reason = f"covers, but pads {pad.tokens} tokens for {actual.num_tokens}: over the cap ({self.cap.describe()})"
                rows.append(((0, self._rank[strategy], *pad), Candidate(key, strategy, True, False, reason, pad)))
                continue
            if chosen is not None and (key, strategy) == (chosen.key, chosen.strategy):
                reason = "chosen: " + ("most preferred strategy, least padding" if pad != (0, 0, 0) else "exact fit")
                if self.cap and pad != (0, 0, 0):
                    reason = "chosen: most preferred strategy within the padding cap, least padding"
                rows.append(((0, -1), Candidate(key, strategy, True, True, reason, pad)))
                continue
            assert chosen is not None
            if self._rank[strategy] > self._rank[chosen.strategy]:
                reason = f"covers, but strategy {strategy!r} is less preferred than {chosen.strategy!r}"
            else:
                reason = f"covers, but pads more: {tuple(pad)} vs {tuple(chosen.padding)}"
                if pad == chosen.padding:
                    reason = "covers with equal padding; lost the tie (uniform, then exact request count)"
            rows.append(((0, self._rank[strategy], *pad), Candidate(key, strategy, True, False, reason, pad)))
        waits = self._explain_capturing(actual, skip, chosen, capturing, rows)
        rows.sort(key=lambda r: r[0])
        hint = None if chosen is not None else self.uniform_hint(actual, skip)
        return Explanation(actual, chosen, tuple(c for _, c in rows), hint=hint, capturing=waits)

    def _explain_capturing(
        self, actual: BatchDescriptor, skip: frozenset[str], chosen: Match | None,
        capturing: Iterable[tuple[BatchDescriptor, str]], rows: list[tuple[tuple[int, ...], Candidate]],
    ) -> Match | None:
        """``explain``'s rows for the keys pending capture (added to ``rows``, after the captured keys that cover the
        batch); the best of them that would serve the batch when no captured key does."""
        live = set(self._pairs)
        pairs = [pair for pair in dict.fromkeys(capturing) if pair not in live]
        if not pairs:
            return None
        last = len(self._rank)

        def rank(strategy: str) -> int:
            return self._rank.get(strategy, last)

        prefix = "pending capture between steps"
        serving: list[tuple[tuple[int, ...], Match]] = []
        for key, strategy in pairs:
            if not key.covers(actual):
                reason = f"{prefix}; {_why_not(key, actual)}"
                rows.append(((1, 2, rank(strategy), key.num_tokens), Candidate(key, strategy, False, False, reason, None, True)))
                continue
            pad = key.padding(actual)
            if strategy in skip:
                reason = f"{prefix}; covers, but strategy {strategy!r} is excluded for this call"
            elif self.refused_for_padding(key, actual):
                reason = f"{prefix}; covers, but pads {pad.tokens} tokens for {actual.num_tokens}: over the cap ({self.cap.describe()})"
            else:
                serving.append(((rank(strategy), *_order(key, actual)), Match(key, strategy, pad)))
                continue
            rows.append(((1, 1, rank(strategy), *pad), Candidate(key, strategy, True, False, reason, pad, True)))
        if not serving:
            return None
        serving.sort(key=lambda item: item[0])
        top_order, top = serving[0]
        if chosen is None:
            reason = f"{prefix}: serves it once captured; the batch runs eagerly until then"
            rows.append(((1, -1), Candidate(top.key, top.strategy, True, False, reason, top.padding, True)))
            rival, rival_order = top, top_order
        else:
            rival, rival_order = chosen, (rank(chosen.strategy), *_order(chosen.key, actual))
            if top_order < rival_order:
                reason = f"{prefix}: once captured, serves it instead of {chosen.key} [{chosen.strategy}]"
                rows.append(((1, -1), Candidate(top.key, top.strategy, True, False, reason, top.padding, True)))
                rival, rival_order = top, top_order
        for order, m in serving:
            if m is rival:
                continue
            if order[0] > rival_order[0]:
                reason = f"{prefix}; covers, but strategy {m.strategy!r} is less preferred than {rival.strategy!r}"
            elif m.padding != rival.padding:
                reason = f"{prefix}; covers, but pads more: {tuple(m.padding)} vs {tuple(rival.padding)}"
            else:
                reason = f"{prefix}; covers with equal padding; lost the tie (uniform, then exact request count)"
            rows.append(((1, 0, *order), Candidate(m.key, m.strategy, True, False, reason, m.padding, True)))
        return top if chosen is None else None

    def uniform_hint(self, actual: BatchDescriptor, exclude: Iterable[str] = ()) -> str | None:
        """For a batch no key serves that is not marked uniform, but whose every request could have ``1 + d`` query tokens
        with a uniform key of depth ``d`` serving it (outside the strategies in ``exclude``, within the padding cap): how
        to describe it (None otherwise).  A prefill chunk can look like a decode batch, so the registry never assumes
        it; the engine knows."""
        if actual.uniform or actual.num_reqs is None:
            return None
        skip = excluded(exclude)
        for depth in sorted({key.spec_depth for key, strategy in self._pairs if key.uniform and strategy not in skip}):
            if actual.num_tokens != actual.num_reqs * (1 + depth):
                continue
            decode = BatchDescriptor.decode(actual.num_reqs, depth, actual.num_active_loras)
            match = self.match(decode, skip)
            if match is not None and match.key.uniform:
                call = f"BatchDescriptor.decode({actual.num_reqs}{f', spec_depth={depth}' if depth else ''}"
                call += f"{f', num_active_loras={actual.num_active_loras}' if actual.num_active_loras else ''})"
                return (
                    f"{actual} is not marked uniform, so only mixed keys may serve it; if each of its requests has "
                    f"{1 + depth} query token{'s' if depth else ''}, describe it as {call} (uniform=True) and "
                    f"{match.key} [{match.strategy}] serves it"
                )
        return None


def excluded(exclude: Iterable[str]) -> frozenset[str]:
    """``exclude`` as a set of strategy names; a bare string is an error (it would exclude its letters)."""
    if isinstance(exclude, frozenset):
        return exclude
    if isinstance(exclude, str) or not isinstance(exclude, Iterable):
        raise TypeError(f"exclude must be a collection of strategy names, e.g. ('full',); got {exclude!r}")
    names = frozenset(exclude)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"exclude must hold strategy names (str), got {bad[0]!r}")
    return names


def _order(key: BatchDescriptor, actual: BatchDescriptor) -> tuple[int, int, int, int, int]:
    reqs_pad = 0 if key.num_reqs is None or actual.num_reqs is None else key.num_reqs - actual.num_reqs
    return (
        key.num_tokens - actual.num_tokens,
        reqs_pad,
        key.num_active_loras - actual.num_active_loras,
        0 if key.uniform else 1,
        0 if key.num_reqs is not None else 1,
    )


def _why_not(key: BatchDescriptor, actual: BatchDescriptor) -> str:
    if key.num_tokens < actual.num_tokens:
        return f"too few tokens: {key.num_tokens} < {actual.num_tokens}"
    if key.num_active_loras < actual.num_active_loras:
        return f"too few LoRA slots: {key.num_active_loras} < {actual.num_active_loras}"
    if key.num_reqs is not None:
        if actual.num_reqs is None:
            return "key needs a request count; the batch gives none"
        if key.num_reqs < actual.num_reqs:
            return f"too few requests: {key.num_reqs} < {actual.num_reqs}"
    return key.form_mismatch(actual) or "covers"
