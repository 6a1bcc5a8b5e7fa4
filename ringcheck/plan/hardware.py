"""Device and link presets of `ringcheck plan`, each figure with its source.

Rates are vendor datasheet peaks for dense math (the datasheets print the 2:4-sparsity figure
first; the dense one is half of it). Memory sizes are the datasheets' "GB", which for GPU memory
are binary gibibytes (HBM stacks and GDDR chips come in powers of two: an "80GB" H100 reports
81,559 MiB in nvidia-smi), less what the CUDA context, the communication library and the
allocator's fragmentation take (`DEFAULT_RESERVE_GIB`, a flag). Link bandwidths are per
direction: a ring step sends one block to the next GPU while it receives one from the previous
GPU, so what bounds it is one direction of one link. NVIDIA quotes NVLink as the total of both
directions (H100: 900 GB/s = 450 GB/s each way); PCIe x16 as 64 GB/s (Gen4) or 128 GB/s (Gen5)
both ways. GB/s here is 1e9 bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30
DEFAULT_RESERVE_GIB = 2.0  # CUDA context (~0.5 GiB), NCCL buffers, allocator fragmentation: never free for tensors


@dataclass(frozen=True)
class Device:
    name: str
    what: str
    memory_gib: float        # datasheet capacity, binary GiB
    bf16_tflops: float       # dense tensor-core rate for bf16/fp16 inputs with fp32 accumulation
    fp32_tflops: float       # dense fp32 rate (no TF32)
    link: str                # the link two of them use by default
    source: str


@dataclass(frozen=True)
class Link:
    name: str
    what: str
    gb_per_s: float          # one direction, 1e9 bytes per second
    source: str
    max_ring: int | None = None  # how many GPUs it can join in a ring (None: any number)


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("h100", "NVIDIA H100 SXM5 80GB", 80, 989.4, 66.9, "nvlink4",
           "NVIDIA H100 Tensor Core GPU datasheet: BF16 tensor core 1,979 TFLOPS with sparsity (989.4 dense), "
           "FP32 67 TFLOPS, 80GB HBM3, NVLink 900GB/s"),
    Device("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, 756.5, 51.2, "pcie5",
           "NVIDIA H100 Tensor Core GPU datasheet (PCIe column): BF16 tensor core 1,513 TFLOPS with sparsity "
           "(756.5 dense), FP32 51 TFLOPS, 80GB HBM2e, PCIe Gen5 128GB/s"),
    Device("h200", "NVIDIA H200 SXM 141GB", 141, 989.4, 66.9, "nvlink4",
           "NVIDIA H200 Tensor Core GPU datasheet: BF16 tensor core 1,979 TFLOPS with sparsity (989.4 dense), "
           "FP32 67 TFLOPS, 141GB HBM3e, NVLink 900GB/s"),
    Device("a100-80g", "NVIDIA A100 SXM4 80GB", 80, 312.0, 19.5, "nvlink3",
           "NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor core 312 TFLOPS (624 with sparsity), FP32 19.5 "
           "TFLOPS, 80GB HBM2e, NVLink 600GB/s"),
    Device("a100-40g", "NVIDIA A100 SXM4 40GB", 40, 312.0, 19.5, "nvlink3",
           "NVIDIA A100 Tensor Core GPU datasheet: BF16 tensor core 312 TFLOPS (624 with sparsity), FP32 19.5 "
           "TFLOPS, 40GB HBM2, NVLink 600GB/s"),
    Device("rtx4090", "NVIDIA GeForce RTX 4090", 24, 165.2, 82.6, "pcie4",
           "NVIDIA Ada GPU architecture whitepaper, appendix table: peak BF16 tensor TFLOPS with FP32 accumulate "
           "165.2 (330.4 with sparsity), peak FP32 82.6 TFLOPS, 24GB GDDR6X; no NVLink"),
    Device("rtx3090", "NVIDIA GeForce RTX 3090", 24, 71.0, 35.6, "pcie4",
           "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix table: peak BF16 tensor TFLOPS with FP32 "
           "accumulate 71 (142 with sparsity), peak FP32 35.6 TFLOPS, 24GB GDDR6X"),
)}

LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink4", "NVLink 4 (H100/H200 SXM, through NVSwitch)", 450.0,
         "H100/H200 datasheets: NVLink 900GB/s, both directions together"),
    Link("nvlink3", "NVLink 3 (A100 SXM, through NVSwitch)", 300.0,
         "A100 datasheet: NVLink 600GB/s, both directions together"),
    Link("nvlink-bridge3", "NVLink bridge between two RTX 3090s", 56.25,
         "GA102 whitepaper: NVLink x4 links, 112.5 GB/s total bandwidth between two RTX 3090s", max_ring=2),
    Link("pcie4", "PCIe Gen4 x16", 32.0, "A100 datasheet: PCIe Gen4 64GB/s, both directions together"),
    Link("pcie5", "PCIe Gen5 x16", 64.0, "H100 datasheet: PCIe Gen5 128GB/s, both directions together"),
    Link("ib-ndr", "InfiniBand NDR, one 400 Gb/s port per GPU", 50.0,
         "NVIDIA ConnectX-7 datasheet: 400Gb/s InfiniBand NDR per port (400/8 = 50 GB/s each way)"),
    Link("ib-hdr", "InfiniBand HDR, one 200 Gb/s port per GPU", 25.0,
         "NVIDIA ConnectX-6 datasheet: 200Gb/s InfiniBand HDR per port (200/8 = 25 GB/s each way)"),
)}

# `--link nvlink`: the NVLink of the device named
NVLINK_OF = {"h100": "nvlink4", "h200": "nvlink4", "a100-80g": "nvlink3", "a100-40g": "nvlink3",
             "rtx3090": "nvlink-bridge3"}


def device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"--device {name!r} is not a preset; choose one of {', '.join(DEVICES)} (--memory-gib "
                         f"and --tflops change a preset's figures to describe another GPU)")
    return DEVICES[name]


def link(name: str, device_name: str) -> Link:
    """The link preset `name` (`nvlink`: the named device's own NVLink), or a plain number: GB/s
    per direction."""
    if name == "nvlink":
        if device_name not in NVLINK_OF:
            raise ValueError(f"--link nvlink: the {device_name} has no NVLink; choose one of "
                             f"{', '.join(LINKS)} or a bandwidth in GB/s per direction")
        return LINKS[NVLINK_OF[device_name]]
    if name in LINKS:
        return LINKS[name]
    try:
        value = float(name)
    except ValueError:
        raise ValueError(f"--link {name!r} is not a preset; choose nvlink, one of {', '.join(LINKS)}, or a "
                         f"bandwidth in GB/s per direction (e.g. --link 20)") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"--link {name!r}: a bandwidth must be a positive number of GB/s per direction")
    return Link(f"{value:g} GB/s", f"a link of {value:g} GB/s per direction", value, "given on the command line")
