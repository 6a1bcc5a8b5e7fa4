"""The runs of `ringcheck step --model`: a tiny transformers model through a glue at CP=P, and its
own attention at CP=1 (the truth), every case in turn.

`model_step_task` is one rank of the run under test. The glue is installed once the rank's CP
group exists (`Glue.install(group)` -> the `attn_implementation` name), the model is built from
the seed with that name (`TinyModel.build`: the same weights on every rank and in the truth),
and ringcheck's own correct step runs around it, so that the glue is the only thing under test:

1. the targets counted once on the global batch (every micro-batch, every data-parallel replica);
2. per micro-batch: this replica's rows; labels shifted on the *whole* sequence, then padded to
   the layout's multiple and sharded in the glue's layout (`Glue.layout`), with the token ids
   and the global position ids; `Glue.prepare(cu_seqlens, group)` with the global document
   boundaries before the forward;
3. the model's forward on the shard (`use_cache=False`), ringcheck's cross-entropy summed over
   the rank's targets and divided by the global count (in float64 from the logits, as the truth's:
   the model's own loss would cast to float32, and a glue run in bfloat16 would round the very loss
   it is judged on), backward per micro-batch;
4. every gradient and the logged loss summed over the CP group and the data-parallel replicas (a
   glue that gathers the per-token losses before the loss, `Glue.gather`, has the whole row's loss
   on every rank: averaged over the CP group, as the trainer's data-parallel average does).

The rank's logits come back with the global positions it held, and `assemble_logits` puts the
ranks' pieces back into whole sequences. `reference_task` is the truth for a share of the cases
on one rank (`ringcheck.models.shares` deals the cases among the ranks):
`ringcheck.models.native.native_step` (transformers' eager attention on whole sequences, packed
documents kept apart). `diagnosis_task` runs `ringcheck.models.semantics.diagnose` for a failed
case. `model_step_task` puts transformers' attention state back as it found it
(`keep_attention_state`), whatever the glue's `uninstall` leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..harness import Mesh
from ..harness.mesh import REPLICAS
from ..harness.settings import default_dtype
from ..launch.audit import on_the_host
from ..launch.in_flight import InFlight
from ..ring.layouts import positions
from ..spec import REFERENCE_DTYPES, RingSpec
from ..step.cases import CASES, micro_batches
from ..step.contract import IGNORE, shift_labels
from ..step.run import check_ring_settings, on_device, step_mesh
from ..thirdparty.transformers_private import enable_activation_checkpointing, keep_attention_state
from .glue_hooks import glue_loss, glue_sharded, pad_positions, pad_rows, step_loss
from .regimes import REGIME_CASES, model_case
from .step_noise import float32_steps, narrow_noise, own_rounding, split_gradients, truth_noise

DEFAULT_GLUE = "ringcheck"
MODEL_DTYPES = ("float64", "float32")
# the cases a model's step runs by default: step's, but those whose point is the user's recipe (its
# reentrant checkpointing, its evaluate hook) run only when asked for with --cases
# and the regime cases (`ringcheck.models.regimes`): the shard on both sides of the model's window, at any P
MODEL_CASES = ("one_sequence", "packed", "uneven", "batch2", "two_micro_batches", "not_divisible",
               "checkpoint_non_reentrant", *REGIME_CASES)
OPTIONAL_CASES = ("evaluation", "checkpoint_reentrant")


@dataclass(frozen=True)
class ModelStepConfig:
    """`ringcheck step --model`'s settings, checked at construction (the value received and the fix).
    `layout` None: the glue's own (`Glue.layout`)."""

    model: str
    glue: str = DEFAULT_GLUE
    world_size: int = 4
    mesh: str | None = None
    layout: str | None = None
    dtype: str = "float64"
    seed: int = 0
    cases: tuple[str, ...] = field(default_factory=lambda: MODEL_CASES)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"--model must be a transformers model_type (e.g. llama) or a config.json path, got "
                             f"{self.model!r}")
        check_ring_settings(self)
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: a model's step is judged in {' or '.join(MODEL_DTYPES)}; "
                             f"pass --dtype float64")
        if self.layout is not None:
            RingSpec(self.world_size, self.layout)
        supported = (*MODEL_CASES, *OPTIONAL_CASES)
        bad = [c for c in self.cases if c not in CASES and c not in REGIME_CASES]
        if bad or not self.cases:
            raise ValueError(f"--cases: unknown case(s) {bad}; choose from {', '.join(supported)}")

    @property
    def mesh_spec(self) -> Mesh:
        return step_mesh(self.world_size, self.mesh)

    @property
    def torch_dtype(self) -> torch.dtype:
        return REFERENCE_DTYPES[self.dtype]

    def flags(self) -> list[str]:
        out = ["--model", self.model, "--glue", self.glue, "--world-size", str(self.world_size)]
        out += ["--mesh", self.mesh] if self.mesh is not None else []
        out += ["--layout", self.layout] if self.layout is not None else []
        return out + ["--dtype", self.dtype, "--seed", str(self.seed), "--cases", ",".join(self.cases)]


def glue_of(config: ModelStepConfig):
    """The glue of `config` (`ringcheck.glues.load_glue`, with the trainers' glues of
    `ringcheck.trainers.TRAINER_GLUES`: glues/ imports no trainer), in `config.layout` where one
    is asked for (ringcheck's glue takes its ring's layouts; another glue only its own: ValueError)."""
    # start-up time: the model, the glue and the truth import transformers, only for a --model run
    from ..glues import load_glue
    from ..trainers import TRAINER_GLUES

    return load_glue(config.glue, layout=config.layout, named=TRAINER_GLUES)


def tiny_of(config: ModelStepConfig):
    # start-up time: the model, the glue and the truth import transformers, only for a --model run
    from .tiny import tiny_model

    return tiny_model(config.model)


def case_batches(config: ModelStepConfig, tiny, case, dp: int) -> list[dict]:
    """The case's global micro-batches (every replica's rows), drawn from the tiny model's vocab
    (`case`: `regimes.model_case`, a regime case's length and documents made for this ring)."""
    return micro_batches(case, vocab=tiny.vocab_size, seed=config.seed, dp=dp)


def count_targets(batches: list[dict]) -> torch.Tensor:
    """The global number of counted targets: every micro-batch, every replica's rows."""
    return sum(((shift_labels(mb["labels"]) != IGNORE).sum() for mb in batches), torch.zeros((), dtype=torch.int64))


def boundaries(mb: dict, padded: int) -> list[int]:
    """The global document boundaries `prepare` is given ([0, ..., padded], one row's, the same for
    every row): the packed case's documents, else one document; the layout's padding closes the last."""
    cu = mb.get("cu_seqlens")
    cu = [0, mb["input_ids"].shape[1]] if cu is None else [int(x) for x in cu]
    if cu[-1] != padded:
        cu[-1] = padded
    return cu


@dataclass(frozen=True)
class Place:
    """A rank's place: its CP rank and group size, the glue's layout, its replica of `dp`."""

    rank: int
    size: int
    layout: str
    dp_rank: int = 0
    dp: int = 1

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] // self.dp
        return x[self.dp_rank * n:(self.dp_rank + 1) * n]

    def multiple(self) -> int:
        return RingSpec(self.size, self.layout).chunks


def correct_step(model, batches: list[dict], place: Place, group, dp_group, prepare, *, train: bool,
                 checkpoint: str | None, shard=None, loss_of=None, gather=None) -> dict[str, Any]:
    """ringcheck's own correct transformers step on one rank (see the module's docstring): the
    loss (summed over the ranks), every gradient (summed), and per micro-batch this rank's
    logits with the global positions it held. `shard`: a glue's own sharding of the batch (a
    trainer's: `glue_sharded`), in place of ringcheck's in the glue's layout; `loss_of`: a trainer's
    own loss, which shards and runs the model itself (`glue_loss`), in place of both. `gather`: a
    glue's gather of the per-token losses (`step_loss`); every rank then holds the whole row's loss,
    and the gradients and the loss are averaged over the CP group instead of summed."""
    if checkpoint is not None:
        model.train()
        enable_activation_checkpointing(model, use_reentrant=checkpoint == "reentrant")
    total = count_targets(batches)
    logged = torch.zeros((), dtype=torch.float64)
    pieces = []
    for mb in batches:
        ids, labels, pos = (place.rows(mb[k]) for k in ("input_ids", "labels", "position_ids"))
        n = ids.shape[1]
        padded = -(-n // place.multiple()) * place.multiple()
        cu = mb.get("cu_seqlens")
        cu = None if cu is None else boundaries(mb, padded)
        if loss_of is not None:
            held = None
        elif shard is not None:
            ids, pos, targets, held = glue_sharded(shard, ids, labels, pos, cu, padded, group)
        else:
            held = positions(layout=place.layout, rank=place.rank, world_size=place.size, seq_len=padded,
                             cu_seqlens=cu).to(ids.device)
            targets = pad_rows(shift_labels(labels), padded, IGNORE).index_select(1, held).contiguous()
            ids = pad_rows(ids, padded, 0).index_select(1, held).contiguous()
            pos = pad_positions(pos, padded).index_select(1, held).contiguous()
        if prepare is not None and loss_of is None:  # a trainer's own loss hands its boundaries on itself
            prepare(boundaries(mb, padded), group)
        with torch.set_grad_enabled(train):
            if loss_of is not None:
                loss, logits, held = glue_loss(loss_of, model, ids, labels, pos, mb, total, group)
            else:
                logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                loss = step_loss(logits, targets, total, gather, group)
        if train:
            loss.backward()
        logged = logged + loss.detach().double()
        keep = held < n
        pieces.append({"logits": logits.detach()[:, keep].double().cpu(), "positions": held[keep].cpu(), "length": n})
    # with a glue's gather every rank of the group computed the whole row's loss: averaged over the group
    mean = dist.get_world_size(group) if gather is not None and group is not None else 1
    params = [p for p in model.parameters() if p.grad is not None]
    if params:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        for g in (group, dp_group):
            if g is not None:
                dist.all_reduce(flat, group=g)
        if mean > 1:
            flat /= mean
        at = 0
        for p in params:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
    for g in (group, dp_group):
        if g is not None:
            dist.all_reduce(logged, group=g)
    if mean > 1:
        logged = logged / mean
    grads = {n: None if p.grad is None else p.grad.detach().double().cpu().clone() for n, p in model.named_parameters()}
    return {"loss": float(logged), "grads": grads if train else {}, "logits": pieces}


def model_step_task(member, config: ModelStepConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """One rank of the run under test (a `ringcheck.launch` task): the glue installed on the
    rank's CP group, then every case of `names`, a model built from the seed for each."""
    tiny, glue = tiny_of(config), glue_of(config)
    # transformers as it was after the task, whatever the glue's uninstall (or its lack) leaves: the process
    # runs the truth, the diagnoses and other glues next
    restore = keep_attention_state()
    try:
        attn = glue.install(member.group)
        if not isinstance(attn, str) or not attn:
            raise TypeError(f"--glue {config.glue}: install(group) returned {attn!r}; it must return the "
                            f"attn_implementation name the model is to use")
        try:
            if glue.configure is not None:  # a trainer's glue sizes its all-to-all from the model's heads
                glue.configure(tiny.config, member.group)
            return _cases_task(member, config, names, tiny, glue, attn)
        finally:
            if glue.uninstall is not None:
                glue.uninstall()
    finally:
        restore()


def _cases_task(member, config: ModelStepConfig, names: tuple[str, ...], tiny, glue, attn: str) -> dict[str, Any]:
    """Every case of `names` on one rank, through the installed glue."""
    from .tiny import reused_builds  # start-up time: only a --model run imports the tiny models

    dp_group = member.groups[REPLICAS]
    dp = dist.get_world_size(dp_group)
    place = Place(member.rank, member.world_size, glue.layout, member.group_index, dp)
    cases, errors = {}, {}
    dtype = REFERENCE_DTYPES[run_dtype(config, glue)]
    unsettled = None  # a case raised with the glue's messages in flight, which never completed
    with default_dtype(config.torch_dtype), InFlight() as flight, reused_builds():
        for name in names:
            if unsettled is not None:
                errors[name] = f"{NOT_RUN_AFTER}{unsettled}; run it alone: --cases {name}"
                continue
            case = model_case(name, tiny, config.world_size, glue.layout)
            try:  # a case the glue cannot run is not run (its reason), the others keep their verdicts
                # on the rank's device (a GPU's under torchrun): the glue and its ring run there
                model = tiny.build(attn, dtype=dtype, seed=config.seed).to(member.device)
                batches = on_device(case_batches(config, tiny, case, dp), member.device)
                cases[name] = correct_step(model, batches, place, member.group, dp_group if dp > 1 else None,
                                           glue.prepare, train=not case.evaluate, checkpoint=case.checkpoint,
                                           shard=glue.shard, loss_of=glue.forward_loss, gather=glue.gather)
            except Exception as exc:
                errors[name] = error_words(exc)
                left = flight.settle(member.timeout)  # what the raise left posted completes, or the ring stops
                if left is not None:
                    unsettled = f"{name} raised inside the glue, and {left}: its groups are out of step"
                elif spoils_groups(errors[name]):
                    unsettled = f"{name} raised inside the glue in a gloo operation that closed its connection"
            flight.clear()
    return {"cp_rank": member.rank, "dp_rank": member.group_index, "attn_implementation": attn, "cases": cases,
            "errors": errors, "spoiled": unsettled is not None}  # its groups unusable after this run


NOT_RUN_AFTER = "not run on this ring after "  # a case's error that is no run of its own (_cases_task)
# gloo closes a pair whose operation timed out or whose peer went away, for good: a later run on it fails at once
GLOO_SPOILED = ("Timed out waiting", "Application timeout caused pair closure", "Connection closed by peer",
                "Connection reset by peer")


def spoils_groups(why: str) -> bool:
    """Whether a case's error (a rank's, in the glue) leaves the ring's groups unusable afterwards:
    gloo closed a pair, or messages left in flight never completed (`NOT_RUN_AFTER`)."""
    return why.startswith(NOT_RUN_AFTER) or any(words in why for words in GLOO_SPOILED)


def run_dtype(config: ModelStepConfig, glue) -> str:
    """The dtype the model runs in through `glue`: the step's, or the narrower one a glue whose
    kernels take nothing wider declares (`Glue.dtype`: ring-flash-attn's "bfloat16")."""
    narrow = getattr(glue, "dtype", None) or config.dtype
    if narrow not in REFERENCE_DTYPES:
        raise ValueError(f"--glue {config.glue} declares dtype {narrow!r}; a glue's dtype is one of "
                         f"{', '.join(REFERENCE_DTYPES)}")
    wider = torch.finfo(REFERENCE_DTYPES[narrow]).eps <= torch.finfo(config.torch_dtype).eps
    return config.dtype if wider else narrow


def error_words(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _as_list(logits, count: int) -> list[torch.Tensor]:
    """native_step's logits as one (rows, seq, vocab) tensor per micro-batch."""
    if isinstance(logits, torch.Tensor):
        return [logits] if count == 1 and logits.dim() == 3 else list(logits)
    return list(logits)


def reference_task(member, config: ModelStepConfig, names: tuple[str, ...], dp: int, layout: str,
                   narrow: str | None = None, only_narrow: bool = False, known: dict | None = None) -> dict[str, Any]:
    """The truth on one rank: `native_step` on every case's whole batch (every replica's rows),
    and per parameter the truth's own rounding noise (`ringcheck.models.step_noise`: the targets
    split as the ranks of `layout` hold them); for a glue run in a `narrow` dtype, the noise
    runs' changes against the truth (`narrow_noise`). `only_narrow`: those changes alone (the rest
    known from another glue's run: no rounding noise, no float32 steps counted). `known`: per case,
    what a run of the same batch on the same model found (the truth's "loss", "logits" and "grads",
    the model's own rounding "own", the noise runs "narrow"), taken instead of computed again: only
    the split sums depend on the ring (`ringcheck.commands.step_model` keeps them across a model's
    ring sizes)."""
    # start-up time: the model, the glue and the truth import transformers, only for a --model run
    from .native import NATIVE, native_logits, native_step
    from .tiny import reused_builds

    tiny = tiny_of(config)
    out, errors, casts, built, known = {}, {}, None, {}, known or {}
    with default_dtype(config.torch_dtype), on_the_host(), reused_builds():  # the truth: on the CPU by design
        for name in names:
            was = known.get(name, {})
            try:
                model = tiny.build(NATIVE, dtype=config.torch_dtype, seed=config.seed)
                case = model_case(name, tiny, config.world_size, layout)
                batches = case_batches(config, tiny, case, dp)
                if casts is None and config.dtype == "float64" and not only_narrow:
                    casts = float32_steps(model, batches[0], native_logits)
                evaluate = case.evaluate
                loss, grads, logits = ((was["loss"], was["grads"], was["logits"]) if "grads" in was
                                       else native_step(model, batches))
                noise = {} if evaluate or only_narrow else truth_noise(split_gradients(
                    model, batches, native_logits, layout=layout, world_size=config.world_size,
                    total=count_targets(batches)), grads)
                own = None
                if noise and casts:  # the model's own float32 steps: the truth's distance to a float64 run of it
                    own = was["own"] if "own" in was else own_rounding(tiny, config, batches, grads, built)
                    noise = {n: max(v, own.get(n, 0.0)) for n, v in noise.items()}
            except Exception as exc:
                errors[name] = error_words(exc)
                continue
            out[name] = {"loss": float(loss), "logits": [t.detach().double().cpu() for t in _as_list(logits, len(batches))],
                         "grads": {} if evaluate else
                         {n: None if g is None else g.detach().double().cpu() for n, g in grads.items()},
                         "noise": noise, **({} if own is None else {"own": own})}
            if narrow is not None:
                out[name]["narrow"] = (was["narrow"] if "narrow" in was else
                                       narrow_noise(tiny, config, batches, out[name], REFERENCE_DTYPES[narrow]))
    return {"cases": out, "errors": errors, "float32_steps": casts or 0}


def assemble_logits(groups: list[list[dict]], name: str) -> list[torch.Tensor]:
    """Whole sequences from the ranks' pieces: per micro-batch (every replica's rows, seq, vocab)."""
    first = groups[0][0]["cases"][name]["logits"]
    out = []
    for m, piece in enumerate(first):
        rows = piece["logits"].shape[0]
        whole = torch.full((rows * len(groups), piece["length"], piece["logits"].shape[-1]), math.nan,
                           dtype=torch.float64)
        for group in groups:
            for r in group:
                p = r["cases"][name]["logits"][m]
                at = r["dp_rank"] * rows
                whole[at:at + rows, p["positions"]] = p["logits"]
        out.append(whole)
    return out


def diagnosis_task(member, config: ModelStepConfig, name: str, dp: int, logits: list[torch.Tensor],
                   grads: dict[str, torch.Tensor | None], tolerance: float | None = None,
                   tiny=None) -> dict[str, Any]:
    """`diagnose` on one rank for a failed case: the lost semantic the CP=P figures match
    (`tolerance`: a narrowed glue's measured budget; None: the diagnosis's own float64 one; `tiny`:
    the config's tiny model where the caller has it, so that a `reused_builds` scope around several
    cases builds the model once)."""
    # start-up time: the model, the glue and the truth import transformers, only for a --model run
    from . import semantics
    from .native import NATIVE
    from .tiny import zoo_names  # a model_type's tiny model is one per process; a config file may change

    diagnose = getattr(semantics, "diagnose", None)
    if diagnose is None:
        return {"matched": False, "words": "this ringcheck has no diagnosis by semantics (models.semantics.diagnose)"}

    tiny = tiny_of(config) if tiny is None else tiny
    glue = glue_of(config)
    with default_dtype(config.torch_dtype), on_the_host():  # the truth: on the CPU by design
        model = tiny.build(NATIVE, dtype=config.torch_dtype, seed=config.seed)
        if grads:  # a parameter the glue's run left without a gradient (sinks it dropped): zeros, as the truth's
            grads = {n: torch.zeros_like(p) if grads.get(n) is None else grads[n] for n, p in model.named_parameters()}
        case = model_case(name, tiny, config.world_size, glue.layout)
        found = diagnose(model, tiny, case_batches(config, tiny, case, dp), logits, grads or None,
                         world_size=config.world_size, layout=glue.layout, tolerance=tolerance,
                         key=(config.model, config.dtype, config.seed, dp, case) if config.model in zoo_names() else None)
    return diagnosis_dict(found)


def diagnosis_dict(found: Any) -> dict[str, Any]:
    """A `Diagnosis` as plain data for the report: the loss of semantics matched (None: none; "none":
    the figures equal the native model itself, within the diagnosis's tolerance), its layers, its
    words (`summary()`), and whether the recomputation reproduced the truth at all."""
    if found is None:
        return {"matched": False, "words": "no diagnosis"}
    loss = getattr(found, "matched", None)
    summary = getattr(found, "summary", None)
    words = summary() if callable(summary) else str(found)
    out = {"matched": loss not in (None, "none"), "loss": loss, "layers": list(getattr(found, "layers", ()) or ()),
           "words": words, "reproducible": getattr(found, "reproducible", None),
           "tolerance": getattr(found, "tolerance", None)}
    first = (getattr(found, "matches", None) or (None,))[0] if out["matched"] else None
    if first is not None and getattr(first, "candidate", None) is not None:  # every reading of the nearest match
        c = first.candidate
        out.update(readings=[{"losses": list(ls), "words": w}
                             for ls, w in zip(c.reading_losses, c.readings)],
                   distance=first.distance(), what="your logits" if found.truth.grads is None else
                   "your logits and gradients")
    return out
