"""Pickling for the pipes between a local ring's parent and its workers, and for the results
a torchrun world's ranks gather.

A task's inputs and a rank's results are mostly small CPU tensors. Plain `pickle` sends each
through torch's own reduction, which writes every storage with the legacy `torch.save` (a
pickled header and a file-like round trip per tensor: about 0.1-0.2 ms each way), and a
validate run moves thousands of them. Here a dense CPU tensor that owns its storage whole
(contiguous, offset 0, the storage no larger than the tensor, no autograd history, a plain
`torch.Tensor`) travels as its raw bytes with dtype and shape, and is rebuilt from them: the
same bits by construction, in a fraction of the time. The bytes go out as the tensor's own memory
(pickle protocol 5's in-band buffer: no copy made to pickle it), the pickle is gathered in pieces
and joined once at its exact size (a `BytesIO` grows by an eighth at a time, copying all it holds:
a rank's result of a `step --model` run, 80 MB of gradients for a MoE's ten cases, took twice as
long through it), and each comes back as a bytearray the tensor takes over. Anything else (views into a larger
storage, non-contiguous or quantized tensors, tensors that require grad, subclasses, other
devices once on the CPU) takes torch's own path unchanged. Tensors on a GPU travel as CPU tensors:
the torchrun world gathers its ranks' results through `dumps` too.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

PROTOCOL = pickle.HIGHEST_PROTOCOL


def _rebuild(data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    # a bytearray: writable memory the tensor owns from here on (frombuffer shares it, no copy); the pickle's
    # own bytearray is this tensor's alone (a pickle of an older ringcheck holds bytes: copied)
    owned = data if type(data) is bytearray else bytearray(data)
    return torch.frombuffer(owned, dtype=torch.uint8).view(dtype).view(shape)


def _fast(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and not t.is_quantized and not t.is_conj() and not t.is_neg()
            and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.device.type not in ("cpu", "meta"):  # a GPU tensor leaves its rank on the CPU
            obj = obj.to("cpu")
            if not _fast(obj):
                return obj.__reduce_ex__(PROTOCOL)
        if _fast(obj):
            raw = obj.reshape(-1).view(torch.uint8) if obj.numel() else None
            data = b"" if raw is None else pickle.PickleBuffer(raw.numpy())  # in band: a bytearray when loaded
            return _rebuild, (data, obj.dtype, tuple(obj.shape))
        return NotImplemented


class _Pieces:
    """A pickler's file that keeps what it is given (its frames, and the large buffers it writes
    straight through) for one join at the end."""

    def __init__(self) -> None:
        self.pieces: list = []

    def write(self, piece) -> int:
        self.pieces.append(piece)
        return memoryview(piece).nbytes


def dumps(obj: Any) -> bytes:
    """`pickle.dumps(obj)`, with dense CPU tensors as their raw bytes, and tensors on a GPU (any
    device but the CPU and `meta`) wherever they are in `obj` as CPU tensors: a rank's result
    that holds a CUDA tensor would otherwise be rebuilt on the sender's GPU in every process
    that loads it (a CUDA context on each other GPU, or "invalid device ordinal" where each rank
    sees one GPU)."""
    out = _Pieces()
    _Pickler(out, protocol=PROTOCOL).dump(obj)  # the tensors stay alive, and unchanged, until the join
    return b"".join(out.pieces)


loads = pickle.loads  # what `dumps` writes is plain pickle: `_rebuild` is found by reference
