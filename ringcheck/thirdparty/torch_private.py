"""torch's private surface, the one door to it: context parallel's ring functions and options,
the CPU flash kernels' ops, c10d's default store, NCCL's abort, the table of live groups, the
default timeout of new groups, functional collectives' group names, the dispatch-mode base,
autograd's engine entry, pytree, dynamo's reset and counters.

Names reached on call (or, for the classes a module derives from or checks against, on import
of that name: `TorchDispatchMode`, `ProcessGroup`, `Work`, `OpOverload`, `OpOverloadPacket`).
A moved name raises `SurfaceMoved`: "torch 2.14.0 moved torch.autograd._make_grads: ringcheck
supports torch 2.3–2.13 here; pin torch<=2.13 or upgrade ringcheck". The store and the abort
have a documented fallback instead (None: the launcher does without them).
"""

from __future__ import annotations

import datetime
from typing import Any

from .door import Door

TORCH = Door("torch", supported="2.3–2.13", fix="pin torch<=2.13")
# PyTorch's context parallel, as `--impl torch_cp` calls it (its module layout is the one of 2.13)
CONTEXT_PARALLEL = "torch.distributed.tensor.experimental._context_parallel._attention"
CP_OPTIONS = "torch.distributed.tensor.experimental._attention"
CP_SUPPORTED, CP_FIX = "2.13", "install torch==2.13.*"
_C10D = "torch.distributed.distributed_c10d"

# classes, reached when a module imports the name
_CLASSES = {"TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
            "ProcessGroup": ("torch._C._distributed_c10d", "ProcessGroup"),
            "Work": ("torch._C._distributed_c10d", "Work"),
            "OpOverload": ("torch._ops", "OpOverload"),
            "OpOverloadPacket": ("torch._ops", "OpOverloadPacket")}


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return TORCH.reach(*_CLASSES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- context parallel (adapters/torch_cp.py) -------------------------------------------------------

def cp_options() -> Any:
    """Context parallel's options object (`enable_load_balance`)."""
    return TORCH.reach(CP_OPTIONS, "_cp_options", supported=CP_SUPPORTED, fix=CP_FIX)


def templated_ring_attention(*args, **kwargs):
    return TORCH.reach(CONTEXT_PARALLEL, "_templated_ring_attention", supported=CP_SUPPORTED,
                       fix=CP_FIX)(*args, **kwargs)


def templated_ring_attention_backward(*args, **kwargs):
    return TORCH.reach(CONTEXT_PARALLEL, "_templated_ring_attention_backward", supported=CP_SUPPORTED,
                       fix=CP_FIX)(*args, **kwargs)


# -- aten's private ops ------------------------------------------------------------------------------

def cpu_flash_attention() -> tuple[Any, Any]:
    """The CPU flash kernel's forward and backward ops (`aten._scaled_dot_product_flash_attention_for_cpu`)."""
    return (TORCH.reach("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu.default"),
            TORCH.reach("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default"))


def to_copy_op() -> Any:
    """`aten._to_copy.default`: what a dtype or device cast dispatches to."""
    return TORCH.reach("torch", "ops.aten._to_copy.default")


def in_a_torch_mode() -> bool:
    """Whether a torch function mode or dispatch mode is active on this thread; True where this
    torch does not say (the caller then assumes the worst)."""
    function = TORCH.reach("torch", "_C._is_torch_function_mode_enabled", fallback=None)
    dispatch = TORCH.reach("torch", "_C._len_torch_dispatch_stack", fallback=None)
    if function is None or dispatch is None:
        return True
    return bool(function()) or dispatch() > 0


# -- c10d ------------------------------------------------------------------------------------------

def default_store() -> Any:
    """The store the default process group was made with; None where this torch does not say
    (the fallback: a failing rank's peers wait out the ring timeout)."""
    get = TORCH.reach(_C10D, "_get_default_store", fallback=None)
    if get is None:
        return None
    try:
        return get()
    except (RuntimeError, ValueError):  # no default group, or one made without a store
        return None


def abort_process_group() -> Any:
    """c10d's abort of one group's communicators (it does not wait for work in flight), or None
    where this torch has none (the fallback: destroy the group)."""
    return TORCH.reach(_C10D, "_abort_process_group", fallback=None)


def bound_new_groups(seconds: float) -> None:
    """Every group made in this process from now on without a timeout of its own (a trainer's
    `new_group`, its device mesh) waits at most `seconds`, as ringcheck's own do: c10d reads its
    default on each `new_group`, 30 min for gloo (10 for NCCL), which made a trainer's stalled ring a
    30-minute hang."""
    TORCH.reach(_C10D, "default_pg_timeout")  # where it has moved: one line, not a silent no-op
    c10d = TORCH.reach(_C10D)
    c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):
        c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=seconds)


def process_group_count() -> int:
    """How many process groups this process holds (the default group included)."""
    return len(TORCH.reach(_C10D, "_world.pg_map"))


def resolve_process_group(name: str) -> Any:
    """The process group of a functional collective's group name (no public resolver exists)."""
    return TORCH.reach(_C10D, "_resolve_process_group")(name)


# -- autograd, pytree, dynamo ---------------------------------------------------------------------

def make_grads(*args, **kwargs):
    return TORCH.reach("torch.autograd", "_make_grads")(*args, **kwargs)


def tensor_or_tensors_to_tuple(*args, **kwargs):
    return TORCH.reach("torch.autograd", "_tensor_or_tensors_to_tuple")(*args, **kwargs)


def engine_run_backward(*args, **kwargs):
    return TORCH.reach("torch.autograd.graph", "_engine_run_backward")(*args, **kwargs)


def extension_build_directory(name: str) -> str:
    """Where torch builds (and locks) the C++ extension `name` (cpp_extension._get_build_directory:
    TORCH_EXTENSIONS_DIR, else the default root with the Python and device tag), made if absent."""
    return TORCH.reach("torch.utils.cpp_extension", "_get_build_directory")(name, verbose=False)


def dynamo_reset() -> None:
    """Forget every compiled graph (torch._dynamo.reset)."""
    TORCH.reach("torch._dynamo", "reset")()


def dynamo_counters() -> Any:
    """torch._dynamo's counters (graph breaks, frames compiled)."""
    return TORCH.reach("torch._dynamo.utils", "counters")
