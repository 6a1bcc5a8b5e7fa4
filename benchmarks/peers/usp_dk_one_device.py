"""The failing case of yunchang:usp bf16 P=4 (outlier, 2 tokens per rank, seed 6) on ONE device:
flash-attn's arithmetic (the stand-in's flash_attn_func, no ring) judged by the same rule."""
import torch

from ringcheck.flash_stand_in import install

install()  # before flash_attn is imported: it must resolve to the stand-in
from flash_attn import flash_attn_func  # noqa: E402

from ringcheck.judge.check import Case, Results, judge_results, peer, truth  # noqa: E402
from ringcheck.judge.inputs import make_inputs  # noqa: E402
from ringcheck.spec import AttentionSpec, RingSpec  # noqa: E402

spec = AttentionSpec(batch=1, heads=4, kv_heads=2, seq_len=8, head_dim=64, dtype="bfloat16", causal=True)
case = Case(spec, RingSpec(4, "contiguous"), seed=6, distribution="outlier")
inputs = make_inputs(spec, seed=6, distribution="outlier", ring=case.ring)
q, k, v = (t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
out, lse, _ = flash_attn_func(q, k, v, softmax_scale=spec.scale, causal=True, return_attn_probs=True)
dq, dk, dv = torch.autograd.grad(out, (q, k, v), inputs.dout)
got = Results(out.detach(), lse, dq, dk, dv, None)
v_ = judge_results(case, got, truth(spec, inputs), peer(spec, inputs), inputs=inputs)
for t in v_.tensors:
    print(t.tensor, "passed" if t.passed else "FAILED", t.describe()[:220])
