"""Key classes: the classes of batch (mixed, spec decode, decode) a strategy may be unable to serve, and the check of a declaration of them.

One place for plans (``PlanSettings.unsupported``, a strategy's own ``unsupported_classes``), the plugin manager
(checks a strategy's declaration at registration) and the registry (refuses a plan entry its strategy cannot serve).
"""

from __future__ import annotations

from cgregistry.key.descriptor import BatchDescriptor

__all__ = ["KEY_CLASSES", "check_serves", "class_of", "declared_unsupported", "key_classes"]

# Nested like an attention backend's graph support levels: a strategy that cannot serve spec decode cannot
# serve mixed batches either (a mixed key serves uniform batches too), and one that cannot serve plain decode
# can serve none of them.
KEY_CLASSES: dict[str, str] = {
    "mixed": "mixed batches (prefill, chunked prefill, decode mixed with prefill)",
    "spec_decode": "uniform spec-decode batches (spec depth > 0)",
    "decode": "uniform single-token decode batches",
}
_IMPLIES = {"spec_decode": "mixed", "decode": "spec_decode"}


def key_classes(value: object, where: str) -> frozenset[str]:
    """``value`` (key class names, or one name) as a frozenset, checked: known names, nested as KEY_CLASSES says;
    ``where`` names the declaration in errors (``unsupported['full']``)."""
    if isinstance(value, str):
        value = (value,)
    try:
        names = frozenset(value)  # type: ignore[call-overload]
    except TypeError:  # not iterable, or unhashable items
        raise ValueError(f"{where} must be key class names, got {value!r}") from None
    bad = sorted(map(repr, names - KEY_CLASSES.keys()))
    if bad:
        raise ValueError(f"{where}: unknown key class {', '.join(bad)}; expected some of {', '.join(KEY_CLASSES)}")
    for name in sorted(names):
        implied = _IMPLIES.get(name)
        if implied is not None and implied not in names:
            raise ValueError(
                f"{where} = {sorted(names)}: a strategy that cannot serve {name!r} cannot serve "
                f"{implied!r} either (key classes nest: mixed, then spec_decode, then decode); add {implied!r}"
            )
    return names


def declared_unsupported(strategy: object) -> frozenset[str]:
    """The key classes a strategy object declares it cannot serve (its optional ``unsupported_classes``), checked."""
    declared = getattr(strategy, "unsupported_classes", ())
    return key_classes(declared, f"unsupported_classes of strategy {getattr(strategy, 'name', strategy)!r}")


def class_of(key: BatchDescriptor) -> str:
    """The key class of a key or batch: ``mixed`` (not uniform), ``spec_decode`` (uniform, depth > 0) or ``decode``."""
    if not key.uniform:
        return "mixed"
    return "spec_decode" if key.spec_depth > 0 else "decode"


def check_serves(key: BatchDescriptor, strategy: object) -> None:
    """Refuse a plan entry whose key is of a class its strategy declares it cannot serve (a ValueError naming both)."""
    cls = class_of(key)
    declared = declared_unsupported(strategy)
    if cls in declared:
        name = getattr(strategy, "name", strategy)
        raise ValueError(
            f"plan entry {key} [{name}] is a {cls} key, but strategy {name!r} cannot serve {KEY_CLASSES[cls]} "
            f"(its unsupported_classes: {', '.join(sorted(declared))}); give the key to a strategy that serves "
            "it, or drop it (CapturePlan.build with these plugins leaves such keys out)"
        )
