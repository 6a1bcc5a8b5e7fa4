"""The variant flags (--documents, --pad, --window, --softcap, --sinks, --head-dim-v): their
parsing and errors, how random:K places documents, and drift run at a variant."""

import json

import pytest

from ringcheck.cli import main
from ringcheck.commands.drift import DriftSpec, run_drift
from ringcheck.judge.variant_options import VariantOptions, parse_documents, parse_window
from ringcheck.spec import RingSpec


@pytest.mark.parametrize("text, message", [
    ("random:0", "count K >= 1"),
    ("random:x", "count K >= 1"),
    ("3,-4", "document lengths"),
    ("", "LEN,LEN"),
])
def test_bad_documents_are_refused_with_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_documents(text)


def test_window_parses_and_refuses():
    assert parse_window("4096,0") == (4096, 0)
    assert parse_window("-1,-1") == (-1, -1)
    for bad in ("3", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="LEFT,RIGHT"):
            parse_window(bad)
    with pytest.raises(ValueError, match="below -1"):
        parse_window("-2,0")


def test_explicit_documents_must_fill_the_sequence():
    options = VariantOptions(documents="10,20", pad=2)
    variant, sinks, dv = options.resolve(32, RingSpec(2))
    assert variant.cu_seqlens == (0, 10, 30) and sinks is None and dv is None
    with pytest.raises(ValueError, match="adds up to 30 tokens, but seq_len=40 minus --pad 2 leaves 38"):
        options.resolve(40, RingSpec(2))
    with pytest.raises(ValueError, match="--pad 4 needs --documents"):
        VariantOptions(pad=4)


def test_random_documents_hit_the_rank_and_chunk_boundaries_and_a_one_token_document():
    ring = RingSpec(4, "zigzag")
    cu = VariantOptions(documents="random:6").resolve(64, ring, seed=3)[0].cu_seqlens
    assert len(cu) == 7 and cu[0] == 0 and cu[-1] == 64
    assert 16 in cu and 8 in cu  # a rank boundary (64 / 4) and a zig-zag chunk boundary (64 / 8)
    assert 1 in [b - a for a, b in zip(cu, cu[1:])]
    assert cu == VariantOptions(documents="random:6").resolve(64, ring, seed=3)[0].cu_seqlens
    assert cu != VariantOptions(documents="random:6").resolve(64, ring, seed=4)[0].cu_seqlens


def test_random_documents_for_zigzag_docs_are_multiples_of_2p():
    ring = RingSpec(4, "zigzag_docs")
    for seed in range(5):
        cu = VariantOptions(documents="random:5", pad=16).resolve(128, ring, seed=seed)[0].cu_seqlens
        assert cu[-1] == 112 and all(c % 8 == 0 for c in cu), cu


def test_options_say_what_they_validate():
    assert VariantOptions().describe() == "plain attention (no variants)" and VariantOptions().to_json() == {}
    options = VariantOptions(documents="random:3", pad=8, window=(16, 0), softcap=30.0, sinks=True, head_dim_v=8)
    assert options.describe() == "documents random:3 + 8 padding, window 16,0, softcap 30, sinks, head_dim_v 8"
    variant, sinks, dv = options.resolve(64, RingSpec(2))
    assert variant.window == (16, 0) and variant.softcap == 30.0 and sinks == "typical" and dv == 8


def test_drift_runs_at_a_variant_and_says_so():
    spec = DriftSpec(dtypes=("bfloat16",), ring_sizes=(1, 2, 4), distributions=("normal",), modes=("zigzag_docs",),
                     seeds=1, tokens_per_rank=16, accumulations=("float32",),
                     variants=VariantOptions(documents="random:3", pad=8, window=(9, -1), softcap=5.0, sinks=True))
    doc = run_drift(spec)
    assert doc["spec"]["variants"] == {"documents": "random:3", "pad": 8, "window": [9, -1], "softcap": 5.0,
                                       "sinks": True}
    tensors = {fit["tensor"] for fit in doc["fits"].values()}
    assert tensors == {"out", "lse", "dq", "dk", "dv", "dsinks"}
    assert "per_head" in doc["rules"]
    # no flag; ring sizes 1, 2, 4 fit no slope, so no verdict either (dsinks is judged on its budget alone)
    assert doc["summary"]["accumulations"]["float32"]["flagged"] == 0, doc["summary"]
    assert doc["summary"]["verdict"] == "no verdict" and doc["summary"]["accumulations"]["float32"]["per_head"] == 1


def test_plain_drift_documents_carry_no_variant_key():
    spec = DriftSpec(dtypes=("float32",), ring_sizes=(1, 2), distributions=("normal",), modes=("causal",), seeds=1)
    doc = run_drift(spec)
    assert "variants" not in doc["spec"] and "per_head" not in doc["rules"]


def test_drift_cli_refuses_a_document_the_layout_cannot_cut(tmp_path, capsys):
    rc = main(["drift", "--ring-sizes", "2", "--modes", "zigzag_docs", "--documents", "5,11", "--out",
               str(tmp_path), "-q"])
    assert rc == 2
    assert "document 0 (tokens 0..4) has length 5" in capsys.readouterr().err


def test_drift_cli_writes_the_variants(tmp_path):
    rc = main(["drift", "--ring-sizes", "1,2", "--modes", "causal", "--dtypes", "float32", "--distributions",
               "normal", "--seeds", "1", "--documents", "random:2", "--window", "3,0", "--out", str(tmp_path), "-q"])
    assert rc == 2  # ring sizes 1, 2 fit no slope: no verdict (the report is written all the same)
    doc = json.loads((tmp_path / "drift.json").read_text())
    assert doc["spec"]["variants"] == {"documents": "random:2", "pad": 0, "window": [3, 0]}
