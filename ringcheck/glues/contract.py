"""The glue contract: what `ringcheck step --model` needs from the code between a transformers
model's attention layers and a ring, and the loader of `--glue`.

A glue is the piece that context-parallel training failures hide in (a window, the sinks, the
scale or the document boundaries lost on the way to the ring), so ringcheck judges it alone:
`install(group)` runs on every rank once the CP group exists and returns the
`attn_implementation` name the model is built with; `prepare(cu_seqlens, group)` hands it the
global document boundaries before every forward; `layout` says how the step must shard the
sequence for its ring. docs/reference/glue-contract.md is the user's page of this contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..spec import LAYOUTS
from ..user_code import import_object

DTYPES = ("float64", "float32", "bfloat16", "float16")


class GlueRefused(ValueError):
    """The glue cannot carry a feature of one of the model's layers: raised before any rank starts
    (the command's exit 2), naming the layers and the features, instead of judging a model whose
    attention the glue would change."""


@dataclass(frozen=True)
class Glue:
    """One glue under test. `refuses(layer)` (a `LayerAttention` of `ringcheck.models.tiny`) lists
    the features of that layer the glue cannot carry (empty: it carries them all); None means the
    glue did not say, and nothing is refused before the run (the run judges it). `dtype` is the
    dtype the model is built in for this glue: "float64" (judged with the float64 budget), or a
    narrower one for a glue whose kernels take nothing wider (flash: "bfloat16", judged with a
    measured noise budget). `refuses_calls(tiny)` (optional) returns finished lines ("layer i: ...")
    about what the model's attention calls hand the glue, found by one forward on one device
    (`ringcheck.glues.survey`)."""

    name: str
    install: Callable[[Any], str]
    layout: str = "contiguous"
    prepare: Callable | None = None
    describe: str = ""
    refuses: Callable[[Any], list[str]] | None = None
    dtype: str = "float64"
    refuses_calls: Callable[[Any], list[str]] | None = None
    # what a trainer's glue needs (issue 49): the model's config once installed (`configure(config,
    # group)`: the head counts an all-to-all splits), its own sharding of the batch (`shard(batch,
    # group)`, see `GLUE_SHARD_KEYS`), an `uninstall()` that puts transformers back, and what it cannot
    # run at a ring size (`refuses_ring(tiny, world_size)`: heads that do not divide by P), with
    # `sharding` saying whose sharding ran and `shims` what ringcheck changed so it runs on a CPU
    configure: Callable[[Any, Any], None] | None = None
    shard: Callable[[dict, Any], dict] | None = None
    uninstall: Callable[[], None] | None = None
    refuses_ring: Callable[[Any, int], list[str]] | None = None
    sharding: str = "ringcheck's (the glue's layout)"
    shims: tuple[str, ...] = ()
    # a trainer whose loss function shards the batch and runs the model itself (LLaMA-Factory's
    # sequence_parallel_loss): `forward_loss(model, batch, group)`, see `GLUE_LOSS_KEYS`; None: ringcheck's step
    forward_loss: Callable[[Any, dict, Any], dict] | None = None
    # a trainer whose loss is computed on outputs gathered over the CP group (issue 62, verl): `gather(values,
    # group)` takes the rank's per-token values (rows, held) and returns the whole row's, through the trainer's
    # own all-gather (its backward handing each rank its slice); the step then computes the loss of the whole row
    # on every rank and averages the gradients and the logged loss over the CP group (as a data-parallel average
    # over the SP ranks does). None: each rank's loss over its own tokens, summed over the group
    gather: Callable[[Any, Any], Any] | None = None
    # a trainer that picks its strategy from the model (ringmaster: Ulysses, ring or both by the K/V
    # heads): `describe_for(tiny, world_size)` is the report's words for this model at P (None: `describe`)
    describe_for: Callable[[Any, int], str] | None = None


def group_device(group) -> str:
    """The device type the ranks of `group` compute on, for what a glue makes outside the forward (the
    boundaries it hands a kernel, a DeviceMesh): "cpu" for a gloo group, else "cuda", the current device
    (the launcher set it). ringcheck's groups on a GPU are "cpu:gloo,cuda:nccl" (`launch.common.ring_backend`),
    never "nccl" alone."""
    import torch.distributed as dist  # the glue's group exists: torch.distributed is initialised

    return "cpu" if dist.get_backend(group) == "gloo" else "cuda"


# `shard(batch, group)` is given this rank's rows of the global micro-batch, padded to the layout's
# multiple, as a data loader holds it (input_ids, labels not yet shifted, position_ids, cu_seqlens or
# None) and returns this rank's input_ids, position_ids and labels (the targets of its tokens, shifted
# on the whole sequence), and positions: the global index of every token it holds, in its order
GLUE_SHARD_KEYS = ("input_ids", "position_ids", "labels", "positions")
# `forward_loss(model, batch, group)` is given this rank's rows of the global micro-batch, not padded (input_ids,
# labels not yet shifted, position_ids, cu_seqlens or None, and total: the global count of counted targets
# over every micro-batch and replica) and returns the rank's share of the step's loss (its sum over the
# ranks is the loss; backward runs on it), this rank's logits and positions: the global index of each
GLUE_LOSS_KEYS = ("loss", "logits", "positions")


def refusals(glue: Glue, tiny: Any) -> list[str]:
    """One line per layer whose features `glue` cannot carry ("layer 3: sinks (s_aux) not carried
    by glue 'ring_flash_attn' (...)"); empty when it carries every layer of `tiny` (a
    `TinyModel`), or when the glue does not say what it refuses."""
    lines = []
    for layer in tiny.layers if glue.refuses is not None else ():
        for feature in glue.refuses(layer):
            lines.append(f"layer {layer.index}: {feature} not carried by glue {glue.name!r}")
    if glue.refuses_calls is not None:
        lines.extend(f"{line} (refused by glue {glue.name!r})" for line in glue.refuses_calls(tiny))
    return lines


def check_refusals(glue: Glue, tiny: Any) -> None:
    """`GlueRefused` with every refusal of `refusals(glue, tiny)`, or nothing."""
    lines = refusals(glue, tiny)
    if lines:
        raise GlueRefused(f"glue {glue.name!r} cannot carry the attention of {tiny.name}; not run, so that no "
                          f"verdict is given on attention it would change:\n  " + "\n  ".join(lines))


def _checked_install(install: Callable[[Any], str], where: str) -> Callable[[Any], str]:
    """`install` whose result is checked: the attn_implementation name, a non-empty str."""

    def run(group) -> str:
        name = install(group)
        if not isinstance(name, str) or not name:
            raise TypeError(f"glue {where}: install(group) must return the attn_implementation name (a non-empty "
                            f"str) the model is built with, got {name!r}")
        return name

    return run


def user_glue(spec: str) -> Glue:
    """The user's glue `PKG.MOD:OBJ`: an object (or module) with `install(group) -> str`, optional
    `layout` (contiguous when absent) and `prepare(cu_seqlens, group)`, optional `refuses(layer)`
    and `describe`."""
    head, sep, tail = spec.partition(":")
    if not sep or not head or not tail:
        raise ValueError(f"--glue {spec!r}: a glue is 'ringcheck', 'ulysses', 'ring_flash_attn' or your own as "
                         f"'package.module:object' (an object with install(group) -> attn_implementation name)")
    obj = import_object(spec, f"--glue {spec!r}")
    if isinstance(obj, Glue):  # a glue already built (a trainer's, patched): as it is
        return obj
    install = getattr(obj, "install", None)
    if not callable(install):
        raise TypeError(f"--glue {spec!r}: {type(obj).__name__} {tail!r} has no callable install(group); a glue "
                        f"defines install(group) -> str, which registers its attention and returns the "
                        f"attn_implementation name (see docs/reference/glue-contract.md)")
    layout = getattr(obj, "layout", "contiguous")
    if layout not in LAYOUTS:
        raise ValueError(f"--glue {spec!r}: layout {layout!r} is not one ringcheck can shard; use one of "
                         f"{', '.join(LAYOUTS)} (contiguous when the attribute is absent)")
    prepare = getattr(obj, "prepare", None)
    if prepare is not None and not callable(prepare):
        raise TypeError(f"--glue {spec!r}: prepare must be callable as prepare(cu_seqlens, group), got "
                        f"{type(prepare).__name__}")
    refuses = getattr(obj, "refuses", None)
    if refuses is not None and not callable(refuses):
        raise TypeError(f"--glue {spec!r}: refuses must be callable as refuses(layer) -> list of features, got "
                        f"{type(refuses).__name__}")
    describe = getattr(obj, "describe", "") or f"the user's glue {spec}"
    if not isinstance(describe, str):
        raise TypeError(f"--glue {spec!r}: describe must be a str, got {type(describe).__name__}")
    refuses_calls = getattr(obj, "refuses_calls", None)
    if refuses_calls is not None and not callable(refuses_calls):
        raise TypeError(f"--glue {spec!r}: refuses_calls must be callable as refuses_calls(tiny) -> list of lines, "
                        f"got {type(refuses_calls).__name__}")
    dtype = getattr(obj, "dtype", "float64")
    if dtype not in DTYPES:
        raise ValueError(f"--glue {spec!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)} (the dtype the model "
                         f"is built in for your glue; float64 when the attribute is absent)")
    hooks = {}
    for hook, signature in (("configure", "configure(config, group)"), ("shard", "shard(batch, group) -> dict"),
                            ("uninstall", "uninstall()"), ("refuses_ring", "refuses_ring(tiny, world_size) -> lines"),
                            ("forward_loss", "forward_loss(model, batch, group) -> dict"),
                            ("gather", "gather(values, group) -> the whole row's values")):
        value = getattr(obj, hook, None)
        if value is not None and not callable(value):
            raise TypeError(f"--glue {spec!r}: {hook} must be callable as {signature}, got {type(value).__name__}")
        hooks[hook] = value
    return Glue(name=spec, install=_checked_install(install, repr(spec)), layout=layout, prepare=prepare,
                describe=describe, refuses=refuses, dtype=dtype, refuses_calls=refuses_calls, **hooks,
                sharding="the glue's own (shard)" if hooks["shard"] else "the glue's own (forward_loss)"
                if hooks["forward_loss"] else "ringcheck's (the glue's layout)")
