"""The shared measurement instruments (ringcheck/measure/): the peak bytes of tensor storage
that a call holds, checked against calls whose peak is known to the byte."""

import pytest
import torch

from ringcheck.measure import peak_bytes
from ringcheck.measure.memory import StorageTracker, measured_device


def test_known_allocations_give_their_peak_and_the_result():
    def allocate():
        a = torch.empty(1000)                          # 4000 bytes
        b = torch.empty(250, dtype=torch.float64)      # 2000: 6000 live, the peak
        view = a.view(10, 100)                         # a view: no new storage
        a.add_(1.0)                                    # in place: nothing new
        del a, view                                    # 2000 live
        c = torch.empty(3000, dtype=torch.int8)        # 5000 live
        return b, c

    peak, (b, c) = peak_bytes(allocate, device="cpu")
    assert peak == 6000
    assert b.numel() == 250 and c.numel() == 3000


def test_what_was_live_before_and_views_of_it_count_nothing():
    x = torch.randn(64, 32)
    peak, out = peak_bytes(lambda: x.t().reshape(32, 64).unsqueeze(0).add_(0.0), device="cpu")
    assert peak == 0 and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_freed_storage_is_taken_off():
    def churn():
        for _ in range(10):
            t = torch.ones(1000)       # 4000 bytes, freed at the next assignment
            t = t * 2                  # the product lives while t's first storage does
        return t

    assert peak_bytes(churn, device="cpu")[0] == 8000


def test_a_forward_and_backward_whose_peak_is_known():
    """h = x @ W, then h's backward with a given gradient: live at once are h and dx (n x d
    float32 each); W's transpose inside mm's backward is a view of an input and counts nothing."""
    n, d = 64, 32
    x = torch.randn(n, d, requires_grad=True)
    w, g = torch.randn(d, d), torch.randn(n, d)

    def forward_backward():
        h = x @ w
        h.backward(g)
        return h

    peak, h = peak_bytes(forward_backward, device="cpu")
    assert peak == 2 * n * d * 4
    assert torch.equal(x.grad, g @ w.t())


def test_attention_peak_grows_with_the_square_of_the_length():
    """Eager softmax attention holds n x n scores: doubling n quadruples that part."""
    def attention_peak(n: int) -> int:
        q, k, v = (torch.randn(n, 16, requires_grad=True) for _ in range(3))

        def run():
            out = torch.softmax(q @ k.t(), dim=-1) @ v
            out.sum().backward()
            return out
        return peak_bytes(run, device="cpu")[0]

    small, large = attention_peak(64), attention_peak(128)
    assert 64 * 64 * 4 * 2 <= small                  # scores and probabilities at least
    assert 3.5 < large / small < 4.0                 # n^2 terms dominate, the n d terms double


def test_the_tracker_stops_counting_when_the_call_is_over():
    with StorageTracker("cpu") as tracker:
        kept = torch.empty(256)
    assert tracker.live == tracker.peak == 1024
    del kept
    assert tracker.live == 1024                      # its finalizer was detached at the exit


def test_other_devices_are_not_counted_and_bad_devices_are_named():
    assert peak_bytes(lambda: torch.empty(10), device="meta")[0] == 0
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        peak_bytes(lambda: None, device="gpu0")
    if not torch.cuda.is_available():
        assert measured_device(None) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's peak needs CUDA")
def test_cuda_reads_the_allocators_peak():
    def allocate():
        a = torch.empty(1 << 20, device="cuda")       # 4 MiB
        b = torch.empty(1 << 19, device="cuda")       # 2 MiB: the peak, 6 MiB
        del a
        return b

    peak, b = peak_bytes(allocate, device="cuda")
    assert peak == 6 << 20 and b.is_cuda
