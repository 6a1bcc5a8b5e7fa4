"""`ringcheck train`: the model, the data, the loss normalisation, the verdict rule, the report,
and the command end to end at CI size (a correct ring passes, planted backward bugs fail, bad
settings and broken implementations get no verdict).

The runs here are tiny (one layer, 32 tokens, a few steps, P=2): they check that each part
does what it says. The sweep that measures false alarms and what the mutants do at the
default size is a benchmark (benchmarks/train_sweep.py, reports/train/), not a test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch

from ringcheck.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from ringcheck.commands.train import report_dict, run_train
from ringcheck.documents import TRAIN_SCHEMA, load
from ringcheck.render.train_report import train_html, train_markdown
from ringcheck.ring.layouts import positions
from ringcheck.train import TrainConfig, judge
from ringcheck.train.attention import single_device
from ringcheck.train.data import counted_tokens, gap, make_batch, rank_part
from ringcheck.train.model import init_parameters, loss_of

CI = dict(world_size=2, steps=4, seq_len=32, layers=1, batch=2)
CI_FLAGS = ["--world-size", "2", "--steps", "4", "--seq-len", "32", "--layers", "1", "--batch", "2", "-q"]
MUTANTS = "ringcheck.catalogue.mutants"
EMBEDDED = "ringcheck.catalogue.embedded_mutants"


def _fits(processes, config: TrainConfig) -> bool:
    return processes.size is None or processes.size == config.mesh_spec.size


def _run(processes, **settings):
    config = TrainConfig(**{**CI, **settings})
    if not _fits(processes, config):
        pytest.skip(f"the torchrun world has {processes.size} ranks, the mesh {config.mesh_spec.size}")
    return config, run_train(config, processes)


# ---- settings -----------------------------------------------------------------------------------

def test_the_shape_flags_override_the_preset():
    config = TrainConfig(model="tiny", heads=6, kv_heads=6, head_dim=8)
    assert (config.layers, config.heads, config.kv_heads, config.head_dim, config.d_model) == (2, 6, 6, 8, 48)
    assert TrainConfig(model="small").seq_len == 1024


@pytest.mark.parametrize("settings, words", [
    (dict(head_dim=15), "--head-dim 15 is odd"),
    (dict(heads=4, kv_heads=3), "not a multiple of --kv-heads 3"),
    (dict(model="huge"), "'huge' is unknown"),
    (dict(steps=0), "--steps must be >= 1"),
    (dict(mesh="dp=2,cp=3"), "cp=3 but --world-size is 4"),
    (dict(seq_len=100), "seq_len=100 is not divisible"),
])
def test_bad_settings_name_the_value_and_the_fix(settings, words):
    with pytest.raises((ValueError, TypeError)) as info:
        TrainConfig(**settings)
    assert words in str(info.value)


# ---- the data -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_every_answer_sits_on_another_rank(layout, p):
    """The target of counted query j is the token at j - gap: held by another rank."""
    config = TrainConfig(layout=layout, world_size=p, seq_len=64)
    owner = torch.empty(64, dtype=torch.long)
    for r in range(p):
        owner[positions(layout=layout, rank=r, world_size=p, seq_len=64)] = r
    batch = make_batch(config, step=0, sequences=1)
    counted = batch.counted[0].nonzero().flatten()
    source = counted - gap(64, layout)
    assert len(counted) > 0 and bool((owner[counted] != owner[source]).all())
    assert torch.equal(batch.labels[0, counted], batch.tokens[0, source])  # the target is that token


def test_documents_restart_positions_and_padding_is_never_counted():
    config = TrainConfig(seq_len=64, documents="20,28", pad=16)
    batch = make_batch(config, step=3, sequences=2)
    assert batch.rope[:20].tolist() == list(range(20)) and batch.rope[20:48].tolist() == list(range(28))
    assert not bool(batch.counted[:, 47:].any())  # a document's last token and the padding have no target
    assert bool((batch.tokens[:, 48:] == 0).all())
    assert counted_tokens(config, rings=2) == 2 * int(batch.counted.sum())


def test_no_counted_target_is_refused_before_any_rank_starts(capsys):
    assert main(["train", *CI_FLAGS, "--documents", "3,3,3,3,3,3,3,3,3,3", "--pad", "2"]) == EXIT_USAGE
    assert "nothing could be judged" in capsys.readouterr().err


# ---- the loss normalisation ---------------------------------------------------------------------

def _unsharded(config: TrainConfig):
    """Attention of the ranks' pieces as the ring delivers it: the pieces put back in sequence
    order, float64 attention on the whole, each rank's rows handed back."""
    p = config.world_size
    where = torch.cat([positions(layout=config.layout, rank=r, world_size=p, seq_len=config.seq_len,
                                 cu_seqlens=config.cu_seqlens) for r in range(p)])
    order = torch.argsort(where)
    exact = single_device(config, "exact")

    def attend(qs, ks, vs, sinks):
        whole = [torch.cat(x, 1)[:, order] for x in (qs, ks, vs)]
        return list(exact(*([w] for w in whole), sinks)[0][:, where].split(config.seq_len // p, 1))
    return attend


def test_the_ranks_losses_add_up_to_the_global_mean_and_a_per_rank_mean_would_not():
    """Each rank divides its counted tokens' loss by the *global* count: summed over the ranks
    (as the gradient all-reduce sums them) that is the single process's mean, gradients
    included; each rank's own mean, averaged over ranks (the classic slip), is not, when the
    ranks count different numbers of targets (documents and padding)."""
    config = TrainConfig(dtype="float32", world_size=4, seq_len=64, layers=1, documents="40,10", pad=14)
    batch = make_batch(config, step=0, sequences=config.batch)
    parts = [rank_part(config, batch, rank=r, group_index=0) for r in range(4)]
    count = counted_tokens(config, rings=1)
    params = {n: t.requires_grad_() for n, t in init_parameters(config).items()}
    whole = loss_of(params, [batch], single_device(config, "exact"), config, count, "cpu")
    attend = _unsharded(config)

    def rank_sum(r):  # rank r's counted tokens' loss (the others' tokens still attended to)
        only = [dataclasses.replace(x, counted=x.counted & (i == r)) for i, x in enumerate(parts)]
        return loss_of(params, only, attend, config, 1, "cpu")

    sums = [rank_sum(r) for r in range(4)]
    counts = [int(x.counted.sum()) for x in parts]
    assert len(set(counts)) > 1 and 0 in counts  # a rank with nothing to count, too
    global_mean = sum(sums) / count
    per_rank = sum(s / c for s, c in zip(sums, counts) if c) / sum(1 for c in counts if c)
    assert abs(global_mean.item() - whole.item()) <= 1e-6 * whole.item()
    grads = [torch.autograd.grad(x, list(params.values()), retain_graph=True) for x in (whole, global_mean, per_rank)]
    flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
    assert (flat[1] - flat[0]).norm() <= 1e-5 * flat[0].norm()  # float32 rounding only
    assert (flat[2] - flat[0]).norm() > 0.1 * flat[0].norm()    # the tokens weighted by their rank's count


# ---- the verdict --------------------------------------------------------------------------------

def _fake(grads: dict, losses: list[float]) -> dict:
    return {"grads": grads, "losses": losses, "grad_norms": [1.0] * len(losses), "seconds": 0.0}


def _runs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref = {"w": 0.01 * torch.randn(64, generator=gen), "b": 0.01 * torch.randn(8, generator=gen)}  # gradients' sizes
    losses = [4.0 - 0.1 * t for t in range(6)]

    def near(scale):
        grads = {n: g + scale * g.norm() / g.numel() ** 0.5 * torch.randn(g.shape, generator=gen)
                 for n, g in ref.items()}
        return _fake(grads, [x + scale * float(torch.randn((), generator=gen)) for x in losses])
    return _fake(ref, losses), {"a": near(1e-3), "b": near(1e-3)}, near


def test_a_ring_within_the_noise_floor_passes_and_one_outside_fails_where_it_is():
    ref, noise, near = _runs()
    ok = judge("float32", near(3e-4), ref, noise)  # a third of the noise runs' spread
    assert ok["verdict"] == "pass", ok["why"]
    bad = near(3e-4)
    bad["grads"]["b"] = bad["grads"]["b"] * 1.2  # one parameter's gradient 20% off
    bad["losses"][3] += 0.05                     # the loss leaves the band at step 3
    judged = judge("float32", bad, ref, noise)
    assert judged["verdict"] == "fail"
    assert judged["summary"]["grads_out"] == ["b"] and judged["summary"]["left_band_at"] == 3
    assert judged["summary"]["te_style"]["passed"]  # 5% loss / 0.05 gradient let it through


def test_the_floor_is_the_dtypes_rounding_when_the_noise_runs_agree_bit_for_bit():
    ref, _, near = _runs()
    same = {"a": _fake(dict(ref["grads"]), list(ref["losses"]))}
    ring = _fake(near(1e-3)["grads"], list(ref["losses"]))  # 1e-3: within bfloat16's rounding (u = 2^-8), not float32's
    assert judge("bfloat16", ring, ref, same)["verdict"] == "pass"
    assert judge("float32", ring, ref, same)["verdict"] == "fail"


def test_no_verdict_when_the_single_device_runs_themselves_diverge():
    ref, noise, near = _runs()
    noise["a"]["losses"][2] = math.nan
    assert judge("float32", near(3e-4), ref, noise)["verdict"] == "no verdict"


def test_a_ring_that_returns_nan_fails():
    ref, noise, near = _runs()
    ring = near(3e-4)
    ring["grads"]["w"][0] = math.nan
    ring["losses"][1] = math.nan
    judged = judge("float32", ring, ref, noise)
    assert judged["verdict"] == "fail" and "w" in judged["summary"]["grads_out"]


# ---- end to end at CI size ----------------------------------------------------------------------

def test_our_ring_passes_and_its_report_says_so(ring_processes, tmp_path):
    config, judged = _run(ring_processes)
    assert judged["verdict"] == "pass", judged["why"]
    assert judged["summary"]["worst_gradient_ratio"] <= 1 and judged["summary"]["left_band_at"] is None
    doc = report_dict(config, judged, "ringcheck train ...")
    from ringcheck.documents import save  # the writer, for the round trip

    back = load(save(doc, tmp_path / "train.json"), schema=TRAIN_SCHEMA)
    assert back["verdict"] == "pass" and len(back["steps"]) == config.steps
    assert "ringcheck train: PASSED" in train_markdown(doc)
    assert train_html(doc).count("data:image/png;base64,") == 3


def test_a_rank_with_nothing_to_count_still_trains(ring_processes):
    """Contiguous shards at P=2: rank 0 holds the first half only, where no target is counted; its
    loss is 0 and its backward still runs (a rank whose tokens are all masked is where NaN losses
    have come from)."""
    config, judged = _run(ring_processes, layout="contiguous")
    first = rank_part(config, make_batch(config, 0, config.batch), rank=0, group_index=0)
    assert not bool(first.counted.any())
    assert judged["verdict"] == "pass", judged["why"]


def test_a_backward_bug_fails_at_step_zero_and_the_report_says_which_parameters(ring_processes):
    config, judged = _run(ring_processes, impl=f"{MUTANTS}:dkdv_not_home")
    assert judged["verdict"] == "fail"
    out = judged["summary"]["grads_out"]
    assert any(name.endswith(("wk", "wv")) for name in out), out
    ratio = {g["name"]: g["ratio"] for g in judged["gradients"]}
    assert max(ratio.values()) > 10  # ten budgets out: far outside the floor, not a near miss


@pytest.mark.parametrize("impl, verdict", [("ringcheck", "pass"), (f"{EMBEDDED}:default_group", "fail")])
def test_a_ring_on_the_default_group_fails_inside_a_mesh(ring_processes, impl, verdict):
    _, judged = _run(ring_processes, impl=impl, mesh="cp=2,tp=2")
    assert judged["verdict"] == verdict, judged["why"]


@pytest.mark.parametrize("impl, sinks_grad, verdict", [
    ("ringcheck", "partial", "pass"), ("ringcheck", "reduced", "pass"), (f"{EMBEDDED}:sinks_all_reduced", "partial",
                                                                         "fail")])
def test_the_sinks_gradient_convention(ring_processes, impl, sinks_grad, verdict):
    """A ring that all-reduces the sinks' gradient inside attention, declared `partial`, trains
    with P times it: the sinks are out at step 0 (and nothing else is)."""
    _, judged = _run(ring_processes, impl=impl, sinks=True, sinks_grad=sinks_grad)
    assert judged["verdict"] == verdict, judged["why"]
    if verdict == "fail":
        assert judged["summary"]["grads_out"] == ["layers.0.sinks"]


# ---- the command --------------------------------------------------------------------------------

def test_the_command_passes_our_ring_and_writes_its_report(tmp_path, capsys):
    assert main(["train", *CI_FLAGS, "--report", str(tmp_path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "PASSED" in out and "ringcheck train --impl ringcheck" in out
    doc = json.loads((tmp_path / "train.json").read_text())
    assert doc["schema"] == TRAIN_SCHEMA and doc["passed"] is True
    assert (tmp_path / "train.md").is_file() and (tmp_path / "train.html").is_file()


def test_the_command_fails_a_backward_mutant(capsys):
    assert main(["train", *CI_FLAGS, "--impl", f"{MUTANTS}:block_lse_backward"]) == EXIT_FAILED
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--impl", "no_such_module:fn"], "--impl"),
    (["--head-dim", "15"], "odd"),
    pytest.param(["--impl", "ring_attention_pytorch", "--layout", "contiguous", "--mesh", "dp=2,cp=2"], "trains alone",
                 marks=pytest.mark.skipif(importlib.util.find_spec("ring_attention_pytorch") is None,
                                          reason="ring-attention-pytorch is not installed (pip install -e '.[peers]')")),
    # the dtype rule is ring-flash-attn's adapter's: without the package the command says it needs it
    pytest.param(["--impl", "ring_flash_attn:zigzag", "--flash-attn-stand-in", "--dtype", "float32"],
                 "not float32; pass --dtype bfloat16",
                 marks=pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None,
                                          reason="ring-flash-attn is not installed (pip install -e '.[peers]')")),
    (["--head-dim-v", "8"], "one head dim"),
])
def test_settings_it_cannot_run_get_no_verdict_before_any_rank_starts(capsys, argv, words):
    assert main(["train", *CI_FLAGS, *argv]) == EXIT_USAGE
    assert words in capsys.readouterr().err


def test_an_implementation_that_raises_gets_no_verdict(capsys):
    argv = ["train", *CI_FLAGS, "--impl", "ringcheck.catalogue.bad_impls:raises_on_rank_one", "--timeout", "10"]
    assert main(argv) == EXIT_USAGE
    assert "rank 1 ran out of patience" in capsys.readouterr().err
