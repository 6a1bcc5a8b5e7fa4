"""Where a model looks a table up at a negative position id: a trainer that pads the position ids
with -1 (ms-swift's `pad_and_split_inputs`) crashes there on the rank that holds the padding, and
its other ranks wait in the next collective.

`negative_lookup` runs the model's forward on one process up to its first attention call (the
first collective of a sequence-parallel attention), the position ids handed as the padding made
them, and names the first op that would read a table at a negative index: `F.embedding` (learned
absolute positions), `gather` or `index_select` (bert's `token_type_ids` buffer gathered by
position id). The op is stopped before it runs (on a GPU it would be a device-side assert), so the
probe says the same on every rank, from the model and the batch alone. A model that turns the
position ids into rotary angles (llama) or offsets them first (biogpt) reaches its attention:
None.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# the ops that read a table at an index and raise on a negative one -> (the index's place, its keyword)
INDEXED = {F.embedding: (0, "input"), torch.gather: (2, "index"), torch.Tensor.gather: (2, "index"),
           torch.index_select: (2, "index"), torch.Tensor.index_select: (2, "index")}
TORCH = os.path.dirname(torch.__file__)


class _Stop(Exception):
    """Where the probe's forward ends: a negative lookup (`where`: the op and its line) or the
    model's first attention call (`where` None)."""

    def __init__(self, where: str | None = None):
        super().__init__(where)
        self.where = where


def _caller() -> str:
    """The innermost frame outside torch, as `package/path.py:line`."""
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(TORCH + os.sep)
              and f.filename != __file__]
    f = frames[-1]
    parts = f.filename.split(os.sep)
    short = os.sep.join(parts[parts.index("transformers"):]) if "transformers" in parts else os.path.basename(f.filename)
    return f"{short}:{f.lineno}"


class _Lookups(TorchFunctionMode):
    """Raises `_Stop` naming the op and its caller where an op of `INDEXED` is handed a negative
    index, before the op runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        place = INDEXED.get(func)
        if place is not None:
            index = kwargs.get(place[1], args[place[0]] if len(args) > place[0] else None)
            if isinstance(index, torch.Tensor) and index.numel() and bool((index < 0).any()):
                raise _Stop(f"{func.__name__} at {_caller()}")
        return func(*args, **kwargs)


def negative_lookup(model: torch.nn.Module, attn: str, input_ids: torch.Tensor, position_ids: torch.Tensor
                    ) -> str | None:
    """The first op of `model`'s forward, before its first call of the attention registered as
    `attn`, that would read a table at a negative index of `position_ids` ('gather at
    transformers/models/bert/modeling_bert.py:93'); None where the forward reaches its attention
    first, or raises anything else (the probe then cannot tell: the run meets it). Run under
    no_grad in eval mode (no dropout, no sampling router), the model's modes put back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time: a --model run only

    def reached(*args, **kwargs):
        raise _Stop()

    saved, modes = ALL_ATTENTION_FUNCTIONS[attn], {m: m.training for m in model.modules()}
    ALL_ATTENTION_FUNCTIONS[attn] = reached
    model.eval()
    try:
        with torch.no_grad(), _Lookups():
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    except _Stop as stop:
        return stop.where
    except Exception:  # not the probe's to judge: the run itself meets it
        return None
    finally:
        ALL_ATTENTION_FUNCTIONS[attn] = saved
        for m, mode in modes.items():
            m.training = mode
    return None
