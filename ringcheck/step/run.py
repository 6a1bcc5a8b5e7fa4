"""The runs of `ringcheck step`: the recipe's step on every rank of a mesh, once at CP=P and once
at CP=1 (the reference: the same data-parallel dims, a real process group of one rank per CP
group, the attention our ring on that group of one: the dense float64 attention), every case in
turn; and, for a failure, the diagnosis's candidates on one rank.

`StepConfig` holds the settings, checked at construction (the value received and the fix).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..harness import ImplOptions, Mesh
from ..harness.mesh import REPLICAS
from ..harness.runner import loaded
from ..harness.settings import default_dtype
from ..ring.layouts import positions
from ..spec import DTYPES, REFERENCE_DTYPES, RingSpec, check_int
from .cases import CASES, micro_batches
from .contract import CP, calling, load_recipe, vocab_of
from .diagnosis import candidates
from .noise import NAIVE, NOISE_RUNS

STEP_DTYPES = ("float64", "float32")
ATTENTION_DTYPES = ("float32", "bfloat16", "float16")  # what --attention-dtype may narrow the ring to
ROLES = ("ring", "reference", *NOISE_RUNS)  # the runs: the ring under test, the reference, the noise runs
CANNOT_RUN = "the step cannot run case"  # what `run_case` says when the recipe's step raises in a case
_CANNOT_RUN = re.compile(CANNOT_RUN + r" (?P<case>\w+) at CP=(?P<cp>\d+) \(.*?\): (?P<what>.*)$")


def step_mesh(world_size: int, mesh: str | None) -> Mesh:
    """The device mesh of a step's settings: `mesh` parsed, else one ring of `world_size`."""
    return Mesh.ring(world_size) if mesh is None else Mesh.parse(mesh)


def check_ring_settings(config) -> None:
    """What every step's settings (a recipe's and a `--model`'s) must hold: --world-size, --seed,
    and a --mesh whose cp dim is the ring (ValueError with the value received and the fix)."""
    check_int("--world-size", config.world_size, low=1)
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {config.seed!r}")
    if config.mesh is not None and config.mesh_spec.cp != config.world_size:
        raise ValueError(f"--mesh {config.mesh} has cp={config.mesh_spec.cp} but --world-size is {config.world_size}: "
                         f"the cp dim is the ring; drop --world-size or make the two agree")


@dataclass(frozen=True)
class StepConfig:
    """`ringcheck step`'s settings."""

    recipe: str = "plain"
    impl: str = "ringcheck"
    world_size: int = 4
    mesh: str | None = None
    layout: str = "zigzag"
    dtype: str = "float64"
    seed: int = 0
    cases: tuple[str, ...] = field(default_factory=lambda: tuple(CASES))
    backend: str = "torch"
    attention_dtype: str | None = None
    flash_attn_stand_in: bool = False

    def __post_init__(self) -> None:
        check_ring_settings(self)
        if self.dtype not in STEP_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: the step is judged in {' or '.join(STEP_DTYPES)} (float64 is exact "
                             f"enough to see a 1e-10 bug); pass --dtype float64")
        narrower = [n for n in ATTENTION_DTYPES if DTYPES[n].itemsize < REFERENCE_DTYPES[self.dtype].itemsize]
        if self.attention_dtype is not None and self.attention_dtype not in narrower:
            raise ValueError(f"--attention-dtype {self.attention_dtype!r}: the ring's attention may run narrower than "
                             f"the step's {self.dtype}, in one of {narrower}; drop the flag to run it in {self.dtype}")
        RingSpec(self.world_size, self.layout)
        bad = [c for c in self.cases if c not in CASES]
        if bad or not self.cases:
            raise ValueError(f"--cases: unknown case(s) {bad}; choose from {', '.join(CASES)}")

    @property
    def mesh_spec(self) -> Mesh:
        return step_mesh(self.world_size, self.mesh)

    @property
    def reference_mesh(self) -> Mesh:
        """The same mesh with a CP dim of one: the reference."""
        return self.mesh_spec.with_cp(1)

    @property
    def impl_options(self) -> ImplOptions:
        return ImplOptions(self.impl, self.layout, self.backend, stand_in=self.flash_attn_stand_in)

    @property
    def narrow(self) -> torch.dtype | None:
        """The dtype the ring's attention is called in (q, k, v cast in, out cast back): None for the step's own."""
        return None if self.attention_dtype is None else DTYPES[self.attention_dtype]

    @property
    def reference_options(self) -> ImplOptions:
        """The reference's attention: our ring on a group of one, the dense float64 attention (a
        ring under test need not run on one rank, and one wrong there too is then caught)."""
        return ImplOptions("ringcheck", self.layout, "torch")

    def flags(self) -> list[str]:
        out = ["--recipe", self.recipe, "--impl", self.impl, "--world-size", str(self.world_size)]
        out += ["--mesh", self.mesh] if self.mesh is not None else []
        out += ["--layout", self.layout, "--dtype", self.dtype, "--seed", str(self.seed)]
        out += ["--cases", ",".join(self.cases)]
        out += ["--backend", self.backend] if self.backend != "torch" else []
        out += ["--attention-dtype", self.attention_dtype] if self.attention_dtype is not None else []
        return out + (["--flash-attn-stand-in"] if self.flash_attn_stand_in else [])


def build_model(recipe, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The recipe's model, seeded the same way everywhere, its floating parameters in `dtype`."""
    torch.manual_seed(seed)
    model = recipe.model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--recipe {recipe.name}: model() returned a {type(model).__name__}, not a torch.nn.Module")
    return model.to(dtype)


def ring_positions(config: StepConfig) -> torch.Tensor:
    """The positions rank 0 of the ring under test holds (where the uneven case counts almost nothing)."""
    return positions(layout=config.layout, rank=0, world_size=config.world_size, seq_len=64)


def on_device(batches: list[dict], device) -> list[dict]:
    return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in batches]


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient gathered to the full tensor; a plain one as it is."""
    full = getattr(grad, "full_tensor", None)
    return (full() if callable(full) else grad).detach().clone()


def _loss_value(loss: Any, recipe: str, case: str) -> float:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"--recipe {recipe}, case {case}: step returned {type(loss).__name__}; the contract is the loss "
                    f"the user would log (a scalar tensor or a float)")


def _call_step(recipe, evaluate: bool, model, batches: list[dict], cp: CP) -> Any:
    if not evaluate:
        return recipe.step(model, batches, cp)
    if recipe.evaluate is None:
        raise ValueError("the recipe offers no evaluate(model, micro_batches, cp)")
    with torch.no_grad():
        return recipe.evaluate(model, batches, cp)


def run_case(recipe, case_name: str, cp: CP, config: StepConfig, positions0: torch.Tensor) -> dict[str, Any]:
    """One case on one rank: the model from the seed, the step (or the evaluation), the loss and
    every parameter's gradient (None where none reached it)."""
    case = CASES[case_name]
    dtype = REFERENCE_DTYPES[config.dtype]
    with default_dtype(dtype):
        model = build_model(recipe, dtype, config.seed).to(cp.device)
        vocab, vocab_from = vocab_of(recipe, model)
        batches = on_device(micro_batches(case, vocab=vocab, seed=config.seed, dp=cp.dp_size,
                                          rank0_positions=positions0), cp.device)
        try:
            with calling(cp):
                loss = _call_step(recipe, case.evaluate, model, batches, cp)
        except Exception as exc:
            raise RuntimeError(f"--recipe {recipe.name}: {CANNOT_RUN} {case_name} at CP={cp.size} ({case.words}): "
                               f"{type(exc).__name__}: {exc}") from exc
    grads = {n: None if p.grad is None else _full(p.grad).cpu() for n, p in model.named_parameters()}
    return {"loss": _loss_value(loss, recipe.name, case_name), "grads": grads,
            "found": {"vocab": vocab_from, "transformers": transformers_model(model)}}


def transformers_logits(model: torch.nn.Module, batch: dict, cp: CP) -> torch.Tensor:
    """A transformers model's logits on whole sequences, called by ringcheck where the recipe has
    no `logits` hook: `model(input_ids, position_ids, use_cache=False).logits` with `cp` (a group
    of one, its `cu_seqlens` the batch's documents) active, the sequence padded at its end to the
    layout's multiple (positions counting on; causal attention keeps the pads out of the rest)."""
    ids, pos = batch["input_ids"], batch["position_ids"]
    n, extra = ids.shape[1], -ids.shape[1] % cp.multiple
    if extra:
        ids = F.pad(ids, (0, extra))
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)], dim=1)
    with calling(replace(cp, cu_seqlens=batch.get("cu_seqlens"))):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :n]


def transformers_model(model: torch.nn.Module) -> str | None:
    """The class name of a transformers model (a `transformers.PreTrainedModel`), else None;
    read from the class's bases, so a run without transformers imports nothing."""
    bases = type(model).__mro__
    found = any(c.__name__ == "PreTrainedModel" and c.__module__.split(".")[0] == "transformers" for c in bases)
    return type(model).__name__ if found else None


def cannot_run(failures: dict) -> tuple[str, str] | None:
    """The case a run failed on because the recipe's step raised in it (`run_case`'s message,
    from a `RingError`'s `failures`: rank -> what it said), and what the step said; None when
    the run failed otherwise (the contract, a hang, a crash: no case can be trusted then)."""
    for text in failures.values():
        found = _CANNOT_RUN.search(str(text).split("\n", 1)[0])
        if found is not None:
            return found["case"], f"at CP={found['cp']} the step raised {found['what']}"
    return None


def attention_of(config: StepConfig, role: str) -> tuple[ImplOptions, torch.dtype | None]:
    """The attention of a run (`ROLES`) and the dtype it is called in (None: the step's own)."""
    if role == "ring":
        return config.impl_options, config.narrow
    if role == "reference":
        return config.reference_options, config.narrow
    if role == "unrounded":
        return config.reference_options, None
    if role == "naive":
        return ImplOptions(NAIVE, config.layout, "torch"), config.narrow
    raise ValueError(f"unknown run {role!r}; one of {ROLES}")


def step_task(member, config: StepConfig, names: tuple[str, ...], positions0: torch.Tensor,
              role: str = "ring") -> dict[str, Any]:
    """One rank of a run (`ringcheck.launch` task): every case of `names` in turn, the attention
    through the ring under test, or the reference's or a noise run's (`attention_of`)."""
    recipe = load_recipe(config.recipe)
    options, narrow = attention_of(config, role)
    impl = loaded(options)
    cases = {}
    for name in names:
        cp = CP(rank=member.rank, size=member.world_size, group=member.group, layout=config.layout, impl=impl,
                dp_rank=member.group_index, dp_size=dist.get_world_size(member.groups[REPLICAS]),
                dp_group=member.groups[REPLICAS],
                checkpoint=CASES[name].checkpoint, timeout=member.timeout, global_rank=member.global_rank,
                device=member.device, attention_dtype=narrow)
        cases[name] = run_case(recipe, name, cp, config, positions0)
    data = None
    if recipe.loader is not None and member.world_size > 1:
        with calling(cp):
            data = batch_digest(recipe.loader(cp, config.seed))
    return {"cp_rank": member.rank, "dp_rank": member.group_index, "cases": cases, "data": data}


def batch_digest(batches) -> str:
    """A digest of the tensors a loader handed out (what every rank of a CP group must share)."""
    digest = hashlib.sha256()
    for mb in batches:
        for key in sorted(mb):
            value = mb[key]
            digest.update(key.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes() if isinstance(value, torch.Tensor)
                          else repr(value).encode())
    return digest.hexdigest()[:16]


def diagnosis_task(member, config: StepConfig, requests: tuple[tuple[str, int, tuple[str, ...]], ...],
                   positions0: torch.Tensor) -> dict[str, Any]:
    """On one rank (a CP group of one): per request (case, ring size, transformations) the
    candidates of `ringcheck.step.diagnosis`, from the recipe's `logits`, or a transformers
    model's own logits where the recipe has none (`transformers_logits`); nothing without either."""
    recipe = load_recipe(config.recipe)
    dtype = REFERENCE_DTYPES[config.dtype]
    with default_dtype(dtype):
        probe = build_model(recipe, dtype, config.seed)
    if recipe.logits is None:
        if transformers_model(probe) is None:
            return {}
        recipe = replace(recipe, logits=transformers_logits)
    cp = CP(rank=0, size=1, group=member.group, layout=config.layout, impl=loaded(config.reference_options),
            dp_group=member.group, timeout=member.timeout, global_rank=member.global_rank, device=member.device,
            attention_dtype=config.narrow)
    dp = config.mesh_spec.rings
    out = {}
    with default_dtype(dtype):
        vocab = vocab_of(recipe, probe)[0]
        for case_name, P, names in requests:
            batches = on_device(micro_batches(CASES[case_name], vocab=vocab, seed=config.seed, dp=dp,
                                              rank0_positions=positions0), cp.device)
            out[f"{case_name}@{P}"] = candidates(recipe, lambda: build_model(recipe, dtype, config.seed).to(cp.device),
                                                 batches, cp, P=P, layout=config.layout, dp=dp, names=names)
    return out
