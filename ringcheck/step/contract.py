"""The recipe contract: what `ringcheck step` calls of a user's training step, and what it hands it.

A recipe is an object (or a module) with

- `model()` -> `torch.nn.Module`: the user's model at a tiny size. ringcheck seeds torch the same
  way on every rank and sets torch's default dtype to `--dtype` first, then casts the model's
  floating parameters to it, so every rank and the reference start identical;
- `step(model, micro_batches, cp)` -> the loss the user would log: the whole training step of
  one optimizer step (shard inputs, labels and positions for `cp`, forward with the attention
  through `cp.attention` on `cp.group`, the loss and its reduction, backward, the gradient
  reduction over `cp.group` and `cp.dp_group`). ringcheck then reads every parameter's `.grad`.

and optionally

- `vocab_size`: the token ids ringcheck may draw (0 .. vocab_size - 1); without it they are read
  from the model's input embeddings (`vocab_of`), and the report says so;
- `logits(model, input_ids, position_ids)` -> (batch, seq, vocab): the model's logits on whole
  sequences, called by ringcheck at CP=1. The model's attention finds that call's `cp` (a CP
  group of one, its `cu_seqlens` the batch's documents) as `active_cp()`, or as a keyword `cp`
  where the hook takes one. The older form `logits(model, batch, cp)` works too, told apart by
  the parameters' names (`logits_form`). With it ringcheck compares the loss with its own
  definition (the convention) and diagnoses a failure (`ringcheck.step.diagnosis`);
- `evaluate(model, micro_batches, cp)` -> the loss alone, forward only (ringcheck calls it under
  `torch.no_grad()`; the evaluation case);
- `checkpointing`: the activation-checkpointing modes the step offers, of ("non_reentrant",
  "reentrant"); the checkpointing cases set `cp.checkpoint` to one of them;
- `loss_dtype`: the narrowest dtype the step's loss is computed in (e.g. "float32" when the loss
  casts logits to float32, as transformers' ForCausalLMLoss does): the budget's unit roundoff;
- `loader(cp, seed)` -> the micro-batches this rank's data pipeline would hand its step: every
  rank of a CP group must get the same ones, the data-parallel replicas different ones.

While ringcheck calls any hook on a rank, `active_cp()` is the `cp` of that call.

A micro-batch is a dict in the common convention, the same global tensors on every rank:
`input_ids` (B, N) int64; `labels` (B, N) int64 **unshifted** (the target of position i is
labels[:, i + 1]), -100 where not counted; `position_ids` (B, N) global, restarting at 0 at each
document of a packed sequence; `cu_seqlens`: the documents' global boundaries (a tuple, the same
for every row) or None.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ..adapters import Impl, accepted_keywords, unpack
from ..harness.settings import default_dtype
from ..ring.layouts import positions
from ..spec import RingSpec
from ..user_code import import_object

IGNORE = -100  # the label of a position the loss does not count (PyTorch's and transformers' ignore_index)
CHECKPOINTING = ("non_reentrant", "reentrant")
BUILTIN_RECIPES = {"plain": "ringcheck.recipes.plain:recipe", "hf_llama": "ringcheck.recipes.hf_llama:recipe"}


@dataclass(frozen=True)
class CP:
    """What a recipe's step learns about its place: its rank and the size of its CP group, the
    group, the layout of the shards, the data-parallel replica it is in (`dp_rank` of `dp_size`,
    `dp_group`: the ranks at its cp index in every replica), and the attention under test
    (`attention`: the ring of `--impl` on `group`), and the device of this rank (the model and the
    micro-batches are there already: CUDA under torchrun where the ranks have GPUs). At CP=1
    `group` is a real process group of one rank, so the recipe's own collectives run unchanged.
    `checkpoint`: the activation
    checkpointing the case asks for (None, or one of `CHECKPOINTING`)."""

    rank: int
    size: int
    group: Any
    layout: str
    impl: Impl
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    checkpoint: str | None = None
    timeout: float = 60.0
    global_rank: int = 0
    device: str = "cpu"
    attention_dtype: torch.dtype | None = None
    cu_seqlens: tuple[int, ...] | None = None  # a logits call's documents: the attention's default

    @property
    def multiple(self) -> int:
        """The sequence length must be a multiple of this for the layout (2 x size for zigzag)."""
        return RingSpec(self.size, self.layout).chunks

    def positions(self, seq_len: int, cu_seqlens=None) -> torch.Tensor:
        """The global positions this rank holds, in its local order."""
        return positions(layout=self.layout, rank=self.rank, world_size=self.size, seq_len=seq_len,
                         cu_seqlens=cu_seqlens)

    def shard(self, x: torch.Tensor, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
        """This rank's tokens of the global `x` along `dim`, as a contiguous tensor of its own (a
        contiguous layout's shard would otherwise be a strided view, and `.view(-1)` on it fails)."""
        index = self.positions(x.shape[dim], cu_seqlens).to(x.device)
        return x.index_select(dim, index).contiguous()

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This data-parallel replica's rows (dim 0) of a global batch tensor."""
        if x.shape[0] % self.dp_size:
            raise ValueError(f"a batch of {x.shape[0]} rows cannot be dealt to {self.dp_size} data-parallel "
                             f"replicas; give it a multiple of {self.dp_size} rows")
        n = x.shape[0] // self.dp_size
        return x[self.dp_rank * n:(self.dp_rank + 1) * n]

    def pad(self, x: torch.Tensor, value, dim: int = 1) -> torch.Tensor:
        """`x` right-padded with `value` along `dim` to a multiple of `multiple`."""
        extra = -x.shape[dim] % self.multiple
        if not extra:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x, x.new_full(shape, value)], dim=dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                  softmax_scale: float | None = None, cu_seqlens=None) -> torch.Tensor:
        """The attention under test on this rank's shards (batch, local_seq, heads, head_dim):
        the ring of `--impl` on `group`, with the global document boundaries `cu_seqlens`. With
        `attention_dtype` (a ring narrower than the step: `--attention-dtype`) q, k, v are cast to
        it on the way in and out is cast back on the way out (their gradients the same way), and
        the ring's forward runs with torch's default dtype float32, as in training."""
        cu_seqlens = self.cu_seqlens if cu_seqlens is None else cu_seqlens
        narrow = self.attention_dtype
        if narrow is not None and q.dtype != narrow:
            with default_dtype(torch.float32):  # as in the training it runs in (a ring may build its accumulators so)
                out = self.attention(q.to(narrow), k.to(narrow), v.to(narrow), causal=causal,
                                     softmax_scale=softmax_scale, cu_seqlens=cu_seqlens)
            return out.to(q.dtype)
        extra = {"layout": self.layout}
        if cu_seqlens is not None:
            if not accepted_keywords(self.impl.fn, ("cu_seqlens",)):
                raise ValueError(f"--impl {self.impl.name} takes no cu_seqlens: it cannot attend within packed "
                                 f"documents; drop the packed case (--cases) or use a ring that takes them")
            extra["cu_seqlens"] = torch.as_tensor(cu_seqlens, dtype=torch.int64)
        out, _ = unpack(self.impl.call(q, k, v, causal=causal, softmax_scale=softmax_scale or q.shape[-1] ** -0.5,
                                       group=self.group, **extra), q, v, self.impl.name)
        return out


_ACTIVE: contextvars.ContextVar[CP | None] = contextvars.ContextVar("ringcheck_step_cp", default=None)


def active_cp() -> CP | None:
    """The `cp` of the hook ringcheck is calling on this rank (step, evaluate, logits, loader);
    None outside one. For a model whose attention is not handed `cp`: in a call of
    `logits(model, input_ids, position_ids)` it is a CP group of one, its `cu_seqlens` the
    batch's documents (so `cp.attention(q, k, v)` attends within them)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def calling(cp: CP) -> Iterator[CP]:
    """`cp` is `active_cp()` for the block (ringcheck's calls of a recipe's hooks)."""
    token = _ACTIVE.set(cp)
    try:
        yield cp
    finally:
        _ACTIVE.reset(token)


def logits_form(fn: Callable[..., Any]) -> str:
    """"ids" for the contract's `logits(model, input_ids, position_ids)`, "batch" for the older
    `logits(model, batch, cp)`: a second parameter named `batch`, or a third named `cp`, is the
    older form (a signature that cannot be read is taken as the contract's)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "ids"
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return "batch" if names[1:2] == ["batch"] or names[2:3] == ["cp"] else "ids"


def logits_hook(fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A recipe's logits hook, whichever its form, as ringcheck calls it: `(model, batch, cp)`,
    with `cp` (its `cu_seqlens` the batch's) active for the call; in the contract's form a
    parameter named `cp` (keyword) gets it too."""
    form = logits_form(fn)
    try:
        named = inspect.signature(fn).parameters.get("cp")
    except (TypeError, ValueError):
        named = None
    keyword = form == "ids" and named is not None and named.kind in (named.KEYWORD_ONLY, named.POSITIONAL_OR_KEYWORD)

    def call(model, batch: dict, cp: CP) -> torch.Tensor:
        with calling(replace(cp, cu_seqlens=batch.get("cu_seqlens"))) as whole:
            if form == "batch":
                return fn(model, batch, whole)
            return fn(model, batch["input_ids"], batch["position_ids"], **({"cp": whole} if keyword else {}))
    call.form = form
    return call


def documents_of(position_ids: torch.Tensor) -> tuple[int, ...] | None:
    """The global document boundaries of packed rows whose positions restart at 0 at each
    document: None for one document per row; ValueError when the rows are packed differently."""
    starts = [tuple(int(i) for i in torch.nonzero(row == 0).flatten().tolist()) for row in position_ids]
    if len(set(starts)) != 1:
        raise ValueError(f"the rows of this batch are packed differently (documents start at {starts}); the ring "
                         f"takes one set of boundaries per call")
    first = starts[0]
    if first in ((), (0,)):
        return None
    return (*first, position_ids.shape[1]) if first[0] == 0 else (0, *first, position_ids.shape[1])


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """The target of every position (labels[:, i + 1]; IGNORE at the last), on the global sequence."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: its hooks, checked against the contract."""

    name: str
    vocab_size: int | None  # None: read from the model's input embeddings (`vocab_of`)
    model: Callable[[], torch.nn.Module]
    step: Callable[..., Any]
    logits: Callable[..., torch.Tensor] | None
    evaluate: Callable[..., Any] | None
    checkpointing: tuple[str, ...]
    loss_dtype: str | None
    loader: Callable[..., Any] | None = None


def vocab_of(recipe: Recipe, model: torch.nn.Module) -> tuple[int, str | None]:
    """The token ids the cases draw (0 .. n - 1) and, where the recipe declares no `vocab_size`,
    where they were read: the model's input embeddings, transformers' `get_input_embeddings()`,
    else its first `nn.Embedding` (a step needs only `model()` and `step()`)."""
    if recipe.vocab_size is not None:
        return recipe.vocab_size, None
    try:
        found, where = model.get_input_embeddings(), "get_input_embeddings()"
    except (AttributeError, NotImplementedError):
        found = None
    if not isinstance(found, torch.nn.Embedding):
        where, found = next(((f"the first nn.Embedding, {n}", m) for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Embedding)), (None, None))
    if found is None or found.num_embeddings < 2:
        raise TypeError(f"--recipe {recipe.name} has no vocab_size and its model ({type(model).__name__}) has no "
                        f"nn.Embedding to read it from; give the recipe vocab_size (the token ids the cases may draw)")
    return found.num_embeddings, (f"vocab_size {found.num_embeddings}, read from the model's input embeddings "
                                  f"({where}): the recipe declares none")


def load_recipe(spec: str) -> Recipe:
    """`--recipe`: a built-in (`BUILTIN_RECIPES`) or `package.module:object` (an object or a
    module with the hooks); ValueError/TypeError naming what is missing and the fix."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--recipe must be {' or '.join(BUILTIN_RECIPES)} or 'package.module:object', got {spec!r}")
    target = BUILTIN_RECIPES.get(spec, spec)
    if ":" not in target:
        raise ValueError(f"--recipe {spec!r} is neither a built-in recipe ({', '.join(BUILTIN_RECIPES)}) nor of the "
                         f"form 'package.module:object'")
    obj = import_object(target, f"--recipe {spec}")
    missing = [n for n in ("model", "step") if not callable(getattr(obj, n, None))]
    vocab = getattr(obj, "vocab_size", None)
    bad_vocab = vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2)
    if missing or bad_vocab:
        what = ", ".join([f"{n}()" for n in missing] + [f"vocab_size (an int >= 2, got {vocab!r})"] * bad_vocab)
        raise TypeError(f"--recipe {spec}: {type(obj).__name__} lacks {what}; a recipe has model() -> torch.nn.Module "
                        f"and step(model, micro_batches, cp) -> loss, and optionally vocab_size (else read from the "
                        f"model's input embeddings; see docs/reference/recipe-contract.md)")
    modes = tuple(getattr(obj, "checkpointing", ()) or ())
    bad = [m for m in modes if m not in CHECKPOINTING]
    if bad:
        raise ValueError(f"--recipe {spec}: checkpointing {bad} unknown; offer some of {list(CHECKPOINTING)}")
    loss_dtype = getattr(obj, "loss_dtype", None)
    if loss_dtype not in (None, "float64", "float32", "bfloat16", "float16"):
        raise ValueError(f"--recipe {spec}: loss_dtype {loss_dtype!r} is not a dtype name (e.g. 'float32')")
    hook = {n: getattr(obj, n, None) for n in ("logits", "evaluate", "loader")}
    hook = {n: f if callable(f) else None for n, f in hook.items()}
    if hook["logits"] is not None:
        hook["logits"] = logits_hook(hook["logits"])
    return Recipe(spec, vocab, obj.model, obj.step, hook["logits"], hook["evaluate"], modes, loss_dtype,
                  hook["loader"])
