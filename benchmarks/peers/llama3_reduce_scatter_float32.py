"""ring_flash_attn:llama3 float16 P=8 (validate --quick, causal, contiguous): as shipped, and with
its dk/dv reduce-scatter done in float32 (the patched copy: `dist.reduce_scatter_tensor` wrapped
to sum float32 copies and round the result once). llama3 reduce-scatters dk and dv in the input
dtype, so every partial sum is rounded: the precision class's backward row fails as shipped
and passes patched.

    python benchmarks/peers/llama3_reduce_scatter_float32.py      (from the repository root)
"""
import torch.distributed as dist
from patched_runs import as_shipped_and_patched

from ringcheck.cli.validate import QUICK_LENGTHS
from ringcheck.commands.validate import Target


def patch_task(member):
    original = dist.reduce_scatter_tensor

    def in_float32(output, input, *args, **kwargs):
        wide = output.float()
        work = original(wide, input.float(), *args, **kwargs)
        output.copy_(wide)
        return work

    dist.reduce_scatter_tensor = in_float32  # ring_flash_attn calls it through the module
    return "patched"


if __name__ == "__main__":
    target = Target(impl="ring_flash_attn:llama3", layout="contiguous", world_size=8, seq_len=256, dtype="float16",
                    causal=True, heads=4, kv_heads=2, head_dim=64, local_lengths=QUICK_LENGTHS,
                    flash_attn_stand_in=True)
    as_shipped_and_patched(8, target, patch_task, keep=lambda r: r.check.startswith("precision") or r.status == "fail")
