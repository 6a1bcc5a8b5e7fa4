"""`--glue openrlhf`: OpenRLHF 0.11.2's ring attention (`--ds.ring_attn_size P`, which it allows only
with `--ds.packing_samples`), run as it ships: ring-flash-attn 0.1.8's Hugging Face adapter set up
by OpenRLHF and fed by OpenRLHF's own sharding.

- **Its setup**: `DeepspeedStrategy.setup_ring_attn` (`openrlhf/utils/deepspeed/deepspeed.py`):
  `set_ring_attn_group`, OpenRLHF's `patch_transformers_for_ring_flash_attn`, then ring-flash-attn's
  `substitute_hf_flash_attn(group, ring_attn_head_stride)` with OpenRLHF's default stride (1).
- **Its sharding** (`shard`): `unpad_and_slice_tensor` (`openrlhf/models/ring_attn_utils.py`), as
  `Actor.forward` calls it: the rows of the micro-batch unpadded into one packed sequence (one row
  per document: OpenRLHF packs samples, each its own row of the attention mask), the targets rolled
  on each whole row before slicing, padded to a multiple of P, each rank its contiguous slice, and
  its `update_ring_attn_params` with the packed boundaries.
- **Not judged by the step**: the loss. ringcheck's step computes its own cross-entropy from the
  rank's logits and the targets OpenRLHF rolled; OpenRLHF's `log_probs_from_logits` and
  `gather_and_pad_tensor` (its all-gather of the log-probs back to (rows, seqlen)) are checked by
  suites/test_trainer_openrlhf.py (gathered = the sliced values in place), not by the verdict.

Shims (`SHIMS`, the report prints them): OpenRLHF's package `__init__`s (peft, deepspeed) are not
run, its two files are loaded alone; `setup_ring_attn` is given ringcheck's CP group for its CUDA
mesh's "sp" group; `flash_attn.bert_padding` and `flash_attn.utils.distributed` come from ringcheck's
flash-attn stand-in; and with transformers 5.23, `substitute_hf_flash_attn` raises ValueError (no
variant with 5.23's parameter count), so the adapter's newest variant is installed as
`--glue ring_flash_attn` installs it.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..glues.contract import Glue
from ..glues.ring_flash_attn import IMPLEMENTATION, RingFlashAttnGlue, hf_adapter
from ..glues.ring_flash_attn import SHIMS as RFA_SHIMS
from ..step.contract import IGNORE, shift_labels
from ..thirdparty.transformers_private import keep_attention_state

VERSION = "0.11.2"     # the OpenRLHF this adapter was written and measured against
HEAD_STRIDE = 1        # OpenRLHF's --ds.ring_attn_head_stride default
SHIMS = ("OpenRLHF's package __init__s (peft, deepspeed) not run: openrlhf/models/ring_attn_utils.py loaded alone, "
         "and DeepspeedStrategy.setup_ring_attn's own text from openrlhf/utils/deepspeed/deepspeed.py",
         "setup_ring_attn is given ringcheck's CP group as its CUDA device mesh's 'sp' group",
         "flash_attn.bert_padding (transformers' unpad/pad, einops' rearrange) and flash_attn.utils.distributed "
         "(all_gather) from ringcheck's flash-attn stand-in",
         RFA_SHIMS[1])


def _root() -> Path:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"--glue openrlhf runs OpenRLHF's own ring-attention code, and openrlhf is not installed; "
                          f"pip install --no-deps openrlhf=={VERSION} ring-flash-attn==0.1.8 (the versions this "
                          f"adapter was measured on)")
    return Path(list(spec.submodule_search_locations)[0])


def ring_attn_utils():
    """OpenRLHF's `openrlhf.models.ring_attn_utils`, loaded alone from its file (shim 1), with the
    flash-attn stand-in installed first (shim 3)."""
    from ..flash_stand_in import install  # before the module imports flash_attn.bert_padding
    install()
    root = _root()
    for name, where in (("openrlhf", root), ("openrlhf.models", root / "models")):
        if name not in sys.modules:  # the packages without their __init__ (peft, deepspeed)
            package = types.ModuleType(name, "OpenRLHF's package, its __init__ not run (ringcheck)")
            package.__path__ = [str(where)]
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            package.__spec__.submodule_search_locations = [str(where)]
            sys.modules[name] = package
    return importlib.import_module("openrlhf.models.ring_attn_utils")


def setup_ring_attn_source() -> str:
    """The text of `DeepspeedStrategy.setup_ring_attn`, as OpenRLHF ships it (shim 1)."""
    path = _root() / "utils" / "deepspeed" / "deepspeed.py"
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == "setup_ring_attn":
            return ast.get_source_segment(text, node)
    raise ImportError(f"--glue openrlhf: {path} has no setup_ring_attn; pip install --no-deps openrlhf=={VERSION}")


class OpenRLHF:
    """The adapter: OpenRLHF's setup on the CP group, then its sharding per micro-batch."""

    def __init__(self):
        self.utils = None
        self.undo = None  # transformers' attention state before setup_ring_attn patched it (uninstall)

    def install(self, group) -> str:
        utils = ring_attn_utils()
        self.utils = utils
        if self.undo is None:  # substitute_hf_flash_attn patches _flash_attention_forward and flash_attention_2
            self.undo = keep_attention_state()
        scope = {"dist": dist, "set_ring_attn_group": utils.set_ring_attn_group}
        exec(compile(setup_ring_attn_source(), "openrlhf/utils/deepspeed/deepspeed.py", "exec"), scope)

        class Strategy(SimpleNamespace):  # what setup_ring_attn reads of DeepspeedStrategy
            ring_attn_group = property(lambda self: utils.get_ring_attn_group())

        strategy = Strategy(ring_attn_size=dist.get_world_size(group),
                            args=SimpleNamespace(ds=SimpleNamespace(ring_attn_head_stride=HEAD_STRIDE)))
        mesh = {"sp": SimpleNamespace(get_group=lambda: group)}  # shim 2: the CP group for its CUDA mesh
        try:
            scope["setup_ring_attn"](strategy, mesh)
        except ValueError:  # shim 4: substitute_hf_flash_attn has no variant for this transformers
            return RingFlashAttnGlue().install(utils.get_ring_attn_group())
        from transformers import AttentionInterface  # transformers: the optional extra `hf`

        # the adapter's flash_attention_forward, under the name transformers builds a model with on a CPU
        AttentionInterface.register(IMPLEMENTATION, hf_adapter().flash_attention_forward)
        return IMPLEMENTATION

    def uninstall(self) -> None:
        """transformers as it was before `install` (the adapter's patches are for the process)."""
        if self.undo is not None:
            self.undo()
            self.undo = None

    def shard(self, batch: dict, group) -> dict:
        """`unpad_and_slice_tensor` on the micro-batch as OpenRLHF's data holds it (one row per sample)."""
        ids = batch["input_ids"]
        if ids.shape[0] != 1:
            raise ValueError(f"OpenRLHF's unpad_and_slice_tensor packs a micro-batch's {ids.shape[0]} rows into one "
                             f"sequence; ringcheck's step holds rows apart, so this case is not judged")
        n, device = ids.shape[1], ids.device
        cu = batch["cu_seqlens"] or [0, n]
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        rows = torch.zeros((len(lengths), max(lengths)), dtype=torch.int64, device=device)
        mask, where = torch.zeros_like(rows), torch.zeros_like(rows)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            rows[i, :b - a], mask[i, :b - a] = ids[0, a:b], 1
            where[i, :b - a] = torch.arange(a, b, dtype=torch.int64, device=device)
        tokens, position_ids, rolled, pad, _ = self.utils.unpad_and_slice_tensor(rows, mask, group)
        held = self.utils.unpad_and_slice_tensor(where, mask, group)[0].reshape(-1)
        if pad:
            raise ValueError(f"OpenRLHF padded {pad} tokens onto a sequence ringcheck had padded to a multiple of P")
        counted = shift_labels(batch["labels"])[:, held] != IGNORE   # the targets the truth counts
        return {"input_ids": tokens, "position_ids": position_ids, "positions": held,
                "labels": torch.where(counted, rolled, torch.full_like(rolled, IGNORE))}


def refuses_ring(tiny, world_size: int) -> list[str]:
    """What OpenRLHF's ring cannot run, one line per cause naming its layers: a softcap (the adapter
    `setup_ring_attn` installs asserts `softcap is None`). OpenRLHF's own condition on its head
    stride (a divisor of the heads) holds for its default, 1."""
    found: dict[float, list[int]] = {}
    for layer in tiny.layers:
        if layer.softcap:
            found.setdefault(layer.softcap, []).append(layer.index)
    return [f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: softcap {cap} (ring-flash-attn's adapter, "
            f"which OpenRLHF's setup_ring_attn installs, asserts softcap is None: llama3_flash_attn_varlen_func does "
            f"not support softcap yet); no --world-size runs it" for cap, ix in found.items()]


def openrlhf_glue() -> Glue:
    """The built-in glue `openrlhf` (ImportError with the fix where openrlhf is missing)."""
    _root()
    a = OpenRLHF()
    return Glue(name="openrlhf", install=a.install, layout="contiguous", shard=a.shard, refuses_ring=refuses_ring,
                uninstall=a.uninstall,
                dtype="bfloat16", shims=SHIMS,
                sharding=f"OpenRLHF {VERSION}'s unpad_and_slice_tensor (one row per document, unpadded into one "
                         f"packed sequence, targets rolled on each whole row, contiguous slices) and its "
                         f"update_ring_attn_params",
                describe=f"OpenRLHF {VERSION}'s ring attention: setup_ring_attn's substitute_hf_flash_attn "
                         f"(ring-flash-attn's Hugging Face adapter, head stride {HEAD_STRIDE}) on ringcheck's "
                         f"flash-attn stand-in, bfloat16")
