"""What `ringcheck validate` judges: the `Target` (the implementation, the attention at its full
length, the ring and the mesh it is embedded in) and the scaled-down cases of its family.

A target is made from flags or a TOML config's keys (the field names below); every key's type
is checked at load, naming the key (`check_types`), and an unknown key gets a "did you mean".
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass
from typing import Any

from ...adapters import Impl, require_variant_keywords
from ...harness import Mesh
from ...judge.check import Case
from ...judge.distributions import DISTRIBUTIONS
from ...judge.variant_options import VariantOptions
from ...ring.layouts import positions
from ...ring.loops import check_sinks_grad
from ...spec import AttentionSpec, RingSpec, is_custom_layout

SCALED_MIN_BATCH = 2  # the scaled-down cases' least batch
# The ragged shards' tokens per rank: longer than the tiles block kernels walk (16, 32, 64, 128)
# and a multiple of none of them (66 = 64 + 2, 130 = 128 + 2; their zig-zag chunks 33 and 65 are
# odd), so a kernel whose grid is `n // TILE` leaves a ragged tile out at each
# (docs/explanation/ragged-lengths.md). The first is the longest: the cases alternate long and
# short in one process (`ragged_cases`), the calls that change length.
RAGGED_LENGTHS = (130, 66)
# --only: the rows a run may be restricted to ("ragged": the ragged shards and the calls that
# change length, with the rows that judge every run: no NaN/Inf, output shape and dtype)
ONLY = ("ragged",)

# each field's type, as a config may spell it: (python types accepted, words for the message)
_INT, _FLOAT, _STR, _BOOL = (int,), (int, float), (str,), (bool,)
FIELD_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {  # name -> (types, in words, None allowed)
    "seq_len": (_INT, "an integer", False), "batch": (_INT, "an integer", False), "heads": (_INT, "an integer", False),
    "kv_heads": (_INT, "an integer", False), "head_dim": (_INT, "an integer", False),
    "dtype": (_STR, "a string (float32, bfloat16 or float16)", False), "causal": (_BOOL, "true or false", False),
    "layout": (_STR, "a string", False), "softmax_scale": (_FLOAT, "a number", True),
    "world_size": (_INT, "an integer", False), "impl": (_STR, "a string", False),
    "backend": (_STR, "a string", False), "seed": (_INT, "an integer", False),
    "sample_rows": (_INT, "an integer", False), "local_lengths": ((list, tuple), "a list of integers", False),
    "ragged_lengths": ((list, tuple), "a list of integers (empty: none)", False),
    "distributions": ((list, tuple), "a list of strings", True), "documents": (_STR, 'a string ("LEN,LEN,..." or '
                                                                                    '"random:K")', True),
    "pad": (_INT, "an integer", False), "window": ((list, tuple), "a list of two integers [LEFT, RIGHT]", True),
    "softcap": (_FLOAT, "a number", True), "sinks": (_BOOL, "true or false", False),
    "head_dim_v": (_INT, "an integer", True), "flash_attn_stand_in": (_BOOL, "true or false", False),
    "forward_only": (_BOOL, "true or false", False), "mesh": (_STR, 'a string like "dp=2,cp=4"', True),
    "sinks_grad": (_STR, 'a string ("partial" or "reduced")', False), "compile": (_BOOL, "true or false", False),
    "only": (_STR, f"a string ({' or '.join(ONLY)})", True),
}
_ITEMS = {"local_lengths": int, "ragged_lengths": int, "distributions": str, "window": int}


def check_keys(values: dict[str, Any], known, source: str) -> None:
    """ValueError for keys that name no field, with the closest known key and the full list."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        hints = [f"{close[0]!r} for {k!r}" for k in unknown if (close := difflib.get_close_matches(k, known, 1))]
        said = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise ValueError(f"{source}: unknown key(s) {unknown}{said}; known: {', '.join(sorted(known))}")


def check_types(values: dict[str, Any], *, source: str) -> None:
    """TypeError naming the first key whose value has the wrong type (bool is no integer)."""
    for key, value in values.items():
        if key not in FIELD_TYPES:
            continue
        types, words, optional = FIELD_TYPES[key]
        if value is None and optional:
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and key in _ITEMS:
            item = _ITEMS[key]
            ok = all(isinstance(x, item) and not isinstance(x, bool) for x in value) and (key != "window" or
                                                                                       len(value) == 2)
        if not ok:
            raise TypeError(f"{source}: {key} must be {words}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Target:
    """What to validate. Defaults: our ring on a CPU-sized causal zig-zag bf16 problem."""

    seq_len: int = 2048
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    causal: bool = True
    layout: str = "zigzag"
    softmax_scale: float | None = None
    world_size: int = 4
    impl: str = "ringcheck"
    backend: str = "torch"
    seed: int = 0
    sample_rows: int = 16
    local_lengths: tuple[int, ...] = (2, 6, 16)
    ragged_lengths: tuple[int, ...] = RAGGED_LENGTHS  # tokens per rank of the ragged shards; () leaves them out
    distributions: tuple[str, ...] | None = None  # None: every registered distribution
    # attention variants (`VariantOptions`; none by default): the training configuration
    documents: str | None = None
    pad: int = 0
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    head_dim_v: int | None = None
    # `import flash_attn` resolves to ringcheck's CPU stand-in on every rank (when the real one is absent)
    flash_attn_stand_in: bool = False
    forward_only: bool = False  # an inference ring: no backward is run, backward rows say "not run"
    # the device mesh the ring is embedded in (`Mesh`, e.g. "dp=2,cp=4"; its cp dim is world_size);
    # None: the default (local rings: the scaled-down cases on cp=P,tp=2, the full length alone)
    mesh: str | None = None
    sinks_grad: str = "partial"  # each rank's sinks.grad: its own rows' share, or the whole ("reduced")
    compile: bool = False  # the compile row: torch.compile of the ring (seconds of dynamo per rank)
    only: str | None = None  # run these rows alone (`ONLY`); None: every row

    def __post_init__(self) -> None:
        check_types(dataclasses.asdict(self), source="target")
        if isinstance(self.window, list):
            object.__setattr__(self, "window", tuple(self.window))
        check_sinks_grad(self.sinks_grad)
        if self.mesh is not None and self.mesh_spec.cp != self.world_size:
            raise ValueError(f"--mesh {self.mesh} has cp={self.mesh_spec.cp} but --world-size is {self.world_size}: the "
                             f"cp dim is the ring; drop --world-size or make the two agree")
        ring = RingSpec(self.world_size, self.layout)
        ring.check_seq_len(self.seq_len)
        self.full_spec()  # validates shape, dtype, heads / kv_heads and the variant at full length
        for n in self.local_lengths:  # and at every scaled length
            if n >= 1 and not (self.layout in ("zigzag", "zigzag_docs") and n % 2):
                self.spec(n * self.world_size)
        if self.sample_rows < 1:
            raise ValueError(f"sample_rows must be >= 1, got {self.sample_rows}")
        if self.sample_rows > self.seq_len:
            raise ValueError(f"sample_rows={self.sample_rows} is more than the seq_len={self.seq_len} query rows of "
                             f"the target; pass --sample-rows {self.seq_len} (every row) or fewer, or a longer --seq-len")
        for n in self.local_lengths:
            if n < 1 or (self.layout in ("zigzag", "zigzag_docs") and n % 2):
                raise ValueError(f"local length {n} does not fit the {self.layout} layout "
                                 f"(zigzag needs an even number of tokens per rank)")
        for n in self.ragged_lengths:
            if n < 2:
                raise ValueError(f"ragged length {n}: the ragged shards need 2 tokens per rank or more (pass "
                                 f"--ragged-lengths none to leave them out)")
        if self.only is not None and self.only not in ONLY:
            raise ValueError(f"only={self.only!r} names no rows; choose from {', '.join(ONLY)}, or leave it out for "
                             f"every row")
        if self.only == "ragged" and not ragged_fit(self)[0]:  # no PASS without evidence
            why = "; ".join(ragged_fit(self)[1]) or "--ragged-lengths none"
            raise ValueError(f"--only ragged has nothing to run ({why}): pass --ragged-lengths that the {self.layout} "
                             f"layout can hold (default {','.join(map(str, RAGGED_LENGTHS))}), or leave --only out")
        for name in self.distributions or ():
            if name not in DISTRIBUTIONS:
                raise ValueError(f"distribution {name!r} is unknown; choose from {sorted(DISTRIBUTIONS)}")

    def full_spec(self) -> AttentionSpec:
        return self.spec(self.seq_len, self.batch)

    @property
    def scaled_batch(self) -> int:
        """The scaled-down cases' batch: 2 at least (a batch-1 case hides batch-major bugs)."""
        return max(SCALED_MIN_BATCH, self.batch)

    @property
    def mesh_spec(self) -> Mesh | None:
        return None if self.mesh is None else Mesh.parse(self.mesh)

    @property
    def variants(self) -> VariantOptions:
        return VariantOptions(documents=self.documents, pad=self.pad, window=self.window, softcap=self.softcap,
                              sinks=self.sinks, head_dim_v=self.head_dim_v)

    def spec(self, seq_len: int, batch: int = 1, seed: int | None = None) -> AttentionSpec:
        """The target's problem at `seq_len`: at the full length with the variant as given, at a
        scaled-down length with it scaled (`scaled_variants`); `seed` places random documents."""
        options = self.variants.scaled(seq_len, self.seq_len, self.ring)
        variant, sinks, v_head_dim = options.resolve(seq_len, self.ring, self.seed if seed is None else seed)
        spec = AttentionSpec(batch=batch, heads=self.heads, kv_heads=self.kv_heads, seq_len=seq_len,
                             head_dim=self.head_dim, dtype=self.dtype, causal=self.causal,
                             softmax_scale=self.softmax_scale, variant=variant, sinks=sinks, v_head_dim=v_head_dim)
        if self.layout == "zigzag_docs" or is_custom_layout(self.layout):  # documents cut into 2P chunks; a
            # custom layout's ranks partition the sequence (checked here, before any rank starts)
            positions(layout=self.layout, rank=0, world_size=self.world_size, seq_len=seq_len,
                      cu_seqlens=variant.cu_seqlens)
        return spec

    @property
    def ring(self) -> RingSpec:
        return RingSpec(self.world_size, self.layout)

    def describe(self) -> str:
        return " ".join([
            f"--impl {self.impl} --world-size {self.world_size} --layout {self.layout} "
            f"--seq-len {self.seq_len} --batch {self.batch} --heads {self.heads} "
            f"--kv-heads {self.kv_heads} --head-dim {self.head_dim} --dtype {self.dtype}"
            + (" --causal" if self.causal else "")
            + (f" --softmax-scale {self.softmax_scale}" if self.softmax_scale is not None else "")
            + (f" --mesh {self.mesh}" if self.mesh is not None else "")
            + (f" --sinks-grad {self.sinks_grad}" if self.sinks else ""),
            *self.variants.flags()])

    @classmethod
    def from_mapping(cls, values: dict[str, Any], *, source: str = "config") -> Target:
        """A target from keys named like its fields (a TOML config, flags): an unknown key gets
        a "did you mean", a value of the wrong type names its key (`check_types`)."""
        normalised = {key.replace("-", "_"): value for key, value in values.items()}
        check_keys(normalised, [f.name for f in dataclasses.fields(cls)], source)
        check_types(normalised, source=source)
        for key in ("local_lengths", "ragged_lengths", "distributions", "window"):
            if isinstance(normalised.get(key), list):
                normalised[key] = tuple(normalised[key])
        return cls(**normalised)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_variant_keywords(impl: Impl, target: Target) -> None:
    """ValueError naming the keyword and its flag when the target uses a variant keyword the
    implementation does not accept (nor **kwargs): before any rank starts."""
    if impl.check_target is not None:  # a built-in adapter's own rules (variants, heads)
        impl.check_target(target)
    require_variant_keywords(impl.fn, impl.name, target.full_spec())


# distributions that place every row's maximum on one key per ring step that every row of a
# group sees: with documents or a window no such key exists, so they are left out there
WHOLE_SEQUENCE_ONLY = ("late-max",)


def _distributions(target: Target) -> tuple[str, ...]:
    dists = target.distributions or tuple(DISTRIBUTIONS)
    if target.full_spec().variant.masks_tokens:
        dists = tuple(d for d in dists if d not in WHOLE_SEQUENCE_ONLY) or ("normal",)
    return dists


def scaled_cases(target: Target) -> list[Case]:
    """The scaled-down cases: every distribution at every ring-local length, at the target's
    batch (2 at least), heads, dtype, layout and variant."""
    dists = _distributions(target)
    cases = []
    for i, (dist_name, n) in enumerate(itertools.product(dists, target.local_lengths)):
        spec = target.spec(n * target.world_size, target.scaled_batch, seed=target.seed + i)
        cases.append(Case(spec, target.ring, seed=target.seed + i, distribution=dist_name, backend=target.backend))
    return cases


RAGGED_SEED = 7_000_003  # the ragged cases' seed offset (other data than the scaled cases')


def ragged_fit(target: Target) -> tuple[tuple[int, ...], list[str]]:
    """The ragged lengths the target's layout (and variant) can hold, and a sentence for each it
    cannot (left out, and said so in the row: a layout is never handed a shard it cannot hold)."""
    fit, left_out = [], []
    for n in target.ragged_lengths:
        try:
            target.ring.check_seq_len(n * target.world_size)
            target.spec(n * target.world_size, target.scaled_batch)
        except ValueError as exc:
            left_out.append(f"{n} tokens per rank left out: {str(exc).splitlines()[0]}")
            continue
        fit.append(n)
    return tuple(fit), left_out


def ragged_cases(target: Target) -> list[list[Case]]:
    """The ragged shards, as the calls that run them: every distribution at each ragged length
    (longest first, then the others in turn), then the first call again (its inputs: the same
    bits expected), so that one rank process calls the ring long, short, long again. Each call
    holds every distribution's case at that length: one call, each distribution a slice of its
    batch, judged on its own (`ragged.ragged_rows`); with sinks (one per head, shared by
    the batch) each distribution is a call of its own."""
    lengths, _ = ragged_fit(target)
    if not lengths:
        return []
    calls, dists = [], _distributions(target)
    # a bundle's batch is its distributions' (2 at least, as every scaled case's): one element each
    batch = target.scaled_batch if target.sinks or len(dists) < SCALED_MIN_BATCH else 1
    for n in sorted(set(lengths), reverse=True):
        seed = target.seed + RAGGED_SEED + n
        spec = target.spec(n * target.world_size, batch, seed=seed)
        bundle = [Case(spec, target.ring, seed=seed + i, distribution=d, backend=target.backend)
                  for i, d in enumerate(dists)]
        calls += [[case] for case in bundle] if target.sinks else [bundle]
    return [*calls, calls[0]] if len(set(lengths)) > 1 else calls
