"""torch's process-wide settings for the length of a block, then as they were: the run of a
command sets them around its work (validate: one intra-op thread; step: the default dtype)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def torch_setting(get: Callable[[], Any], put: Callable[[Any], None], value: Any) -> Iterator[None]:
    """`put(value)` for a block, then `put` of what `get()` gave before (also after an error)."""
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


def torch_threads(count: int):
    """torch's intra-op threads set to `count` for a block."""
    return torch_setting(torch.get_num_threads, torch.set_num_threads, count)


def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` for a block (what a recipe's `model()` builds in)."""
    return torch_setting(torch.get_default_dtype, torch.set_default_dtype, dtype)
