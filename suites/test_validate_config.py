"""validate's TOML config: every key's type checked at load with the key's name, top-level keys
and a [validate] table merged (a key given two values refused), unknown keys answered with the
closest known one, and the list of known keys complete. Nothing here starts a rank: a bad
config exits 2 before any process does."""

from __future__ import annotations

import pytest

from ringcheck.cli import EXIT_USAGE, main
from ringcheck.cli.common import UsageError
from ringcheck.cli.validate import read_config
from ringcheck.commands.validate import Target

QUIET = ["--world-size", "0"]  # a flag error after the config is read: the run never starts


def _error(tmp_path, capsys, text: str, *argv: str) -> str:
    config = tmp_path / "target.toml"
    config.write_text(text)
    assert main(["validate", "--config", str(config), *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 2, err
    return err


@pytest.mark.parametrize("text, words", [
    ('causal = "yes"\n', "causal must be true or false, got 'yes' (str)"),
    ('seq_len = "256"\n', "seq_len must be an integer, got '256' (str)"),
    ("seq_len = true\n", "seq_len must be an integer, got True (bool)"),
    ("[validate]\nheads = 4.5\n", "heads must be an integer, got 4.5 (float)"),
    ('local_lengths = [2, "6"]\n', "local_lengths must be a list of integers"),
    ("window = [16]\n", "window must be a list of two integers [LEFT, RIGHT]"),
    ('quick = "yes"\n', "quick must be true or false"),
    ('timeout = "30"\n', "timeout must be a number of seconds"),
    ('sinks_grad = 1\n', "sinks_grad must be a string"),
    ('mesh = 8\n', "mesh must be a string like \"dp=2,cp=4\""),
])
def test_a_value_of_the_wrong_type_names_its_key_before_anything_runs(tmp_path, capsys, text, words):
    assert words in _error(tmp_path, capsys, text)


def test_top_level_keys_and_a_validate_table_merge(tmp_path):
    config = tmp_path / "target.toml"
    config.write_text('seq_len = 256\nquick = true\n[validate]\nlayout = "contiguous"\ncausal = false\n')
    values = read_config(str(config))
    assert values == {"seq_len": 256, "quick": True, "layout": "contiguous", "causal": False}
    target = Target.from_mapping({k: v for k, v in values.items() if k != "quick"})
    assert (target.seq_len, target.layout, target.causal) == (256, "contiguous", False)


def test_a_key_given_two_values_is_refused_with_both(tmp_path, capsys):
    err = _error(tmp_path, capsys, "seq_len = 256\n[validate]\nseq_len = 512\n")
    assert "seq_len = 256 at the top level and 512 in [validate]; keep one of them" in err
    config = tmp_path / "same.toml"
    config.write_text("seq_len = 256\n[validate]\nseq_len = 256\n")  # the same value twice: no conflict
    assert read_config(str(config))["seq_len"] == 256


def test_an_unknown_key_gets_a_did_you_mean_and_the_complete_list(tmp_path, capsys):
    err = _error(tmp_path, capsys, "seq_length = 256\n")
    assert "unknown key(s) ['seq_length'] (did you mean 'seq_len' for 'seq_length'?)" in err
    known = err.split("known: ", 1)[1]
    for key in ("quick", "timeout", "mesh", "sinks_grad", "seq_len", "flash_attn_stand_in", "forward_only"):
        assert key in known, known


def test_a_config_that_is_not_toml_or_a_table_that_is_not_one(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("seq_len = \n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        read_config(str(config))
    config.write_text('validate = "yes"\n')
    with pytest.raises(UsageError, match="validate must be a \\[validate\\] table"):
        read_config(str(config))


def test_flags_override_the_config_and_keep_their_types(tmp_path, capsys):
    err = _error(tmp_path, capsys, "seq_len = 256\n", *QUIET)
    assert "world_size must be >= 1" in err
