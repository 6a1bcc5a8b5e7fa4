"""yunchang:usp bf16 P=4, outlier: as shipped, and with the ring's block gradients kept in float32
(a patched copy of yunchang.ring.ring_flash_attn.ring_flash_attn_backward)."""
import inspect

from patched_runs import as_shipped_and_patched

from ringcheck.commands.validate import Target


def patch_task(member):
    from ringcheck.flash_stand_in import install  # in the ring worker, before yunchang is imported there
    install()
    import yunchang.ring.ring_flash_attn as m  # the module whose function the patched copy replaces
    src = inspect.getsource(m.ring_flash_attn_backward)
    for t in ("dq", "dk", "dv"):
        src = src.replace(f"dtype={t[1]}.dtype", "dtype=torch.float32", 1)
        src = src.replace(f"block_{t}_buffer.to(torch.float32)", f"block_{t}_buffer.clone()")
    if src.count("torch.float32") < 3:
        raise RuntimeError("the block buffers were not found in this yunchang version")
    ns = {}
    exec(compile(src, "<patched copy>", "exec"), m.__dict__, ns)
    m.ring_flash_attn_backward = ns["ring_flash_attn_backward"]
    return "patched"

if __name__ == "__main__":
    target = Target(impl="yunchang:usp", layout="contiguous", world_size=4, seq_len=256, dtype="bfloat16",
                    local_lengths=(2,), distributions=("outlier",), flash_attn_stand_in=True, seed=6)
    as_shipped_and_patched(4, target, patch_task, keep=lambda r: bool(r.tensors))
