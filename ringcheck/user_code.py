"""A user's code named as `package.module:attr.path` (an implementation, a layout): one loader."""

from __future__ import annotations

import importlib


def import_object(spec: str, what: str) -> object:
    """The object `package.module:attr.path` names (a user's implementation or layout); a
    ValueError that starts with `what` and says what to fix otherwise."""
    head, _, tail = spec.partition(":")
    try:
        obj = importlib.import_module(head)
    except ImportError as exc:
        raise ValueError(f"{what}: cannot import module {head!r} ({exc}); is it installed, or is its directory on "
                         f"PYTHONPATH?") from exc
    for part in tail.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: module {head!r} has no attribute {tail!r}")
        obj = getattr(obj, part)
    return obj
