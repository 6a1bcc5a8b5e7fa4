"""The peak bytes of tensor storage that one call holds: `peak_bytes(fn)`.

Why these instruments (the question is "how much tensor memory does this ring need at once,
and does it grow with N/P or with N"):

- **CUDA**: the caching allocator's own books. ``torch.cuda.max_memory_allocated`` counts the
  bytes handed to live tensors (not the cache it keeps), including the scratch a kernel
  allocates inside one op (a flash kernel's workspace); we take its peak during the call above
  what was allocated when the call began (``reset_peak_memory_stats`` first). Sizes are the
  allocator's, rounded up to its 512-byte blocks.
- **CPU (and any other device)**: a storage tracker (`StorageTracker`), a ``TorchDispatchMode``
  that every op's outputs pass through. A storage an op returns that none of its inputs holds
  is new memory: the tracker counts its bytes and sets a ``weakref.finalize`` that takes them
  off when the storage dies (torch keeps a storage's Python object alive as long as the storage,
  so the finalizer fires when the last tensor or view on it goes). Views and in-place results
  share an input's storage and count nothing; a wrapper subclass (DTensor) is let unwrap first,
  so its local tensors are what is counted. It sees what a call allocates as tensors, in forward
  and in the autograd backward (which runs on the calling thread on CPU), in point-to-point
  receive buffers and in functional collectives' outputs; it is deterministic (the same call
  gives the same bytes) and costs a Python call per op. What it does not see: the scratch one
  CPU kernel allocates and frees inside itself (that never outlives an op), tensors made outside
  the dispatcher (``torch.from_numpy``), and a storage grown later with ``resize_``.

Why not the others:

- the process's RSS (what ``ringcheck bench`` measured before): glibc's allocator and torch's
  CPU allocator keep freed memory mapped and reuse it, so the resident set's growth hides what
  was freed and reallocated during the call, and counts arena slack, Python objects and lazily
  imported code; it measures the process, not the ring's tensors;
- torch's ``torch.distributed._tools.mem_tracker.MemTracker``: it counts every storage an op
  *returns* the first time it sees it, so a view of a tensor made before the call counts that
  tensor's whole storage as new (measured: ``x @ W`` and its backward counted W, through the
  ``W.t()`` of mm's backward); a ring that reshapes its inputs would be charged for them;
- the profiler's memory events: recorded only on threads that carry the profiler's state,
  and each call pays a profile's post-processing to sum allocator traffic that we want as one
  number.

The bytes are those of storages created while the call runs (its inputs, made before, are not
counted); a storage the call frees that existed before it does not lower the count (the CUDA
delta would see that; a ring's call frees nothing of its caller's).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..thirdparty.torch_private import TorchDispatchMode

T = TypeVar("T")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def measured_device(device: torch.device | str | None) -> torch.device:
    """The device `peak_bytes` measures: `device`, or (None) the current CUDA device where CUDA
    is available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"peak_bytes: device={device!r} is not a torch device; pass 'cpu', 'cuda', "
                         "'cuda:1' or a torch.device") from exc
    if found.type == "cuda" and found.index is None:
        found = torch.device("cuda", torch.cuda.current_device())
    return found


def instrument(device: torch.device | str | None) -> str:
    """What `peak_bytes` reads on `device`, in words for a report."""
    kind = measured_device(device).type
    return "the CUDA caching allocator's peak" if kind == "cuda" else "tensor storage tracked per op"


def _storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    """The storages of the plain tensors in nested tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        if type(tree) in _PLAIN:
            yield tree.untyped_storage()
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _storages(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _storages(item)


class StorageTracker(TorchDispatchMode):
    """While inside: `live` bytes of the storages that ops created on `device` and that are
    still alive, and their `peak`. See the module's docstring."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self._counted: dict[int, tuple[int, weakref.finalize]] = {}
        self._lock = threading.Lock()  # a storage's last reference may drop on another thread

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            return NotImplemented  # a wrapper subclass (DTensor) unwraps; its local ops come back here
        result = func(*args, **(kwargs or {}))
        held = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(result):
            key = id(storage)
            if key in held or key in self._counted or storage.device != self.device:
                continue
            size = storage.nbytes()
            if size:
                with self._lock:
                    self._counted[key] = (size, weakref.finalize(storage, self._free, key))
                    self.live += size
        self.peak = max(self.peak, self.live)
        return result

    def _free(self, key: int) -> None:
        with self._lock:
            size, _ = self._counted.pop(key)
            self.live -= size

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        with self._lock:
            for _, finalizer in self._counted.values():
                finalizer.detach()  # storages that outlive the call (its result) no longer report here
            self._counted.clear()


def peak_bytes(fn: Callable[[], T], *, device: torch.device | str | None = None) -> tuple[int, T]:
    """The peak bytes of tensor storage live while fn() runs, above what was live when it started, and fn's result.

    `device` is where the storage is counted: 'cuda' (or 'cuda:i') reads the caching allocator's
    peak, anything else (the CPU by default where CUDA is absent) tracks storages through a
    dispatch mode; see the module's docstring for what each sees.
    """
    dev = measured_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = fn()
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - base), result
    with StorageTracker(dev) as tracker:
        result = fn()
    return tracker.peak, result
