"""yunchang's basic ring (yunchang:ring:basic, and yunchang:usp at P=4) in float16: validate --quick as
shipped and with a patched copy of yunchang.ring.ring_flash_attn.ring_flash_attn_backward whose last
line returns dq.to(q.dtype) instead of dq.to(torch.bfloat16)."""
import inspect

from ringcheck.commands.validate import Target, validate
from ringcheck.launch import LocalRings


def patch_task(member):
    from ringcheck.flash_stand_in import install  # in the ring worker, before yunchang is imported there
    install()
    import yunchang.ring.ring_flash_attn as m  # the module whose function the patched copy replaces
    src = inspect.getsource(m.ring_flash_attn_backward)
    if "dq.to(torch.bfloat16)" not in src:
        raise RuntimeError("the suspect line is not in this yunchang version")
    ns = {}
    exec(compile(src.replace("dq.to(torch.bfloat16)", "dq.to(q.dtype)"), "<patched copy>", "exec"), m.__dict__, ns)
    m.ring_flash_attn_backward = ns["ring_flash_attn_backward"]
    return "patched"

if __name__ == "__main__":
    for impl, p in (("yunchang:ring:basic", 2), ("yunchang:usp", 4)):
        target = Target(impl=impl, layout="contiguous", world_size=p, seq_len=256, dtype="float16",
                        local_lengths=(2, 6), flash_attn_stand_in=True)
        for label, setup in (("as shipped", None), ("patched", patch_task)):
            with LocalRings(timeout=120, setup=setup) as rings:  # every pool runs the patch first
                rows = validate(target, rings)
            bad = [r.check for r in rows if not r.passed]
            print(impl, f"P={p}", label, "PASSED" if not bad else f"FAILED: {bad}", flush=True)
