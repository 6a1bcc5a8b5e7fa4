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

    python -m benchmarks.findings.ms_swift minimal   # ms-swift + transformers, P=2, cases 1, 2 and 5
    python -m benchmarks.findings.ms_swift confirm   # ringcheck step, as shipped and patched

3. **Its SP loss over bf16 logits**: `per_token_loss_func_sp` (`swift/trainers/utils.py` L167-183)
   takes the cross-entropy in the logits' dtype; its non-SP `per_token_loss_func` casts to float32.
   The patched copy (`flash_float_loss`) hands it float32 logits.
4. **Its ring's backward** (any model its ring runs): each block's backward gets the block's own
   output where flash-attn's D needs the final one, and the first block's lse is overwritten in place
   before its backward reads it; minimal script and patches: `benchmarks.findings.ms_swift_ring`.
5. **Its ring drops the attention logit softcap** (gemma2): `local_flash_attn`'s ring call
   (`sequence_parallel.py` L209-219) hands the ring no softcap and its blocks call flash-attn with
   softcap 0.0 (`zigzag_ring_attn.py` L125-126); its Ulysses path hands it on. The patched copy
   notes the layer's softcap at the attention call (`softcap_from`) and hands it to the blocks
   with the window (`Window`).
6. **A length P does not divide, on a model that looks a table up by position id** (bert and its
   kin, any core): the -1 its pad gives the position ids (L598) is read as an index by the model's
   embeddings (bert's `token_type_ids` buffer gathered by position id, `modeling_bert.py` L93; its
   learned positions, L99): on the last rank `index -1 is out of bounds` before the first
   all-to-all, and the other ranks wait in it (`ulysses.py` L68) until the timeout, or, where the
   crashed rank goes on to its next all-to-all, gloo aborts them on the size. The patched copy is
   finding 1's (`continued_positions`); `flash_patched` is it over the flash core.

    python -m benchmarks.findings.ms_swift minimal 6   # case 6 alone

`sdpa_patched`, `flash_patched`, `ring_patched` and `flash_float_loss` are the patched copies as glues
(`PYTHONPATH=. ringcheck step --glue benchmarks.findings.ms_swift:sdpa_patched`, ...).
"""

from __future__ import annotations

import importlib
import sys

import torch

from benchmarks.findings.ms_swift_ring import Where, Window, patch_ring, softcap_from
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


def window_pair(ring, where: Where | None = None):
    """ms-swift's `zigzag_ring_flash_attn_varlen_func` given flash-attn's (w - 1, w - 1) where
    `local_flash_attn` hands it transformers' int `sliding_window` (finding 2's fix); with `where`,
    the layer's softcap along (finding 5's fix, `ms_swift_ring.Window`)."""
    def zigzag(*args, window_size=(-1, -1), **kwargs):
        if isinstance(window_size, int):
            window_size = (window_size - 1, window_size - 1)
        if where is not None:
            window_size = Window(window_size, where.softcap)
        return ring(*args, window_size=window_size, **kwargs)

    return zigzag


def patch(carry_window: bool = True, where: Where | None = None) -> callable:
    """The patched copies, in memory, on ms-swift's modules; returns the undo. `carry_window`: its
    ring's block kernels handed their rows' places, the layer's softcap (noted in `where`) and its
    backward mended (findings 2, 4 and 5, `ms_swift_ring.patch_ring`); False: the window pair alone,
    which runs and loses the window."""
    where = where or Where()
    found = swift()
    cls, module = found.cls, found.module
    originals = (cls.pad_and_split_inputs, module.zigzag_ring_flash_attn_varlen_func)
    cls.pad_and_split_inputs = continued_positions(originals[0])
    module.zigzag_ring_flash_attn_varlen_func = window_pair(originals[1], where if carry_window else None)
    undo_blocks = patch_ring(importlib.import_module("swift.sequence_parallel.zigzag_ring_attn"), where) \
        if carry_window else (lambda: None)

    def undo():
        cls.pad_and_split_inputs, module.zigzag_ring_flash_attn_varlen_func = originals
        undo_blocks()

    return undo


class Patched(MsSwift):
    """ringcheck's ms-swift glue with `patch()` applied on the rank (undone by uninstall), and no
    crash said before the run (the patch is what is judged)."""

    def __init__(self, core: str = "sdpa", ring: bool = False, carry_window: bool = True, carry_softcap: bool = True):
        super().__init__(core, ring)
        self.dtype, self.carry_window, self.carry_softcap = CORES[core][1], carry_window, carry_softcap
        self.describe = (f"ms-swift 4.6.0's sequence parallelism over {core}{' (its ring)' if ring else ''}, patched"
                         f"{'' if carry_window else ' (the window pair alone)'}")
        self.undo_patch, self.where = None, Where()

    def install(self, group) -> str:
        self.undo_patch = patch(self.carry_window, self.where)
        return super().install(group)

    def prepare(self, model) -> None:
        """The glue's `prepare`, then (its ring, patched) ms-swift's attention as registered made to
        note each layer's softcap for the ring (`softcap_from`)."""
        first = model not in self.prepared
        super().prepare(model)
        if first and self.ring and self.carry_window and self.carry_softcap:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # start-up time: a --model run only

            ALL_ATTENTION_FUNCTIONS[self.attn] = softcap_from(ALL_ATTENTION_FUNCTIONS[self.attn], self.where)

    def known_crash(self, rows: int, n: int, world: int) -> None:
        return None

    def lookup_crash(self, model, batch: dict) -> None:
        return None

    def uninstall(self) -> None:
        super().uninstall()
        if self.undo_patch is not None:
            self.undo_patch()
            self.undo_patch = None


sdpa_patched = Patched("sdpa")
flash_patched = Patched("flash_attention_2")  # finding 6: its Ulysses over flash, the position ids continued
ring_patched = Patched("flash_attention_2", ring=True)
ring_pair_only = Patched("flash_attention_2", ring=True, carry_window=False)


class Shipped(MsSwift):
    """The glue with no crash said before the run: ms-swift's own code meets the case."""

    def known_crash(self, rows: int, n: int, world: int) -> None:
        return None

    def lookup_crash(self, model, batch: dict) -> None:
        return None


P = 2
CASES = {"1: llama over sdpa, 15 tokens": ("llama", "sdpa", False, 15),
         "2: mistral through its ring, 32 tokens (window 12)": ("mistral", "flash_attention_2", True, 32),
         "5: gemma2 with 1 K/V head through its ring, 32 tokens (softcap 2)": ("gemma2", "flash_attention_2", True, 32),
         "6: bert over flash, 15 tokens": ("bert", "flash_attention_2", False, 15)}
# the config each case's tiny model is made from: gemma2 given a GQA ratio of 4, so that its tiny model has 1 K/V head
# (ms-swift's ring at P=2; the tiny gemma2 has 2, Ulysses at P=2)
CONFIG = {"gemma2": {"model_type": "gemma2", "num_attention_heads": 8, "num_key_value_heads": 2}}
HALFWAY = {"2": ("pair only",), "5": ("no softcap",)}  # the copies between shipped and patched a case also runs


def _copy(which: str, core: str, ring: bool) -> MsSwift:
    """The glue of one copy of ms-swift's code: "as shipped", "patched", "pair only" (finding 2's
    window pair without its blocks' places) or "no softcap" (patched but finding 5)."""
    if which == "as shipped":
        return Shipped(core, ring)
    return Patched(core, ring, carry_window=which != "pair only", carry_softcap=which != "no softcap")


def _tiny(model: str):
    """The tiny model of a case: its model_type's, or that of its `CONFIG` (a config.json written here)."""
    import json
    import tempfile

    from ringcheck.models.tiny import tiny_model

    if model not in CONFIG:
        return tiny_model(model)
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/config.json"
        with open(path, "w") as f:
            json.dump(CONFIG[model], f)
        return tiny_model(path)


def _rank(rank: int, port: int, which: str, name: str, out) -> None:
    """One of P ranks: the case `name` of `CASES` through ms-swift (a copy of `_copy`), the logits
    gathered in global order; rank 0 compares them with the model's eager attention on one process."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=30))
    group, result = dist.new_group(list(range(P))), {}
    for model_type, core, ring, n in (CASES[name],):
        tiny = _tiny(model_type)
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
            words = f"{type(exc).__name__}: {str(exc)[:260]}"
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


def minimal(only: str | None = None) -> dict:
    """The cases at P=2 (`only`: the one of that number), as shipped, through the copies between
    (`HALFWAY`) and patched: what each rank got."""
    found = {}
    for name in (n for n in CASES if only in (None, n.split(":")[0])):  # each case and copy on processes of its own
        for which in ("as shipped", *HALFWAY.get(name.split(":")[0], ()), "patched"):
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
                                  ("qwen3_moe", "ms_swift_ring", 4), ("qwen3_moe", f"{__name__}:ring_patched", 4),
                                  ("gemma2", "ms_swift_ring", 4), ("gemma2", f"{__name__}:ring_patched", 4)):
            judged = run_model_step(ModelStepConfig(model=model, glue=glue, world_size=size), ring)
            rows = {c["case"]: c["verdict"] for c in judged["cases"]}
            print(f"{model:9s} P={size} {glue:44s} {judged['verdict']:10s} {rows}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    {"minimal": minimal, "confirm": confirm}[(sys.argv[1:] or ["minimal"])[0]](*sys.argv[2:3])


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
