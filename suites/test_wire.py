"""The pipes between a local ring's parent and its workers (`ringcheck.launch.wire`): every
tensor comes back with the same bits, dtype, shape and flags, whichever path it took."""

from __future__ import annotations

import pickle

import pytest
import torch

from ringcheck.launch import wire

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its width (NaN payloads and -0.0 compare as bits)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t).contiguous().view(torch.int32)
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    return t.contiguous().view(width)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
            and torch.equal(_bits(a.detach()), _bits(b.detach())))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 5, 3, 8)], ids=str)
def test_a_dense_tensor_comes_back_bit_for_bit(dtype, shape):
    t = (torch.randn(shape, dtype=torch.float64) * 1e3).to(dtype)
    back = wire.loads(wire.dumps(t))
    assert _same(t, back) and back.is_contiguous()
    back.add_(1) if dtype != torch.bool else back.logical_not_()  # writable, and its own memory
    assert _same(t, wire.loads(wire.dumps(t)))


def test_special_values_keep_their_bits():
    t = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 65504.0])
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    for x in (t, payload, t.to(torch.bfloat16), t.to(torch.float16)):
        assert _same(x, wire.loads(wire.dumps(x)))


def test_tensors_torch_must_pickle_take_its_path_and_still_come_back():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    leaf = torch.randn(3, 4, requires_grad=True)
    cases = {"a column slice (non-contiguous)": base[:, 1:3], "a row slice (offset into a larger storage)": base[2:],
             "transposed": base.t(), "requires grad": leaf, "a parameter": torch.nn.Parameter(torch.ones(2)),
             "conjugated": torch.randn(3, dtype=torch.complex64).conj()}
    for what, t in cases.items():
        back = wire.loads(wire.dumps(t))
        assert type(back) is type(t) and _same(t.resolve_conj(), back.resolve_conj()), what
        assert back.stride() == t.stride() or not t.is_contiguous(), what


def test_containers_objects_and_repeated_tensors():
    t = torch.randn(2, 3)
    obj = {"out": t, "again": t, "list": [t.to(torch.bfloat16), None, 3.5, "text"], "dtype": torch.float16,
           "nested": ({"x": torch.ones(1, dtype=torch.int64)},)}
    back = wire.loads(wire.dumps(obj))
    assert back["again"] is back["out"] and _same(back["out"], t)  # one object pickled once stays one
    assert _same(back["list"][0], obj["list"][0]) and back["list"][1:] == [None, 3.5, "text"]
    assert back["dtype"] is torch.float16 and _same(back["nested"][0]["x"], obj["nested"][0]["x"])


def test_what_it_writes_is_plain_pickle():
    t = torch.randn(4, dtype=torch.bfloat16)
    assert _same(pickle.loads(wire.dumps(t)), t)
    assert len(wire.dumps(t)) < len(pickle.dumps(t))  # no legacy torch.save header per storage


def test_a_tensor_comes_back_as_its_own_bytearray_and_an_older_pickle_of_bytes_still_loads():
    """The bytes travel in band as the tensor's own memory and come back as one bytearray the
    tensor takes over (writable, no second copy); a pickle an older ringcheck wrote (bytes) loads."""
    t = torch.randn(4, 5, dtype=torch.float64)
    back = wire.loads(wire.dumps({"a": t, "b": t.clone()}))
    assert _same(back["a"], t) and _same(back["b"], t)
    assert back["a"].untyped_storage().data_ptr() != back["b"].untyped_storage().data_ptr()
    older = pickle.dumps(wire._rebuild(t.numpy().tobytes(), t.dtype, tuple(t.shape)))
    assert _same(pickle.loads(older), t)
    assert _same(wire._rebuild(t.numpy().tobytes(), t.dtype, tuple(t.shape)), t)
