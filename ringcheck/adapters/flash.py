"""What the built-in adapters of rings built on flash-attn share (ring-flash-attn 0.1.8 and
yunchang 0.6.4, `ring_flash_attn.py` and `yunchang.py` beside this module): importing them
with the error that names what is missing, flash-attn 2's limits (float16 / bfloat16, one head
size), the padding tail of packed documents, and the flash-attn stand-in.

Both call flash-attn's block kernels, so on a machine without CUDA they run only through
ringcheck's CPU stand-in (`ringcheck.flash_stand_in`, ``--flash-attn-stand-in``).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import traceback

import torch
import torch.distributed as dist

from ..flash_stand_in import install as install_flash_stand_in
from ..ring.layouts import positions
from .contract import refuse_value_head_dim

PEERS = {"ring_flash_attn": ("ring-flash-attn", "ring-flash-attn==0.1.8"), "yunchang": ("yunchang", "yunchang==0.6.4")}
FLASH_DTYPES = ("bfloat16", "float16")  # flash-attn's kernels (and the stand-in) take these only


# ------------------------------------------------------------------------------- imports

def import_chain(exc: BaseException) -> list[str]:
    """The modules an import went through before it failed (outermost first), and the one missing."""
    chain: list[str] = []
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_globals.get("__name__", "?")
        if not name.startswith(("importlib", "ringcheck")) and (not chain or chain[-1] != name):
            chain.append(name)
    missing = getattr(exc, "name", None)
    if missing and (not chain or chain[-1] != missing):
        chain.append(missing)
    return chain


def import_error(spec: str, package: str, exc: ImportError) -> RuntimeError:
    from importlib.metadata import PackageNotFoundError, version  # only to name what is installed

    try:
        installed = f"{package} {version(package)}"
    except PackageNotFoundError:
        installed = package
    chain = " -> ".join(import_chain(exc))
    hint = ""
    if (getattr(exc, "name", "") or "").split(".")[0] == "flash_attn":
        hint = ("; it needs flash-attn: pass --flash-attn-stand-in to run it on ringcheck's CPU stand-in, or "
                "pip install flash-attn on a CUDA machine")
    return RuntimeError(f"--impl {spec}: {installed} is installed but cannot be imported: {type(exc).__name__}: "
                        f"{exc} (import chain: {chain}){hint}")


def require(spec: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        package, pin = PEERS[module]
        raise RuntimeError(f"--impl {spec} needs the {package} package: pip install {pin} --no-deps "
                           f"(or pip install 'ringcheck[peers]')")


def stand_in_task(member) -> str:
    """Ring task: install the stand-in in this rank's process (local ring workers live on between
    tasks, so a command runs it once per ring size before its own tasks); what it did, in words."""
    return install_flash_stand_in().describe()


# ------------------------------------------------------------------------------ helpers

def window_size(window) -> tuple[int, int]:
    return (-1, -1) if window is None else (int(window[0]), int(window[1]))


def padded_documents(cu_seqlens, seq_len: int) -> list[int]:
    """Global boundaries with ringcheck's padding tail as one more document (ring-flash-attn has none)."""
    cu = [int(x) for x in cu_seqlens]
    return cu + [seq_len] if cu[-1] < seq_len else cu


def zero_padding(out, lse, cu_seqlens, layout: str, rank: int, world: int):
    """out 0 and lse -inf on this rank's padding rows (positions past the last boundary)."""
    if cu_seqlens is None:
        return out, lse
    seq_len = out.shape[1] * world
    end = int(cu_seqlens[-1])
    if end >= seq_len:
        return out, lse
    pad = positions(layout=layout, rank=rank, world_size=world, seq_len=seq_len,
                    cu_seqlens=[int(x) for x in cu_seqlens]).to(out.device) >= end
    out = out.masked_fill(pad[None, :, None, None], 0.0)
    return out, lse.masked_fill(pad[None, None, :], float("-inf"))


def per_batch(call, q, k, v):
    """A varlen function takes (tokens, heads, dim): call it per batch element; out and lse stacked."""
    outs, lses = zip(*(call(q[b], k[b], v[b]) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses).float()


def flash_dtype(spec: str, target) -> None:
    """flash-attn 2's limits, which every ring built on it shares: float16 / bfloat16, and v
    with q's head dim."""
    if target.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"--impl {spec} runs on flash-attn, whose kernels take float16 and bfloat16 only (so does "
                         f"the stand-in); pass --dtype bfloat16 or --dtype float16, not {target.dtype}")
    refuse_value_head_dim(spec, "flash-attn 2, which has no value head dim of its own", target)


def rank_world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def repeat_kv(k, v, degree: int):
    """Repeat each K/V head until the K/V heads divide among `degree` ranks (Ulysses scatters heads)."""
    kv = k.shape[2]
    times = degree // math.gcd(kv, degree)
    return (k, v) if times == 1 else (k.repeat_interleave(times, 2), v.repeat_interleave(times, 2))


def causal_only(name: str):
    """`Impl.rule` of a ring that asserts causal (zig-zag and striped rings)."""
    def rule(layout: str, causal: bool) -> None:
        if not causal:
            raise ValueError(f"--impl {name} runs causal attention only; pass --causal")
    return rule
