"""Where ranks run, and the GPU paths that a CPU can check: each rank's device chosen from an
injected device count (`ringcheck.launch.devices.rank_device`), the refusal of CUDA-only code on
ranks that are on the CPU, the wait of a GPU transfer polled from the waiting thread
(`ringcheck.ring.comm.wait_work`, with a stand-in for NCCL's `Work`), the NCCL timeout of a
ring's groups, and a rank's result that holds a GPU tensor leaving the rank on the CPU. What
only NCCL can show is in docs/how-to/torchrun.md ("What only a GPU run shows")."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ringcheck.launch import control_timeout, wire
from ringcheck.launch.common import group_timeout, ring_backend
from ringcheck.launch.devices import Accelerators, cpu_ranks_refusal, rank_device
from ringcheck.ring.comm import wait_work

NONE, ONE, EIGHT = Accelerators(0), Accelerators(1, "3"), Accelerators(8, "0,1,2,3,4,5,6,7")


# ---- each rank's device ------------------------------------------------------------------------

@pytest.mark.parametrize("local_rank, local_world, gpus, request_, expected", [
    (0, 1, NONE, "auto", "cpu"),          # no GPU: a gloo world on the CPU
    (3, 4, EIGHT, "cpu", "cpu"),          # --device cpu on a GPU machine
    (3, 4, EIGHT, "auto", "cuda:3"),      # one GPU per rank
    (7, 8, EIGHT, "cuda", "cuda:7"),
    (1, 2, ONE, "auto", "cuda:0"),        # per-rank CUDA_VISIBLE_DEVICES (SLURM --gpus-per-task=1)
    (5, None, ONE, "auto", "cuda:0"),     # the launcher did not say how many ranks share the machine
    (2, None, Accelerators(4), "auto", "cuda:2"),
])
def test_each_rank_gets_its_device(local_rank, local_world, gpus, request_, expected):
    assert rank_device(local_rank, local_world, gpus, request_) == torch.device(expected)


def test_more_ranks_than_gpus_is_an_error_that_names_the_fix():
    """Before: `cuda:{LOCAL_RANK}` unchecked, "invalid device ordinal" on every rank at start-up."""
    four = Accelerators(4, "0,1,2,3")
    for local_rank in (0, 5):  # every rank of the machine says so, not only the ranks past the last GPU
        with pytest.raises(RuntimeError) as info:
            rank_device(local_rank, 8, four)
        said = str(info.value)
        assert "8 ranks on this machine" in said and "4 visible CUDA devices" in said
        assert "CUDA_VISIBLE_DEVICES '0,1,2,3'" in said and "--nproc-per-node=4" in said
        assert "--device cpu" in said and "RINGCHECK_DEVICE=cpu" in said
    with pytest.raises(RuntimeError, match="LOCAL_RANK 4"):
        rank_device(4, None, four)


def test_cuda_asked_for_without_a_gpu_and_bad_requests():
    with pytest.raises(RuntimeError, match=r"--device cuda was asked for, but this rank sees no CUDA device "
                                           r"\(CUDA_VISIBLE_DEVICES unset"):
        rank_device(0, 2, NONE, "cuda")
    with pytest.raises(ValueError, match="--device 'gpu' is not a device choice; pass one of auto, cpu, cuda"):
        rank_device(0, 2, EIGHT, "gpu")
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer >= 0, got -1"):
        rank_device(-1, 2, EIGHT)


def test_local_rings_refuse_cuda():
    from ringcheck.launch import open_ring

    with pytest.raises(ValueError, match="--device cuda .* local rings are gloo processes on the CPU: launch with "
                                         "torchrun"):
        open_ring(device="cuda", environ={})


# ---- CUDA-only code on ranks on the CPU ------------------------------------------------------------

def test_ranks_on_the_cpu_refuse_cuda_only_backends_and_impls_where_there_are_gpus():
    for backend in ("triton", "flash_attn"):
        said = cpu_ranks_refusal(EIGHT, torchrun=False, backend=backend)
        assert said.startswith(f"--backend {backend} runs on CUDA tensors, and local rings are gloo processes")
        assert "launch with torchrun --nproc-per-node=<P> -m ringcheck" in said and "8 GPUs" in said
        assert "\n" not in said
        assert cpu_ranks_refusal(EIGHT, torchrun=True, backend=backend).endswith("drop --device cpu")
    said = cpu_ranks_refusal(EIGHT, torchrun=False, impl="ring_flash_attn:zigzag", impl_needs_cuda=True)
    assert said.startswith("--impl ring_flash_attn:zigzag runs on CUDA tensors")
    # what runs on CPU tensors is never refused: the torch backend, Triton's interpreter, a CPU machine
    assert cpu_ranks_refusal(EIGHT, torchrun=False, backend="torch") is None
    assert cpu_ranks_refusal(EIGHT, torchrun=False, backend="triton", interpreted=True) is None
    for backend in ("triton", "flash_attn"):
        assert cpu_ranks_refusal(NONE, torchrun=False, backend=backend, impl_needs_cuda=True) is None


# ---- NCCL's wait, polled ---------------------------------------------------------------------------

class NcclLikeWork:
    """NCCL's `Work` as the waiting thread sees it: `is_completed()` turns true after `polls`
    polls (never with None); `wait()` records the thread it ran on and whether the work was done
    (NCCL's `wait` makes the calling thread's current CUDA stream wait for the transfer)."""

    def __init__(self, polls: int | None):
        self.polls, self.asked, self.waits = polls, 0, []

    def is_completed(self) -> bool:
        self.asked += 1
        return self.polls is not None and self.asked > self.polls

    def wait(self, timeout=None) -> bool:
        self.waits.append((threading.current_thread(), self.polls is not None and self.asked > self.polls))
        return True


def test_a_gpu_transfer_is_waited_on_only_once_it_completed_and_from_this_thread():
    work = NcclLikeWork(polls=5)
    wait_work(work, 5.0, lambda: None, poll=True)
    assert work.waits == [(threading.current_thread(), True)]


def test_a_gpu_wait_given_up_on_never_calls_wait():
    """Before, the wait ran in a helper thread that, given up on, stayed blocked in NCCL's `wait`
    and left the device's default stream waiting behind a transfer that never ends."""
    work, start = NcclLikeWork(polls=None), time.monotonic()
    with pytest.raises(Exception, match="rank 1 raised ValueError"):
        wait_work(work, 30.0, lambda: "rank 1 raised ValueError" if time.monotonic() - start > 0.1 else None,
                  poll=True)
    assert work.waits == [] and time.monotonic() - start < 2.0
    work = NcclLikeWork(polls=None)
    with pytest.raises(RuntimeError, match=r"did not complete within 0.2 s \(polled; never waited on"):
        wait_work(work, 0.2, None, poll=True)
    assert work.waits == []


def test_a_cpu_transfer_is_still_waited_on_in_a_helper_thread_when_watched():
    work = NcclLikeWork(polls=0)
    wait_work(work, 5.0, lambda: None, poll=False)  # gloo: a blocked wait cannot be polled cheaply
    assert len(work.waits) == 1 and work.waits[0][0] is not threading.current_thread()


def test_ring_groups_on_a_gpu_outlast_the_rings_own_deadline():
    """NCCL's watchdog aborts the process when a group's timeout passes: it must not fire before
    RingComm's deadline (the ring timeout) and the verdict that follows it. Before, ring groups
    were made with the ring timeout itself."""
    assert group_timeout(60.0, "cpu") == 60.0
    assert group_timeout(60.0, "cuda:3") == control_timeout(60.0) > 60.0
    assert ring_backend("cpu") == "gloo"
    assert ring_backend("cuda:0") == "cpu:gloo,cuda:nccl"  # named, not inherited from a world made NCCL-only


# ---- a GPU tensor in a rank's result ---------------------------------------------------------------

class OnTheGpu(torch.Tensor):
    """A tensor that says it lives on `cuda` (a CPU stand-in for a CUDA tensor): only a copy to the
    CPU works on it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device="cuda")
        t.values = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return args[0].values.clone().to(kwargs.get("dtype") or args[0].values.dtype)
        raise RuntimeError(f"{func} on a tensor on a GPU")


def test_a_gpu_tensor_anywhere_in_a_result_leaves_the_rank_on_the_cpu():
    """Before, a result holding a CUDA tensor was rebuilt on the sender's GPU in every rank (a
    CUDA context on every other GPU, or "invalid device ordinal" where each rank sees one)."""
    values = torch.arange(6.0).view(2, 3)
    result = {"out": OnTheGpu(values), "pair": (1, [OnTheGpu(values[0].contiguous())]), "cpu": values}
    assert result["out"].device.type == "cuda"
    back = wire.loads(wire.dumps(result))
    for got, want in ((back["out"], values), (back["pair"][1][0], values[0]), (back["cpu"], values)):
        assert type(got) is torch.Tensor and got.device.type == "cpu" and torch.equal(got, want)
    meta = torch.empty(3, device="meta")  # no data to copy: it travels as it is
    assert wire.loads(wire.dumps(meta)).device.type == "meta"


# ---- the commands: --device, and what local rings refuse on a machine with GPUs --------------------

def test_commands_that_run_rings_take_device(capsys):
    from ringcheck.cli import build_parser

    parser = build_parser()
    for command in (["validate"], ["drift"], ["train"], ["step"], ["step", "--model", "llama"]):
        assert parser.parse_args([*command, "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["validate", "--device", "gpu"])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["validate", "--backend", "flash_attn"], "--backend flash_attn runs on CUDA tensors, and local rings are gloo"),
    (["validate", "--backend", "triton"], "--backend triton runs on CUDA tensors, and local rings are gloo"),
    (["drift", "--impl", "ringcheck", "--backends", "torch,triton"], "--backend triton runs on CUDA tensors"),
    (["train", "--backend", "flash_attn"], "--backend flash_attn runs on CUDA tensors"),
    (["validate", "--device", "cuda"], "--device cuda puts each rank on its own GPU, and local rings are gloo"),
])
def test_local_rings_on_a_machine_with_gpus_refuse_cuda_only_code_in_one_line(monkeypatch, capsys, torchrun_world,
                                                                              argv, said):
    """Before, every rank got CPU tensors and raised ("flash-attn runs on CUDA tensors", "compiled for the
    GPU but got tensors on cpu"), and nothing said to launch with torchrun."""
    if torchrun_world is not None:
        pytest.skip("local rings: run with plain pytest")
    from ringcheck.cli import EXIT_USAGE, main
    from ringcheck.launch import devices

    monkeypatch.setattr(devices, "probe", lambda environ=None: EIGHT)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RINGCHECK_DEVICE", raising=False)
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err
    if "--device" not in argv:
        assert "launch with torchrun --nproc-per-node=<P> -m ringcheck ... (this machine has 8 GPUs)" in err


def test_bench_names_the_transport_it_ran_on(monkeypatch):
    """bench runs on local gloo rings; before, it said "nccl" wherever CUDA was available."""
    from ringcheck.commands.bench import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert machine()["ring_backend"] == "gloo"
