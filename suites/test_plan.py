"""`ringcheck plan`: its arithmetic against figures computed here by hand and published ones, the
ring's block table against the ring's own planner, the seeds' configurations, and the command's
exit codes and one-line errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ringcheck.cli import main
from ringcheck.documents import PLAN_SCHEMA, load
from ringcheck.plan import KNOWN, ModelShape, Settings, Shape, call_peak, plan_document, saved_bytes, step_blocks
from ringcheck.plan.memory import activations, breakdown, model_state, smallest_cp
from ringcheck.plan.ring import hiding_length
from ringcheck.plan.timing import ring_steps
from ringcheck.ring.layouts import block_plan

GIB = 2 ** 30
LLAMA_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672",
             "--vocab", "128256"]
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--seq-len", "4096"]


def settings(model: str = "llama-3.1-70b", **kw) -> Settings:
    return Settings(model=ModelShape.llama(model), **{"seq_len": 131072, "cp": 8, **kw})


# --- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "published"), [
    ("llama-2-70b", 68_976_648_192),    # Meta's model card / the checkpoint's parameter count
    ("llama-3.1-70b", 70_553_706_496),
    ("llama-3.1-8b", 8_030_261_248),
    ("tinyllama-1.1b", 1_100_048_384),
])
def test_parameter_counts_are_the_published_ones(name, published):
    assert ModelShape.llama(name).parameters() == published


def test_a_model_shape_that_cannot_exist_is_refused_by_name():
    with pytest.raises(ValueError, match="--heads 64 is not a multiple of --kv-heads 7"):
        ModelShape(80, 8192, 64, 7, 128, 28672, 32000)
    with pytest.raises(ValueError, match="--layers must be a whole number >= 1, got 0"):
        ModelShape(0, 8192, 64, 8, 128, 28672, 32000)


# --- the ring: blocks, memory, hiding -------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_block_table_is_the_rings_own(layout, causal, world):
    """Per step, the set of block shapes and work over the ranks equals what the ring's planner
    gives (`ringcheck.ring.layouts.block_plan`), so the plan times and sizes the blocks the ring runs."""
    n = 8
    table = step_blocks(layout, causal, world, n)
    for step in range(world):
        planned = set()
        for rank in range(world):
            blocks = block_plan(layout=layout, q_rank=rank, kv_rank=(rank - step) % world, world_size=world,
                                local_len=n, causal=causal)
            rows = [(b.q.stop - b.q.start, b.kv.stop - b.kv.start, b.mask) for b in blocks]
            planned.add(sum(q * k * (0.5 if m == "causal" else 1.0) for q, k, m in rows))
        assert planned == {b.pairs() for b in table[step]}, (layout, causal, world, step)


def test_the_rings_memory_by_hand():
    """P = 4 zigzag, MHA, float32, n = 256 tokens of 4 heads x 64 on this GPU: the backward's
    steady step holds the float32 output, lse, delta, dq (kept); three K/V blocks; three dK/dV
    pairs (with their 16-byte tags); and the CPU kernel's copies for the larger of the two zigzag
    blocks (all n queries against the first n/2 keys, with four row statistics of n rows)."""
    shape = Shape(batch=1, n=256, heads=4, kv_heads=4, head_dim=64, e=4)
    q = 256 * 4 * 64 * 4              # one (n, heads, dim) float32 tensor: 262,144 bytes
    rows = 256 * 4 * 4
    assert saved_bytes(shape) == 3 * q + q + rows  # q, k, v, float32 out, lse
    peak = call_peak(shape, layout="zigzag", causal=True, world_size=4, kernel="torch-cpu")
    kernel = 4 * q + 4 * (q // 2) + 4 * rows  # dout, q, out*, dq of 256 rows; k, v, dk, dv of 128
    want = (2 * q + 2 * rows) + 3 * (2 * q) + 3 * (2 * q + 16) + kernel
    assert (peak["pass"], peak["step"], peak["bytes"]) == (1, 1, want)


def test_the_hiding_length_is_the_ring_attention_papers_condition():
    """Multi-head, non-causal, bf16, forward: a step hides its transfer from n >= F / B tokens per
    GPU (Liu et al. 2023, section 3); a balanced causal ring computes half a block per step and
    needs twice that; 8 query heads per K/V head send an eighth of the bytes."""
    f, b = 989.4e12, 450e9
    mha = Shape(batch=1, n=1, heads=64, kv_heads=64, head_dim=128, e=2)
    assert hiding_length(mha, work=1.0, backward=False, flops_per_s=f, bytes_per_s=b) == pytest.approx(f / b)
    assert hiding_length(mha, work=0.5, backward=False, flops_per_s=f, bytes_per_s=b) == pytest.approx(2 * f / b)
    gqa = Shape(batch=1, n=1, heads=64, kv_heads=8, head_dim=128, e=2)
    assert hiding_length(gqa, work=0.5, backward=False, flops_per_s=f, bytes_per_s=b) == pytest.approx(f / b / 4)
    # the backward sends K/V (bf16) and the float32 dK/dV: 3x the bytes for 2.5x the work
    assert hiding_length(gqa, work=0.5, backward=True, flops_per_s=f, bytes_per_s=b) == pytest.approx(
        f / b / 4 * 3 / 2.5)


def test_a_step_is_hidden_exactly_when_its_tokens_reach_the_hiding_length():
    below = ring_steps(settings(seq_len=8 * 4096, link="ib-ndr"), 8)["passes"]["forward"]
    above = ring_steps(settings(seq_len=8 * 8192, link="ib-ndr"), 8)["passes"]["forward"]
    assert below["hiding_tokens"] == pytest.approx(above["hiding_tokens"]) == pytest.approx(989.4e12 / 50e9 / 4)
    assert not below["steady"]["hidden"] and below["exposed_s"] > 0
    assert above["steady"]["hidden"] and above["exposed_s"] == 0


# --- memory per GPU -------------------------------------------------------------------------------

def test_model_state_follows_the_zero_papers_sixteen_bytes_and_shards_by_stage():
    params = ModelShape.llama("llama-3.1-70b").parameters()
    state = model_state(settings(), 8)
    assert (state["weights"], state["gradients"], state["optimizer"]) == (2 * params, 2 * params, 12 * params)
    assert model_state(settings(zero=1, dp=2), 8)["optimizer"] == math.ceil(12 * params / 16)
    assert model_state(settings(zero=2, dp=2), 8)["gradients"] == math.ceil(2 * params / 16)
    layer = ModelShape.llama("llama-3.1-70b").layer_parameters()
    assert model_state(settings(zero=3, dp=2), 8)["weights"] == math.ceil(2 * params / 16) + 2 * 2 * layer
    assert model_state(settings(optimizer="adam", dtype="fp32"), 8)["optimizer"] == 8 * params
    assert model_state(settings(optimizer="sgd"), 8)["optimizer"] == 0


def test_checkpointing_keeps_layer_inputs_and_recomputes_one_segment():
    none, full, two = (activations(settings(checkpointing=c), 8) for c in ("none", "full", "every-2"))
    layer = none["attention_per_layer"] + none["rest_per_layer"]
    assert none["kept"] == 80 * layer and none["recompute"] == 0
    assert full["kept"] == 80 * full["layer_input"] == 80 * 16384 * 8192 * 2  # 20 GiB: the boundary activations
    assert full["recompute"] == layer - full["layer_input"]
    assert two["kept"] == 40 * two["layer_input"] and two["recompute"] == 2 * layer - two["layer_input"]
    with pytest.raises(ValueError, match="every-K"):
        settings(checkpointing="every-0")


def test_the_smallest_ring_is_the_first_that_fits():
    s = settings(zero=3, checkpointing="full")
    found = smallest_cp(s)
    assert found["cp"] == 32 and breakdown(s, 32)["fits"] and not breakdown(s, 16)["fits"]
    replicated = smallest_cp(settings())  # 16 bytes x 70.55B parameters on every GPU: no ring helps
    assert replicated["cp"] is None and "--zero" in replicated["why"]


# --- the seeds' configurations (docs/reference/plan.md, "The seeds' arithmetic") -------------------

def test_seed_000_512k_tokens_on_four_rtx_3090s():
    """512K tokens on 4 x RTX 3090 (24 GiB), checkpointing every 2 layers. The post's "O(N^2/P)
    memory per GPU" would be a score matrix of N^2/P entries: 128 GiB per head per layer in bf16;
    the ring keeps O(N/P) per layer. What does not fit is the loss: 131,072 tokens' logits over a
    32,000 vocabulary (bf16, float32 log-softmax and gradient: 10 bytes) take 39.06 GiB per GPU."""
    small = ModelShape(12, 768, 12, 12, 64, 2048, 32000)
    s = Settings(model=small, seq_len=524288, cp=4, checkpointing="every-2", device="rtx3090")
    assert 524288 ** 2 / 4 * 2 / GIB == 128.0
    acts = activations(s, 4)
    assert acts["attention_per_layer"] == 131072 * (12 + 24) * 64 * 2 + 131072 * 768 * 4 + 131072 * 12 * 4
    assert acts["loss"] == 131072 * 32000 * 10 and round(acts["loss"] / GIB, 2) == 39.06
    assert not breakdown(s, 4)["fits"]
    chunked = Settings(model=small, seq_len=524288, cp=4, checkpointing="every-2", device="rtx3090", loss_chunk=4096)
    assert breakdown(chunked, 4)["fits"] and round(breakdown(chunked, 4)["total"] / GIB, 1) == 16.9
    tiny = Settings(model=ModelShape.llama("tinyllama-1.1b"), seq_len=524288, cp=4, checkpointing="every-2",
                    device="rtx3090", loss_chunk=4096)
    assert not breakdown(tiny, 4)["fits"]  # its replicated Adam state alone is 16.4 GiB of the 22 usable
    # the ring's transfer is 0.4% of a step's compute over PCIe 4: no 4x slowdown comes from its bytes
    forward = ring_steps(s, 4)["passes"]["forward"]["steady"]
    assert forward["hidden"] and forward["comm_s"] / forward["compute_s"] < 0.05


def test_seed_001_128k_tokens_at_80_layers():
    """Llama 3.1 70B (80 layers) at 131,072 tokens on H100s: 16 bytes per parameter replicated is
    1,051 GiB, so no ring fits without sharding; with ZeRO 3 and full checkpointing the smallest
    ring is 32 GPUs; there (4,096 tokens per GPU) NVLink hides every step, InfiniBand NDR does not
    (it needs 4,947 tokens per GPU forward, 5,936 backward)."""
    assert round(sum(model_state(settings(), 8).values()) / GIB, 1) == 1051.3
    s = settings(zero=3, checkpointing="full", loss_chunk=4096)
    assert smallest_cp(s)["cp"] == 32 and round(breakdown(s, 32)["total"] / GIB, 1) == 45.9
    nvlink = ring_steps(s, 32)["passes"]
    ib = ring_steps(settings(zero=3, checkpointing="full", link="ib-ndr"), 32)["passes"]
    assert nvlink["forward"]["steady"]["hidden"] and nvlink["backward"]["steady"]["hidden"]
    assert not ib["forward"]["steady"]["hidden"] and not ib["backward"]["steady"]["hidden"]
    assert round(ib["forward"]["hiding_tokens"]) == 4947 and round(ib["backward"]["hiding_tokens"]) == 5936


# --- the command ----------------------------------------------------------------------------------

def test_the_command_exits_0_when_it_fits_and_1_when_not(capsys, tmp_path):
    assert main(["plan", *SMALL, "--cp", "2", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "per GPU" in out and "hidden from" in out
    doc = load(tmp_path / "p.json", schema=PLAN_SCHEMA)
    assert doc["verdict"] == "fits" and doc["settings"]["cp"] == 2 and doc["meta"]["command"].endswith("p.json")
    assert main(["plan", *LLAMA_70B, "--seq-len", "131072", "--cp", "8", "--report", str(tmp_path / "r")]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["fits"] is False
    assert "does not fit" in (tmp_path / "r" / "plan.md").read_text()


@pytest.mark.parametrize(("argv", "says"), [
    (["--layers", "2"], "--hidden is required"),
    ([*SMALL, "--cp", "two"], "--cp 'two': expected a whole number"),
    ([*SMALL, "--cp", "3"], "--seq-len 4096 is not divisible by 2 x --cp 3"),
    ([*SMALL, "--cp", "0"], "--cp must be a whole number >= 1, got 0"),
    ([*SMALL, "--cp", "2", "--checkpointing", "sometimes"], "--checkpointing 'sometimes': choose none, full"),
    ([*SMALL, "--cp", "2", "--device", "tpu-v4"], "--device 'tpu-v4' is not a preset"),
    ([*SMALL, "--cp", "2", "--device", "rtx4090", "--link", "nvlink"], "the rtx4090 has no NVLink"),
    ([*SMALL, "--cp", "2", "--zero", "4"], "--zero 4: choose 0"),
    ([*SMALL, "--cp", "2", "--dtype", "int8"], "--dtype 'int8'"),
    ([*SMALL, "--cp", "2", "--link-efficiency", "1.5"], "at most 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("ringcheck plan: error: "), captured.err
    assert captured.out == ""


def test_the_document_says_its_conventions_and_sources():
    doc = plan_document(settings(zero=3, checkpointing="every-2", device="a100-80g", link="nvlink"))
    assert doc["hardware"]["link"] == "nvlink3" and "A100" in doc["hardware"]["device_source"]
    words = " ".join(doc["conventions"])
    assert "float32 master copy and two float32 moments" in words and "segment of 2" in words
    assert sorted(KNOWN) == ["llama-2-70b", "llama-3.1-70b", "llama-3.1-8b", "tinyllama-1.1b"]


@pytest.mark.cli
def test_the_command_as_a_process_exits_by_its_verdict_with_one_line_errors(tmp_path):
    """As a user starts it: a plan that does not fit exits 1 with its table; bad flags exit 2
    with one line on stderr and no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "ringcheck", "plan", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    done = run(*LLAMA_70B, "--seq-len", "131072", "--cp", "8")
    assert done.returncode == 1 and "DOES NOT FIT" in done.stdout and not done.stderr, done.stdout + done.stderr
    for argv in ([*SMALL, "--cp", "3"], [*SMALL, "--cp", "2", "--link", "warp-drive"], ["--layers", "2"]):
        bad = run(*argv)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert bad.stderr.startswith("ringcheck plan: error: ") and "Traceback" not in bad.stderr
