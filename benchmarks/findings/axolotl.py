"""axolotl-ringmaster 0.2.7 (axolotl 0.21's context parallelism) drops the attention logit softcap
and the attention sinks: the minimal script, the patched copy, and the planted bug its suite must
catch.

transformers hands a softcapped layer's attention (gemma2: `attn_logit_softcapping`) `softcap=` as a
keyword, and a layer with sinks (gpt_oss) `s_aux=`. ringmaster's three forwards take both into
`**kwargs` and never read them: the ring's
`ring_attention_forward` (`strategies/ring.py` L43-170), USP's `usp_attention_forward`
(`strategies/usp.py` L101-164) and the Ulysses packed/windowed path `_ulysses_varlen`
(`strategies/ulysses.py` L49-97, called at L182); none of their block kernels
(`ring/kernels.py` L30-80, `ring/loop.py` L189) takes a softcap or sinks. Only the Ulysses dense
path hands `**kwargs` to the inner kernel (L204-214), and sdpa has neither. So every layer attends
with its logits uncapped and without its sinks, and nothing warns: transformers refuses gemma2 and
gpt_oss with sdpa (`_supports_sdpa = False`), but ringmaster registers a name of its own, which
transformers does not check.

The fix, patched in memory (`patch()`): the forwards hand the layer's softcap and sinks to their
kernels (here: the scores of every CPU kernel they reach, `math_block` and torch's sdpa, capped as
eager does, `tanh(s / cap) * cap` before the mask, and each head's sink logit joined to the softmax
and dropped after it; the sinks as the layer holds them, every head: the ring's case).

    python -m benchmarks.findings.axolotl minimal   # ringmaster + transformers only, P=2, float32
    python -m benchmarks.findings.axolotl confirm   # ringcheck step, as shipped and patched, P=4

`sdpa_patched` is the patched copy as a glue (`--glue benchmarks.findings.axolotl:sdpa_patched`);
`planted_local_positions` is `--glue axolotl` with a bug planted in its sharding (every rank's
`position_ids` restart at 0), which suites/test_trainer_axolotl.py must see fail, named.
"""

from __future__ import annotations

import contextvars
import math
import sys

import torch

from benchmarks.findings.ranks import confirm_line, run_ranks
from ringcheck.trainers.axolotl import CORES, Ringmaster

SEQ, P = 16, 2
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, sliding_window=64,
             initializer_range=0.5)  # scores well past the cap, sinks well away from 0: so that both show
CONFIGS = {  # the minimal script's models (1 K/V head: ringmaster picks the ring at P=2)
    "gemma2 (softcap 1.0)": ("Gemma2Config", dict(attn_logit_softcapping=1.0, final_logit_softcapping=None)),
    "gpt_oss (sinks)": ("GptOssConfig", dict(num_local_experts=2, num_experts_per_tok=1)),
}
SOFTCAP: contextvars.ContextVar = contextvars.ContextVar("softcap", default=None)  # the layer's, during its call
SINKS: contextvars.ContextVar = contextvars.ContextVar("sinks", default=None)      # its s_aux (one per query head)


def _capped_sdpa(sdpa):
    """torch's sdpa, with the scores capped (`tanh(s / cap) * cap`) while a softcapped layer runs."""
    def call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        cap, sinks = SOFTCAP.get(), SINKS.get()
        if not cap and sinks is None:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if k.shape[-3] != q.shape[-3]:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        s = torch.tanh(s / cap) * cap if cap else s
        if is_causal:
            attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        if sinks is None:
            return torch.softmax(s, dim=-1) @ v
        column = sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)  # as eager: a logit per head, no value
        return torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1] @ v
    return call


def patch():
    """ringmaster's attention forwards hand the layer's softcap to the kernels they reach (in memory);
    returns the undo."""
    import torch.nn.functional as F
    from ringmaster.ring import kernels
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa, math_block = F.scaled_dot_product_attention, kernels.math_block

    def capped_block(q, k, v, *, causal, scaling, dropout=0.0, attn_implementation=None, window=None):
        # math_block's explicit scores are torch's sdpa's here: capped (and sunk) where the layer is
        qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
        sq, sk = qt.shape[-2], kt.shape[-2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
        if window is not None:
            iq = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            ik = torch.arange(sk, device=q.device)[None]
            inside = iq - ik <= window[0]
            mask = inside if mask is None else mask & inside
        out = _capped_sdpa(sdpa)(qt, kt, vt, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).to(q.dtype), None

    wrapped = {}
    for name in ("ringmaster_ring", "ringmaster_usp", "ringmaster_ulysses"):
        fn = ALL_ATTENTION_FUNCTIONS.get(name)
        if fn is not None:
            def forward(*args, _fn=fn, **kwargs):
                tokens = SOFTCAP.set(kwargs.get("softcap")), SINKS.set(kwargs.get("s_aux"))
                try:  # the ring (1 Ulysses rank) holds every head: the sinks as the layer has them
                    return _fn(*args, **kwargs)
                finally:
                    SOFTCAP.reset(tokens[0])
                    SINKS.reset(tokens[1])
            wrapped[name] = fn
            ALL_ATTENTION_FUNCTIONS[name] = forward
    F.scaled_dot_product_attention = _capped_sdpa(sdpa)
    kernels.PROVIDERS["math"] = kernels.math_block = capped_block
    if kernels.PROVIDERS["torch_native"] is math_block:
        kernels.PROVIDERS["torch_native"] = capped_block

    def undo() -> None:
        F.scaled_dot_product_attention, kernels.math_block = sdpa, math_block
        kernels.PROVIDERS["math"] = math_block
        if kernels.PROVIDERS["torch_native"] is capped_block:
            kernels.PROVIDERS["torch_native"] = math_block
        ALL_ATTENTION_FUNCTIONS.update(wrapped)

    return undo


class PatchedRingmaster(Ringmaster):
    """`--glue axolotl` with `patch()` applied once ringmaster.setup has registered its forward."""

    def configure(self, config, group) -> None:
        super().configure(config, group)
        self.undo.append(patch())
        from transformers import AttentionInterface  # transformers: the optional extra `hf`
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        AttentionInterface.register("ringmaster_cp", ALL_ATTENTION_FUNCTIONS[self.runtime.attn_implementation])


class _Glue:
    """A `PKG.MOD:OBJ` glue over an adapter (`Ringmaster` or a subclass)."""

    layout = "contiguous"
    dtype = CORES["sdpa"][1]

    def __init__(self, adapter: Ringmaster, describe: str):
        self.adapter, self.describe = adapter, describe
        self.install, self.configure, self.uninstall = adapter.install, adapter.configure, adapter.uninstall

    def shard(self, batch: dict, group) -> dict:
        return self.adapter.shard(batch, group)


class PlantedLocalPositions(_Glue):
    """`--glue axolotl` whose shard hands every rank `position_ids` restarting at 0 (the bug)."""

    def shard(self, batch: dict, group) -> dict:
        out = self.adapter.shard(batch, group)
        pos = out["position_ids"]
        local = torch.arange(pos.shape[1], dtype=pos.dtype, device=pos.device).expand_as(pos)
        return {**out, "position_ids": local}


sdpa_patched = _Glue(PatchedRingmaster("sdpa"), "axolotl-ringmaster over sdpa, the softcap handed to its kernels "
                                                "(patched copy, benchmarks/findings/axolotl.py)")
planted_local_positions = PlantedLocalPositions(Ringmaster("sdpa"), "axolotl-ringmaster over sdpa with rotary "
                                                                    "positions local to each shard (a planted bug)")


def _model(name: str, attn: str):
    import transformers
    cls, options = CONFIGS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**SMALL, **options)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                         dtype=torch.float32).eval()


def _rank(rank: int, port: int, patched: bool, out) -> None:
    """One of P ranks: ringmaster.setup as axolotl calls it over sdpa, shard_batch's slice."""
    import ringmaster
    import torch.distributed as dist
    from ringmaster.ring import kernels
    from ringmaster.shard import shard_batch
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    kernels.PROVIDERS["torch_native"] = kernels.math_block  # the one CPU shim: aten's flash op is CUDA's
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("cp",))
    runtime = ringmaster.setup(ringmaster.RingmasterConfig(size=P), num_kv_heads=SMALL["num_key_value_heads"],
                               device_mesh=mesh, device_type="cpu", inner_attn="sdpa")
    undo = patch() if patched else None
    ids = torch.randint(0, SMALL["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    result = {}
    for name in CONFIGS:
        model = _model(name, "eager")
        model.set_attn_implementation(runtime.attn_implementation)
        batch, _ = shard_batch({"input_ids": ids.clone()}, cp_rank=rank, cp_size=P)
        with torch.no_grad():
            mine = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        pieces = [torch.empty_like(mine) for _ in range(P)]
        dist.all_gather(pieces, mine)
        if rank == 0:
            with torch.no_grad():
                truth = _model(name, "eager")(input_ids=ids).logits
            whole = torch.cat(pieces, dim=1)
            result[name] = float((whole - truth).norm() / truth.norm())
    if undo:
        undo()
    if rank == 0:
        out.put((runtime.config.backend.value, result))
    dist.destroy_process_group()


def minimal() -> dict:
    """ringmaster over sdpa at P=2 (1 K/V head: the ring) on gemma2 (softcap 1) and gpt_oss (sinks),
    against eager on one process, as shipped and patched: the relative error of the logits (float32)."""
    found = {}
    for patched in (False, True):
        [(backend, result)] = run_ranks(_rank, P, patched)
        for name, err in result.items():
            print(f"{'patched' if patched else 'as shipped':10s} {name:22s} ringmaster {backend}, P={P}: logits "
                  f"relative error {err:.1e}", flush=True)
        found["patched" if patched else "shipped"] = result
    return found


def confirm() -> None:
    """ringcheck step --model gemma2 at P=4 (USP), as shipped and through the patched copy."""
    from ringcheck.launch import open_ring

    ring = open_ring(timeout=120)
    try:
        for glue in ("axolotl", "benchmarks.findings.axolotl:sdpa_patched"):
            print(f"gemma2 {glue:44s} {confirm_line(ring, 'gemma2', glue)}", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    {"minimal": minimal, "confirm": confirm}[(sys.argv[1:] or ["minimal"])[0]]()
