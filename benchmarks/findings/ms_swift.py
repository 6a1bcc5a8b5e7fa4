"""ms-swift 4.6.0's sequence parallelism: its two crashes on configurations it accepts, its ring's
window and backward, and its loss in bf16: the minimal scripts and the patched copies.

1. **Ulysses over sdpa, a length P does not divide**: `pad_and_split_inputs` pads the position ids
   with -1 (`swift/sequence_parallel/sequence_parallel.py` L598). On the last rank the shard's
   position ids end in -1, which transformers' `create_causal_mask` reads as a new packed document
   (`find_packed_sequence_indices`) and builds its packed mask at the shard's length, while
   ms-swift's `sdpa_mask` (L104-120) asks for the mask of the whole sequence: IndexError on that
   rank (`masking_utils.py` `packed_sequence_compatibility_function`), and the other ranks wait in
   the all-to-all (`ulysses.py` L68) until the timeout. The patched copy (`continued_positions`):
   the padded position ids continue the count instead of -1, as transformers' own padding would;
   the pad tokens are after every real token, so under the causal mask no real token sees them.
2. **Its ring on a model with a sliding window**: `local_flash_attn` hands the ring
   `window_size=kwargs.get('sliding_window') or (-1, -1)` (L218): transformers' `sliding_window`
   is an int, flash-attn's `window_size` a (left, right) pair: TypeError at
   `zigzag_ring_attn.py` L228 (`window_size[0]`) on every rank, every case (mistral, gemma2,
   gemma3_text). `window_pair` passes (w - 1, w - 1), as transformers' flash path does; the ring
   then runs and loses the window (every block windowed as if its rows were contiguous: the second
   half of the finding). The patched copy (`ring_patched`) also hands its block kernels where their
   rows lie (`ms_swift_ring.patch_blocks`) and mends its backward (4).

    python -m benchmarks.findings.ms_swift minimal   # ms-swift + transformers, P=2, 15 and 32 tokens
    python -m benchmarks.findings.ms_swift confirm   # ringcheck step, as shipped and patched

3. **Its SP loss over bf16 logits**: `per_token_loss_func_sp` (`swift/trainers/utils.py` L167-183)
   takes the cross-entropy in the logits' dtype; its non-SP `per_token_loss_func` casts to float32.
   The patched copy (`flash_float_loss`) hands it float32 logits.
4. **Its ring's backward** (any model its ring runs): each block's backward gets the block's own
   output where flash-attn's D needs the final one, and the first block's lse is overwritten in place
   before its backward reads it; minimal script and patches: `benchmarks.findings.ms_swift_ring`.

`sdpa_patched`, `ring_patched` and `flash_float_loss` are the patched copies as glues
(`PYTHONPATH=. ringcheck step --glue benchmarks.findings.ms_swift:sdpa_patched`, ...).
"""

from __future__ import annotations

import importlib
import sys

import torch

from benchmarks.findings.ms_swift_ring import patch_ring
from benchmarks.findings.ranks import run_ranks
from ringcheck.trainers.ms_swift import CORES, MsSwift, swift


def continued_positions(original):
    """`SequenceParallel.pad_and_split_inputs` whose shard of the position ids continues the count
    where ms-swift padded with -1 (finding 1's fix)."""
    def pad_and_split_inputs(self, *args, **kwargs):
        out = list(original(self, *args, **kwargs))
        pos = out[3]
        if pos is not None and bool((pos < 0).any()):
            last = pos.clamp(min=0).amax(-1, keepdim=True)
            out[3] = torch.where(pos < 0, last + (pos < 0).cumsum(-1), pos)
        return tuple(out)

    return pad_and_split_inputs


def window_pair(ring):
    """ms-swift's `zigzag_ring_flash_attn_varlen_func` given flash-attn's (w - 1, w - 1) where
    `local_flash_attn` hands it transformers' int `sliding_window` (finding 2's fix)."""
    def zigzag(*args, window_size=(-1, -1), **kwargs):
        if isinstance(window_size, int):
            window_size = (window_size - 1, window_size - 1)
        return ring(*args, window_size=window_size, **kwargs)

    return zigzag


def patch(carry_window: bool = True) -> callable:
    """The patched copies, in memory, on ms-swift's modules; returns the undo. `carry_window`: its
    ring's block kernels handed their rows' places and its backward mended (findings 2 and 4,
    `ms_swift_ring.patch_ring`); False: the window pair alone, which runs and loses the window."""
    found = swift()
    cls, module = found.cls, found.module
    originals = (cls.pad_and_split_inputs, module.zigzag_ring_flash_attn_varlen_func)
    cls.pad_and_split_inputs = continued_positions(originals[0])
    module.zigzag_ring_flash_attn_varlen_func = window_pair(originals[1])
    undo_blocks = patch_ring(importlib.import_module("swift.sequence_parallel.zigzag_ring_attn")) if carry_window \
        else (lambda: None)

    def undo():
        cls.pad_and_split_inputs, module.zigzag_ring_flash_attn_varlen_func = originals
        undo_blocks()

    return undo


class Patched(MsSwift):
    """ringcheck's ms-swift glue with `patch()` applied on the rank (undone by uninstall), and no
    crash said before the run (the patch is what is judged)."""

    def __init__(self, core: str = "sdpa", ring: bool = False, carry_window: bool = True):
        super().__init__(core, ring)
        self.dtype, self.carry_window = CORES[core][1], carry_window
        self.describe = (f"ms-swift 4.6.0's sequence parallelism over {core}{' (its ring)' if ring else ''}, patched"
                         f"{'' if carry_window else ' (the window pair alone)'}")
        self.undo_patch = None

    def install(self, group) -> str:
        self.undo_patch = patch(self.carry_window)
        return super().install(group)

    def known_crash(self, rows: int, n: int, world: int) -> None:
        return None

    def uninstall(self) -> None:
        super().uninstall()
        if self.undo_patch is not None:
            self.undo_patch()
            self.undo_patch = None


sdpa_patched = Patched("sdpa")
ring_patched = Patched("flash_attention_2", ring=True)
ring_pair_only = Patched("flash_attention_2", ring=True, carry_window=False)


class Shipped(MsSwift):
    """The glue with no crash said before the run: ms-swift's own code meets the case."""

    def known_crash(self, rows: int, n: int, world: int) -> None:
        return None


P = 2
CASES = {"1: llama over sdpa, 15 tokens": ("llama", "sdpa", False, 15),
         "2: mistral through its ring, 32 tokens (window 12)": ("mistral", "flash_attention_2", True, 32)}


def _copy(which: str, core: str, ring: bool) -> MsSwift:
    """The glue of one copy of ms-swift's code: "as shipped", "patched", or "pair only" (finding 2's
    window pair without its blocks' places)."""
    if which == "as shipped":
        return Shipped(core, ring)
    return Patched(core, ring, carry_window=which == "patched")


def _rank(rank: int, port: int, which: str, name: str, out) -> None:
    """One of P ranks: the case `name` of `CASES` through ms-swift (a copy of `_copy`), the logits
    gathered in global order; rank 0 compares them with the model's eager attention on one process."""
    from datetime import timedelta

    import torch.distributed as dist

    from ringcheck.models.tiny import tiny_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=30))
    group, result = dist.new_group(list(range(P))), {}
    for model_type, core, ring, n in (CASES[name],):
        tiny = tiny_model(model_type)
        glue = _copy(which, core, ring)
        attn = glue.install(group)
        glue.configure(tiny.config, group)
        dtype = torch.float64 if core == "sdpa" else torch.bfloat16
        ids = torch.randint(0, tiny.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(n)[None], "cu_seqlens": None}
        try:
            with torch.no_grad():
                logits, _, held = glue.run_loss(tiny.build(attn, dtype=dtype, seed=0), batch, torch.tensor(n), group)
            pieces = [None] * P
            dist.all_gather_object(pieces, (logits.double(), held))
            whole = torch.zeros(1, n, logits.shape[-1], dtype=torch.float64)
            for piece, at in pieces:
                keep = at < n
                whole[:, at[keep]] = piece[:, keep]
            words = None
        except Exception as exc:
            words = f"{type(exc).__name__}: {str(exc)[:160]}"
        finally:
            glue.uninstall()
        if rank == 0 and words is None:
            with torch.no_grad():
                truth = tiny.build("eager", dtype=torch.float64, seed=0)(input_ids=ids).logits
                floor = tiny.build("eager", dtype=dtype, seed=0)(input_ids=ids).logits.double()
            words = (f"logits relative error {float((whole - truth).norm() / truth.norm()):.1e} (the model in "
                     f"{dtype} on one process: {float((floor - truth).norm() / truth.norm()):.1e})")
        result[name] = f"rank {rank}: {words}"
    out.put(result)


def minimal() -> dict:
    """Both findings at P=2, as shipped and patched (the ring also with the window pair alone): what
    each rank got."""
    found = {}
    for name, (_, _, ring, _) in CASES.items():  # each case and copy on processes of its own: a crash breaks the group
        for which in ("as shipped", *(("pair only",) if ring else ()), "patched"):
            results = run_ranks(_rank, P, which, name, results=P, timeout=900)
            for words in sorted(r[name] for r in results):
                print(f"{which:10s} finding {name}: {words}", flush=True)
            found[(name, which)] = results
    return found


def confirm() -> None:
    """ringcheck step --model at P=4, as shipped and patched."""
    from ringcheck.commands.step_model import run_model_step
    from ringcheck.launch import open_ring
    from ringcheck.models.step import ModelStepConfig

    ring = open_ring(timeout=120)
    try:
        for model, glue, size in (("llama", "ms_swift", 4), ("llama", f"{__name__}:sdpa_patched", 4),
                                  ("mistral", "ms_swift_ring", 4), ("mistral", f"{__name__}:ring_patched", 4),
                                  ("qwen3_moe", "ms_swift_ring", 4), ("qwen3_moe", f"{__name__}:ring_patched", 4)):
            judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=size), ring)
            rows = {c["case"]: c["verdict"] for c in judged["cases"]}
            print(f"{model:9s} P={size} {glue:44s} {judged['verdict']:10s} {rows}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    {"minimal": minimal, "confirm": confirm}[(sys.argv[1:] or ["minimal"])[0]]()


class FloatLoss(MsSwift):
    """Finding 3's patched copy: `per_token_loss_func_sp` handed the logits in float32, as its non-SP
    `per_token_loss_func` casts them (swift/trainers/utils.py L203)."""

    dtype = "bfloat16"
    describe = "ms-swift 4.6.0's Ulysses over the flash core, patched: its SP loss over float32 logits"

    def install(self, group) -> str:
        name = super().install(group)
        shipped = self.swift.per_token_loss

        def per_token_loss(outputs, labels, **kwargs):
            return shipped(outputs.logits.float(), labels, **kwargs)

        self.swift.per_token_loss = per_token_loss
        return name


flash_float_loss = FloatLoss("flash_attention_2")
