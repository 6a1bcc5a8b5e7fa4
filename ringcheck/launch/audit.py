"""The device audit: a CPU run that fails where a GPU run would, for a tensor on the wrong device.

On a GPU, a tensor made without naming its device (`torch.arange(n)`, `torch.zeros(...)`,
`torch.randn(..., generator=torch.Generator())`) lands on the CPU, and the first op that mixes it
with the rank's CUDA tensors raises "Expected all tensors to be on the same device". On a CPU the
default device and the rank's device are the same one, so the mistake never shows. Under the
audit (`RINGCHECK_DEVICE_AUDIT=1`, read by the commands, the launchers' `open_ring` and the
plugin; `device_audit()` for one call) every rank runs inside a `TorchFunctionMode` that keeps,
for every tensor, the side it would live on on a GPU:

- **the rank's side**: tensors the task was handed, and every tensor made with a device named
  (`device=q.device`, `.to(member.device)`, `.to(q)`, `.cuda()`) or from the rank's tensors
  (`zeros_like(q)`, `q.new_zeros`, any op on them);
- **the host side**: tensors made without a device (no tensor among the inputs, no `device=`),
  `.cpu()` copies, and what is computed from them alone. Each remembers where it was made: the
  first frame outside torch and this module (and, for a helper of ringcheck's called by a ring of
  the catalogue, the catalogue's line).

On a CPU a device named is taken for the rank's (it is `q.device` or the member's almost always;
a literal `device="cpu"` in a ring goes unseen); on a GPU the CPU is the host. An op that mixes
the two sides raises `DeviceAuditError` naming both lines, except where CUDA mixes them too: a
0-dim host tensor (a scalar), an index (`x[idx]`), `copy_`, `.to` and `.data =`. A host tensor
moved to the rank's device before it meets the rank's tensors is fine, as on a GPU. Torch pops a
mode while its handler runs, so a backward (`Tensor.backward`, `torch.autograd.grad`) is run with
the audit pushed again: custom Functions' backwards and checkpoint's recompute are audited too.
Tags live on storages (a view shares its base's side), in one table per process, so that a
workspace made in one task keeps its side in the next.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ..thirdparty.torch_private import (
    OpOverload,
    OpOverloadPacket,
    engine_run_backward,
    make_grads,
    tensor_or_tensors_to_tuple,
)
from .environment import AUDIT_ENV, audit_requested  # noqa: F401  (the audit's names, in one place)

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(_HERE))
_RUNNERS = ("harness", "launch", "commands", "models", "step", "train", "testing", "measure")
_RANK = "rank"
_MIXES_LIKE_CUDA = frozenset({"copy_", "to", "__getitem__", "__setitem__", "index_put_", "index_put",
                              "_has_compatible_shallow_copy_type", "set_", "is_same_size",
                              "data.__set__"})
OWN_CODE = " (in ringcheck's own code: a defect of ringcheck, not of the implementation under test)"
_MOVES = frozenset({"to", "cpu", "cuda"})
_state = threading.local()
# every storage's side, kept across tasks (a ring's workspace made in one task is met in the next)
_TAGS: Any = WeakIdKeyDictionary()
# the backward's entry points, whose Python code the audit follows into (`DeviceAudit._autograd`);
# torch's private pieces of them, present from torch 2.3 to 2.13 (checked at import)
_ENGINE_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _tensors_in(obj, found: list) -> list:
    """`found` with the tensors of `obj` (an op's arguments or result) appended: in tuples (named
    ones and torch's return types too), lists and dicts, at any depth. What torch's pytree flatten
    finds of them, without its bookkeeping per node: this runs on every op of an audited task."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (tuple, list, dict)):
                _tensors_in(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors_in(x, found)
    return found


def _first_host(tags):
    """The first host side among `tags`, or None."""
    return next((tag for tag in tags if tag is not _RANK), None)


class DeviceDefect(RuntimeError):
    """The audit found ringcheck's own code at fault: a command has no verdict (exit 2)."""


def check_own_code(reasons) -> None:
    """Raise `DeviceDefect` for the first of `reasons` (what a rank's task raised, in words) that
    the audit put on ringcheck's own code; a command calls this where it would call such a case
    'not run' and go on."""
    for reason in reasons:
        if OWN_CODE in str(reason):
            raise DeviceDefect(str(reason).strip().splitlines()[0])


class DeviceAuditError(RuntimeError):
    """A tensor on the host side met the rank's tensors: on a GPU this op raises. `created_at`:
    where the host tensor was made; `met_at`: the op; `ours`: made in ringcheck's own code (not
    an implementation under test, whose stand-ins in `ringcheck.catalogue` count as the user's)."""

    def __init__(self, message: str, *, created_at: str, met_at: str, ours: bool):
        super().__init__(message)
        self.created_at, self.met_at, self.ours = created_at, met_at, ours


def _where(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _site() -> tuple[str, bool]:
    """(where: the first frame outside torch and this module, ours). Ours: that frame is
    ringcheck's own code (its rings, glues, harness; not the catalogue, whose rings stand for
    somebody else's), and no frame of the catalogue called it before ringcheck's harness did;
    where the catalogue did, its line is named beside the first one."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or "<frozen" in frame.f_code.co_filename
                                 or os.path.abspath(frame.f_code.co_filename) == _HERE):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", False
    first = _where(frame)
    room = _room(frame.f_code.co_filename)
    if room != "core":
        return first, room == "runner"
    caller = frame.f_back
    while caller is not None:
        room = _room(caller.f_code.co_filename)
        if room == "catalogue":
            return f"{first}, called from {_where(caller)}", False
        if room == "runner":
            break
        caller = caller.f_back
    return first, True


def _room(filename: str) -> str:
    """'catalogue', 'runner' (what runs an implementation: harness, launch, the commands' and
    the models' tasks), 'core' (the rest of ringcheck) or 'other' (a user's, a third party's)."""
    path = os.path.abspath(filename)
    if not path.startswith(_PACKAGE_DIR + os.sep):
        return "other"
    part = path[len(_PACKAGE_DIR) + 1:].split(os.sep)[0]
    return "catalogue" if part == "catalogue" else "runner" if part in _RUNNERS else "core"


def _name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:   # a property of Tensor
        return f"{getattr(owner, '__name__', owner)}.{name}"
    return name


class _Host:
    """A host tensor's tag: where it (or the host tensor it was computed from) was made."""

    __slots__ = ("site", "ours", "what")

    def __init__(self, site: str, ours: bool, what: str):
        self.site, self.ours, self.what = site, ours, what


class DeviceAudit(TorchFunctionMode):
    """The audit of one rank's task, its rank device `rank_device` (see the module's doc)."""

    def __init__(self, rank_device: str | torch.device, *, judge_impl: bool = True):
        super().__init__()
        self.rank_device = torch.device(rank_device)
        self.judge_impl = judge_impl   # False: only ringcheck's own code raises (the launchers' audit)
        self.suspended = 0             # inside `on_the_host`: nothing is tagged or checked
        self._tags = _TAGS

    # ---- sides
    def _is_rank_device(self, device) -> bool | None:
        """True/False for a device argument; None where there is none."""
        if device is None:
            return None
        if self.rank_device.type == "cpu":   # a device named, on a CPU: taken for the rank's (q.device)
            return True
        return isinstance(device, int) or torch.device(device).type != "cpu"

    def _tag(self, t: torch.Tensor):
        try:
            return self._tags.get(t.untyped_storage(), _RANK)
        except (RuntimeError, NotImplementedError):   # a tensor with no storage of its own
            return _RANK

    def _set(self, out, tag, inputs) -> None:
        """Tag `out`'s fresh storages; a view of an input keeps its storage's side."""
        seen = set()
        for t in inputs:
            try:
                seen.add(id(t.untyped_storage()))
            except (RuntimeError, NotImplementedError):
                pass
        for t in _tensors_in(out, []):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(storage) in seen:
                continue
            if tag is _RANK:
                self._tags.pop(storage, None)
            else:
                self._tags[storage] = tag

    def _host(self, what: str) -> _Host:
        site, ours = _site()
        return _Host(site, ours, what)

    # ---- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        name = _name(func)
        if name in ("backward", "grad") and func in _ENGINE_CALLS:
            return self._autograd(func, args, kwargs)
        tensors = _tensors_in(kwargs, _tensors_in(args, []))
        tags = [self._tag(t) for t in tensors]  # each input's side, looked up once
        if name not in _MIXES_LIKE_CUDA:
            self._check_mix(name, tensors, tags)
        out = func(*args, **kwargs)
        tag = self._out_tag(name, func, args, kwargs, tensors, tags)
        if name in _MOVES and isinstance(out, torch.Tensor) and (tag is _RANK) != (self._tag(out) is _RANK):
            out = out.clone()   # same real device, other side: a copy, as the move is on a GPU
        self._set(out, tag, tensors)
        return out

    def _check_mix(self, name: str, tensors, tags) -> None:
        host = next((tag for t, tag in zip(tensors, tags) if tag is not _RANK and t.dim() > 0), None)
        if host is None or not any(tag is _RANK for tag in tags):
            return
        met, _ = _site()
        ours = host.ours
        if not ours and not self.judge_impl:
            return   # the implementation's: validate's `device placement` row judges it, the rest run on
        raise DeviceAuditError(
            f"device audit{OWN_CODE if ours else ''}: a tensor made on the host ({host.what} at {host.site}) meets the rank's tensors "
            f"in {name} at {met}; on a GPU this raises 'Expected all tensors to be on the same device'. "
            f"Name the device where it is made (device=q.device, or .to(q.device) before it meets them)",
            created_at=host.site, met_at=met, ours=ours)

    def _out_tag(self, name: str, func, args, kwargs, tensors, tags):
        if isinstance(func, (OpOverload, OpOverloadPacket)):
            # an operator called by name: by a dispatch mode (measure.memory's tracker) on what
            # autograd's engine allocates, with the real device filled in; it makes nothing
            # on the host of its own accord
            return _first_host(tags) or _RANK
        if name in ("cpu", "numpy"):
            return self._host(f"{name}()")
        if name == "cuda":
            return _RANK
        if name == "to":
            return self._to_tag(args, kwargs, tensors)
        if name in ("__getitem__", "index_put", "index_put_"):   # x[idx] is on x's device, wherever idx is
            return self._tag(args[0])
        if name == "grad.__get__":
            return self._tag(args[0])
        side = self._is_rank_device(kwargs.get("device"))
        if side is not None:
            return _RANK if side else self._host(f"{name}(device='cpu')")
        if not tensors:
            return self._host(f"torch.{name} without a device")
        if any(tag is _RANK for tag in tags) and all(t.dim() == 0 for t, tag in zip(tensors, tags) if tag is not _RANK):
            return _RANK   # the rank's tensors with host scalars: CUDA computes it on the rank's device
        return _first_host(tags) or _RANK

    def _autograd(self, func, args, kwargs):
        """A backward (`Tensor.backward`, `torch.autograd.backward`, `torch.autograd.grad`) run by
        autograd's engine with the audit pushed again: torch pops a mode while its handler runs,
        and the engine would run the backward's Python code (custom Functions, checkpoint's
        recompute) outside it. Each gradient `grad` returns is on its input's side."""
        call = inspect.signature(func).bind(*args, **kwargs).arguments
        if func is torch.autograd.grad:
            if call.get("is_grads_batched") or call.get("materialize_grads"):
                return func(*args, **kwargs)   # the vmapped and materialising forms: not audited inside
            outputs, inputs = _tuple(call["outputs"]), _tuple(call["inputs"])
            grads, retain, create = call.get("grad_outputs"), call.get("retain_graph"), call.get("create_graph", False)
        else:
            outputs = (call["self"],) if "self" in call else _tuple(call["tensors"])
            inputs = _tuple(call.get("inputs") or ())
            grads = call.get("gradient", call.get("grad_tensors"))
            retain, create = call.get("retain_graph"), call.get("create_graph", False)
        grads = make_grads(outputs, tensor_or_tensors_to_tuple(grads, len(outputs)), is_grads_batched=False)
        retain = create if retain is None else retain
        with self:
            if func is not torch.autograd.grad:
                engine_run_backward(outputs, grads, retain, create, inputs, allow_unreachable=True,
                                    accumulate_grad=True)
                return None
            result = engine_run_backward(outputs, grads, retain, create, inputs, call.get("allow_unused", False),
                                         accumulate_grad=False)
        for x, g in zip(inputs, result):
            if g is not None:
                self._set(g, self._tag(x), ())
        return result

    def _to_tag(self, args, kwargs, tensors):
        device = kwargs.get("device")
        others = [a for a in args[1:] if isinstance(a, torch.Tensor)] + ([kwargs["other"]] if "other" in kwargs else [])
        if others:
            return self._tag(others[0])
        if device is None:
            device = next((a for a in args[1:] if isinstance(a, (str, torch.device, int))
                           and not isinstance(a, bool)), None)
        side = self._is_rank_device(device)
        if side is None:
            return self._tag(args[0])
        return _RANK if side else self._host(".to('cpu')")


class device_audit:
    """`with device_audit(device):` runs the block under the audit for a rank on `device` (a
    launcher's member's). `judge_impl` False (the launchers' audit of
    every task): only a tensor made in ringcheck's own code raises, so that every verdict is the
    one without the audit and the implementation's placement is the `device placement` row's to
    judge. A nested audit of the same thread reuses the outer one, judging the implementation
    inside the block where it asks to."""

    def __init__(self, device: str | torch.device, *, enabled: bool = True, judge_impl: bool = True):
        self.device, self.enabled, self.judge_impl = device, enabled, judge_impl
        self._mode: DeviceAudit | None = None
        self._outer: tuple[DeviceAudit, bool] | None = None

    def __enter__(self) -> DeviceAudit | None:
        outer = getattr(_state, "active", None)
        if not self.enabled:
            return outer
        if outer is not None:
            self._outer = (outer, outer.judge_impl)
            outer.judge_impl = outer.judge_impl or self.judge_impl
            return outer
        self._mode = DeviceAudit(self.device, judge_impl=self.judge_impl)
        self._mode.__enter__()
        _state.active = self._mode
        return self._mode

    def __exit__(self, *exc) -> None:
        if self._outer is not None:
            self._outer[0].judge_impl = self._outer[1]
            self._outer = None
        if self._mode is not None:
            _state.active = None
            self._mode.__exit__(*exc)
            self._mode = None


def active_audit() -> DeviceAudit | None:
    """The audit this thread runs under, or None."""
    return getattr(_state, "active", None)


def check_handed(handed: dict, *, by: str, fn) -> None:
    """Under this thread's audit: `DeviceAuditError` where a tensor of `handed` (name -> what a
    glue's hook `fn` returned to the step) is on the host side. A trainer's own code may hand back
    host tensors by design (DeepSpeed's loader keeps its shards on the CPU, and its trainer moves
    them): the glue that calls it must move them, and the mix the model would meet later names the
    trainer's line as the maker, which the launchers' audit does not judge. `by`: the hook, in
    words; a glue of ringcheck's own (`fn` defined in ringcheck) is ringcheck's defect."""
    module = getattr(fn, "__module__", None) or ""
    ours = module.split(".")[0] == "ringcheck" and ".catalogue" not in module
    _check_on_the_rank(handed, ours, lambda name: f"{by} handed the step {name}",
                       "the model's first op on it raises 'Expected all tensors to be on the same device'. Move what "
                       "the trainer's code returns to the rank's device (.to(batch['input_ids'].device)), as its "
                       "trainer does")


def check_on_device(named: dict, *, by: str) -> None:
    """Under this thread's audit: `DeviceAuditError` where a tensor of `named` is on the host side,
    handed to a kernel that takes it on the device only and never mixes it with the rank's
    tensors on a CPU (flash-attn's varlen kernels check `cu_seqlens_q.is_cuda()`, flash_api.cpp's
    CHECK_DEVICE; the stand-in reads the boundaries with .tolist()). Whose defect: where it was made."""
    _check_on_the_rank(named, None, lambda name: f"{by} was handed {name}",
                       "the kernel raises '<name> must be on CUDA'. Name the device where it is made "
                       "(device=q.device, or .to(q.device) before it is handed over)")


def _check_on_the_rank(named: dict, ours: bool | None, said, gpu: str) -> None:
    """The two checks above: the first tensor of `named` (dim > 0) on the host side raises; `ours`
    None: ringcheck's where the tensor was made in ringcheck's own code."""
    audit = active_audit()
    if audit is None or audit.suspended:
        return
    for name, t in named.items():
        tag = audit._tag(t) if isinstance(t, torch.Tensor) and t.dim() > 0 else _RANK
        mine = tag.ours if ours is None and tag is not _RANK else ours
        if tag is _RANK or (not mine and not audit.judge_impl):
            continue
        met, _ = _site()
        raise DeviceAuditError(
            f"device audit{OWN_CODE if mine else ''}: {said(name)} made on the host ({tag.what} at {tag.site}); on a "
            f"GPU {gpu.replace('<name>', name)}", created_at=tag.site, met_at=met, ours=bool(mine))


class on_the_host:
    """`with on_the_host():` a block that runs on the CPU by design, on a GPU machine too (the
    truth of `step --model`: the model's own attention in float64, independent of the device):
    the audit of this thread, if any, neither tags nor checks inside it. On a CPU the audit
    cannot tell such a block's `device="cpu"` (transformers names its devices) from the rank's."""

    def __enter__(self) -> None:
        self._audit = active_audit()
        if self._audit is not None:
            self._audit.suspended += 1

    def __exit__(self, *exc) -> None:
        if self._audit is not None:
            self._audit.suspended -= 1
