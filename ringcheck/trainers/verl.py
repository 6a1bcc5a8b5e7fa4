"""`--glue verl`: verl 0.9.1's Ulysses sequence parallelism (`ulysses_sequence_parallel_size=P` of its
FSDP engine), run as it ships: its patch of transformers' flash path, its sharding of the packed row
and its gather of the per-token outputs before the loss.

- **Its patch**: `set_ulysses_sequence_parallel_group(group)` with the CP group
  (`verl/utils/ulysses.py` L34), then `apply_monkey_patch(model, ulysses_sp_size=P)`
  (`verl/models/transformers/monkey_patch.py` L294), which replaces transformers'
  `_flash_attention_forward` by `_ulysses_flash_attention_forward` (L87-155, L544-552): K/V heads
  repeated up to P where fewer, all-to-all sequence -> heads, the `position_ids` all-gathered, the
  flash path over the whole sequence, all-to-all back. `configure` runs it with the model's config;
  `uninstall` puts transformers' function back.
- **Its sharding** (`shard`), as `FSDPEngineWithLMHead.prepare_model_inputs` does it
  (`verl/workers/engine/fsdp/transformer_impl.py` L1145-1243): the micro-batch's samples unpadded
  into one packed row (L1191), the targets rolled on the whole packed row (L1201), then the row,
  its `position_ids` and the rolled targets padded to a multiple of P and sliced by
  `ulysses_pad_and_slice_inputs` (L1228-1237; `verl/utils/ulysses.py` L302). ringcheck hands every
  glue a row already padded to a multiple of P, so verl's own pad adds nothing here.
- **Its gather before the loss** (`gather`): `prepare_model_outputs` gathers the rank's per-token
  log-probs over the SP group with `gather_outputs_and_unpad(gather_dim=0, unpad_dim=0)` (L1437,
  L688; `verl/utils/ulysses.py` L247), whose backward scales by P (`grad_scaler=True`, L230): every
  rank computes the loss of the whole row, and the FSDP average over the SP ranks gives the
  gradient back. ringcheck's step does the same with its float64 per-token cross-entropy (the
  negative log-probs), and averages over the CP group (`Glue.gather`).
- **What it refuses, before any rank starts, one line each** (`refuses_ring`): verl's own head
  checks (L343-350: query heads divisible by P; K/V heads and P dividing one way), and a model
  class transformers does not run on the flash path.

Shims (`SHIMS`, the report prints them): `ray` stubbed; transformers' flash path on ringcheck's
flash-attn stand-in (`ringcheck.trainers.flash`); the CP group handed to verl's group code;
`apply_monkey_patch` given a stand-in model. No CUDA index is read on this path (ulysses.py and the
patch name no device), so none is mapped. Nothing else of verl's is changed. A crash inside verl's
code on a configuration it accepts is reported with verl's file:line (`in_verl`), never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import io
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..glues.contract import Glue
from ..step.contract import IGNORE, shift_labels
from ..thirdparty.transformers_private import (
    FLASH_FORWARD,
    causal_lm_class,
    compatible_flash_implementations,
    flash_forward_holders,
    restore_flash_forward,
    supports_attention,
)
from .flash import FLASH_CORE, install_flash_core
from .flash import SHIM as FLASH_SHIM

VERSION = "0.9.1"  # the verl this adapter was written and measured against
PIP_FIX = (f"pip install --no-deps verl=={VERSION} tensordict==0.10.0 omegaconf antlr4-python3-runtime==4.9.3 "
           f"cloudpickle orjson pyvers")
SHIMS = ("ray stubbed (an empty module with ray.ObjectRef): verl's package imports it at import (verl/protocol.py:29), "
         "for annotations; nothing of ray runs",
         FLASH_SHIM,
         "verl's set_ulysses_sequence_parallel_group is handed ringcheck's CP group (its FSDP engine hands it its "
         "device mesh's 'sp' group)",
         "apply_monkey_patch is given a stand-in model (the config and the causal-LM class's module: all it reads of "
         "the model before patching transformers' flash path, which is global)")


def verl_root() -> Path:
    """The installed verl package's directory, or ImportError with the fix."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"--glue verl runs verl's own Ulysses code, and verl is not installed; {PIP_FIX} (the "
                          f"versions this adapter was measured on; --no-deps: its declared dependencies pull "
                          f"ray, vllm and CUDA builds)")
    return Path(list(spec.submodule_search_locations)[0])


def verl_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """verl's `verl.utils.ulysses` and `verl.models.transformers.monkey_patch`, with `ray` stubbed
    first where it is not installed (shim 1)."""
    verl_root()
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        ray = types.ModuleType("ray", "a stub: verl imports ray for annotations (ringcheck)")
        ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        ray.ObjectRef = type("ObjectRef", (), {})
        sys.modules["ray"] = ray
    # optional: verl is a trainer's package, imported only for --glue verl
    from verl.models.transformers import monkey_patch
    from verl.utils import ulysses
    return ulysses, monkey_patch


def in_verl(exc: BaseException) -> str | None:
    """`verl/...py:LINE` of the innermost frame of `exc`'s traceback inside verl's package, or None
    (also where a frame of ringcheck's own, the flash-attn stand-in, is further in: not verl's crash)."""
    root, own = verl_root().parent, Path(__file__).resolve().parents[1]
    where, tb = None, exc.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if path.is_relative_to(root / "verl"):
            where = f"{path.relative_to(root)}:{tb.tb_lineno}"
        elif path.is_relative_to(own):
            where = None
        tb = tb.tb_next
    return where


def reported(call):
    """`call`, whose exception raised inside verl's code comes back as one RuntimeError naming verl's
    file:line: a configuration verl accepts that its code cannot run is a finding, not a traceback."""
    @functools.wraps(call)
    def run(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            where = in_verl(exc)
            if where is None:
                raise
            text = (str(exc).strip().splitlines() or [""])[0]
            raise RuntimeError(f"verl {VERSION}'s code raised {type(exc).__name__} at {where} on a configuration "
                               f"it accepts: {text}") from exc
    return run


class Verl:
    """The adapter: verl's entry points on the CP group, and the state between ringcheck's calls."""

    def __init__(self):
        self.undo_core = None   # the flash core's shim, undone by uninstall
        self.held = None        # transformers' _flash_attention_forward before verl's patch
        self.pad = 0            # verl's pad of the last packed row (its prepare_model_inputs' pad_size)

    def install(self, group) -> str:
        ulysses, _ = verl_modules()
        if self.undo_core is None:
            self.undo_core = install_flash_core()
        ulysses.set_ulysses_sequence_parallel_group(group)  # shim 3: the CP group
        # verl's all_gather_into_tensor (ulysses.py L165), which torch 2.13 calls deprecated, once per gather
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
        return FLASH_CORE

    def configure(self, config, group) -> None:
        """verl's `apply_monkey_patch(model, ulysses_sp_size=P)` for this model's config (its printed
        lines kept out of the report), its patched function wrapped by `reported`."""
        _, monkey_patch = verl_modules()
        module = causal_lm_class(config).__module__
        self.put_back()
        self.held = flash_forward_holders(module)
        model = SimpleNamespace(config=config, __module__=module)  # shim 4
        with contextlib.redirect_stdout(io.StringIO()):
            monkey_patch.apply_monkey_patch(model, ulysses_sp_size=dist.get_world_size(group))
        for name, function in flash_forward_holders(module).items():
            if function is not self.held.get(name):   # verl's: errors inside it named with verl's file:line
                setattr(sys.modules[name], FLASH_FORWARD, reported(function))

    def put_back(self) -> None:
        if self.held is not None:
            restore_flash_forward(self.held)
            self.held = None

    def uninstall(self) -> None:
        self.put_back()
        if self.undo_core is not None:
            self.undo_core()
            self.undo_core = None
        ulysses, _ = verl_modules()
        ulysses.set_ulysses_sequence_parallel_group(None)

    def shard(self, batch: dict, group) -> dict:
        """`prepare_model_inputs`' packing, roll and `ulysses_pad_and_slice_inputs` (see the module's
        docstring) on the micro-batch's one packed row."""
        ulysses, _ = verl_modules()
        ids, pos = batch["input_ids"], batch["position_ids"]
        if ids.shape[0] != 1:
            raise ValueError(f"verl's prepare_model_inputs packs a micro-batch's {ids.shape[0]} rows into one sequence "
                             f"(transformer_impl.py L1191); ringcheck's step holds rows apart, so this case is not "
                             f"judged")
        size = dist.get_world_size(group)
        rolled = torch.roll(ids, shifts=-1, dims=1)        # L1201: on the whole packed row
        where = torch.arange(ids.shape[1], dtype=torch.int64, device=ids.device).unsqueeze(0)
        slice_ = reported(ulysses.ulysses_pad_and_slice_inputs)
        tokens, position_ids, pad = slice_(ids, pos, sp_size=size)
        mine = slice_(rolled, None, sp_size=size)[0]
        held = slice_(where, None, sp_size=size)[0].reshape(-1)
        if pad:
            raise ValueError(f"verl padded {pad} tokens onto a row ringcheck had padded to a multiple of P={size}")
        self.pad = pad
        counted = shift_labels(batch["labels"])[:, held] != IGNORE   # the targets the truth counts
        return {"input_ids": tokens, "position_ids": position_ids, "positions": held,
                "labels": torch.where(counted, mine, torch.full_like(mine, IGNORE))}

    def gather(self, values: torch.Tensor, group) -> torch.Tensor:
        """`_gather_and_unpad_packed` (transformer_impl.py L680-689): verl's `gather_outputs_and_unpad`
        of the rank's per-token values (1, held) into the whole packed row's (1, n)."""
        ulysses, _ = verl_modules()
        gathered = reported(ulysses.gather_outputs_and_unpad)(values.squeeze(0), gather_dim=0, unpad_dim=0,
                                                              padding_size=self.pad)
        return gathered.unsqueeze(0)


def heads_of(config) -> tuple[int, int] | str:
    """What `apply_monkey_patch` reads of the heads (L334-341), or the line where it cannot."""
    try:
        return config.num_attention_heads, config.num_key_value_heads
    except AttributeError:
        text = getattr(config, "text_config", None) or config.get_text_config()
        try:
            return text.num_attention_heads, text.num_key_value_heads
        except AttributeError as exc:
            return (f"verl's apply_monkey_patch reads num_attention_heads and num_key_value_heads of the config "
                    f"(monkey_patch.py L334-341), and {type(text).__name__} raises AttributeError: {exc}")


def refuses_ring(tiny, world_size: int) -> list[str]:
    """What verl refuses at P (its assertions, monkey_patch.py L343-350, with its own words and the
    numbers), and a model class transformers does not build on the flash path; one line each."""
    heads = heads_of(tiny.config)
    out = [heads] if isinstance(heads, str) else []
    if not out:
        h, kv = heads
        if h % world_size:
            out.append(f"verl's apply_monkey_patch asserts num_attention_heads {h} must be divisible by "
                       f"ulysses_sp_size {world_size} (monkey_patch.py L343-345); run a --world-size that divides {h}")
        if kv % world_size and world_size % kv:
            out.append(f"verl's apply_monkey_patch asserts num_key_value_heads {kv} must be divisible by "
                       f"ulysses_sp_size {world_size} or vice versa (monkey_patch.py L346-350)")
    wide = [layer.index for layer in tiny.layers if layer.v_head_dim != layer.head_dim]
    if wide:
        out.append(f"layers {', '.join(map(str, wide))} have a value head dim other than the query's (MLA): "
                   f"transformers pads the values for the flash path only under the name flash_attention_2, which "
                   f"ringcheck's flash-attn stand-in runs under another: not judged here")
    cls = causal_lm_class(tiny.config)
    own = compatible_flash_implementations(cls)
    if not supports_attention(cls, "flash_attention_2"):
        out.append(f"transformers builds no {cls.__name__} with attn_implementation='flash_attention_2' "
                   f"(_supports_flash_attn = False), and verl's Ulysses patches the flash path only")
    elif own and "flash_attention_2" not in own:
        out.append(f"transformers builds {cls.__name__} with the hub kernel {own[0]!r} when flash_attention_2 is asked "
                   f"for (its compatible flash kernels), which ringcheck does not run (its flash-attn stand-in is "
                   f"flash-attn 2's API): not judged here")
    return out


def verl_glue() -> Glue:
    """The built-in glue `verl` (ImportError with the fix where verl is missing)."""
    verl_root()
    a = Verl()
    return Glue(name="verl", install=a.install, layout="contiguous", configure=a.configure, shard=a.shard,
                gather=a.gather, uninstall=a.uninstall, refuses_ring=refuses_ring, dtype="bfloat16", shims=SHIMS,
                sharding=f"verl {VERSION}'s prepare_model_inputs (the packed row, targets rolled on the whole row, "
                         f"then ulysses_pad_and_slice_inputs), its outputs gathered by gather_outputs_and_unpad "
                         f"before the loss",
                describe=f"verl {VERSION}'s Ulysses (apply_monkey_patch's _ulysses_flash_attention_forward over "
                         f"transformers' flash path on ringcheck's flash-attn stand-in, bfloat16)")
