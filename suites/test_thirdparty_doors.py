"""Third-party private names behind one door each (issue 60, item 2): a version whose surface
has moved (the attribute taken away, the installed version faked) gives one line that names the
version and the fix, a SurfaceMoved (a RuntimeError), never an AttributeError from inside a run;
where ringcheck does without a name (the c10d store, NCCL's abort), the door's fallback."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from ringcheck.launch.common import live_groups
from ringcheck.thirdparty import deepspeed_private, flash_attn_private, torch_private, transformers_private
from ringcheck.thirdparty.door import Door, SurfaceMoved
from ringcheck.thirdparty.torch_private import TORCH

C10D = "torch.distributed.distributed_c10d"


@pytest.fixture
def moved(monkeypatch):
    """`moved(door, version, module, attr)`: the installed version faked as `version`, `attr`
    taken from `module`; every door reaches its names afresh before and after."""
    doors = []

    def move(door: Door, version: str, module: str | None = None, attr: str | None = None) -> None:
        door.forget()
        doors.append(door)
        monkeypatch.setattr(door, "installed", version)
        if module is not None:
            monkeypatch.delattr(importlib.import_module(module), attr)

    yield move
    for door in doors:
        door.forget()


def _one_line(excinfo) -> str:
    said = str(excinfo.value)
    assert "\n" not in said and isinstance(excinfo.value, RuntimeError), said
    return said


@pytest.mark.parametrize(("module", "attr", "call", "said"), [
    ("torch.distributed.tensor.experimental._attention", "_cp_options", torch_private.cp_options,
     "torch 2.14.0 moved torch.distributed.tensor.experimental._attention._cp_options: ringcheck supports torch 2.13 "
     "here; install torch==2.13.* or upgrade ringcheck"),
    (torch_private.CONTEXT_PARALLEL, "_templated_ring_attention",
     lambda: torch_private.templated_ring_attention(None, 2, None),
     f"torch 2.14.0 moved {torch_private.CONTEXT_PARALLEL}._templated_ring_attention: ringcheck supports torch 2.13 "
     f"here; install torch==2.13.* or upgrade ringcheck"),
    ("torch.autograd", "_make_grads", lambda: torch_private.make_grads((), ()),
     "torch 2.14.0 moved torch.autograd._make_grads: ringcheck supports torch 2.3–2.13 here; pin torch<=2.13 or "
     "upgrade ringcheck"),
    ("torch.autograd.graph", "_engine_run_backward", lambda: torch_private.engine_run_backward(),
     "torch 2.14.0 moved torch.autograd.graph._engine_run_backward: ringcheck supports torch 2.3–2.13 here; pin "
     "torch<=2.13 or upgrade ringcheck"),
    (C10D, "_world", torch_private.process_group_count,
     f"torch 2.14.0 moved {C10D}._world.pg_map: ringcheck supports torch 2.3–2.13 here; pin torch<=2.13 or upgrade "
     f"ringcheck"),
    (C10D, "_resolve_process_group", lambda: torch_private.resolve_process_group("0"),
     f"torch 2.14.0 moved {C10D}._resolve_process_group: ringcheck supports torch 2.3–2.13 here; pin torch<=2.13 or "
     f"upgrade ringcheck"),
    (C10D, "default_pg_timeout", lambda: torch_private.bound_new_groups(60.0),
     f"torch 2.14.0 moved {C10D}.default_pg_timeout: ringcheck supports torch 2.3–2.13 here; pin torch<=2.13 or "
     f"upgrade ringcheck"),
    ("torch.utils._python_dispatch", "TorchDispatchMode", lambda: torch_private.TorchDispatchMode,
     "torch 2.14.0 moved torch.utils._python_dispatch.TorchDispatchMode: ringcheck supports torch 2.3–2.13 here; pin "
     "torch<=2.13 or upgrade ringcheck"),
], ids=["cp_options", "templated_ring_attention", "make_grads", "engine_run_backward", "pg_map", "resolve",
        "default_timeout", "dispatch_mode"])
def test_torchs_door_says_the_version_and_the_fix(moved, module, attr, call, said, torchrun_world):
    if torchrun_world is not None and module == C10D:
        pytest.skip("takes c10d's tables away from the torchrun world the session's verdicts travel on: plain pytest")
    moved(TORCH, "2.14.0", module, attr)
    with pytest.raises(SurfaceMoved) as excinfo:
        call()
    assert _one_line(excinfo) == said


def test_torchs_door_reads_the_version_once_and_reaches_what_is_there():
    TORCH.forget()
    assert TORCH.version() == importlib.metadata.version("torch") and TORCH.installed == TORCH.version()
    forward, backward = torch_private.cpu_flash_attention()
    assert forward is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert backward is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert torch_private.cp_options() is importlib.import_module(
        "torch.distributed.tensor.experimental._attention")._cp_options


def test_a_run_meets_the_one_line_not_an_attribute_error(moved, monkeypatch):
    """What a launcher calls on a rank (`live_groups`) goes through the door: the line, not an
    AttributeError raised inside the run. The faked torch keeps its default group and has no
    table of groups."""
    moved(TORCH, "2.14.0")
    monkeypatch.setattr(importlib.import_module(C10D), "_world", types.SimpleNamespace(default_pg=object()))
    assert torch.distributed.is_initialized()
    with pytest.raises(SurfaceMoved) as excinfo:
        live_groups()
    assert _one_line(excinfo) == (f"torch 2.14.0 moved {C10D}._world.pg_map: ringcheck supports torch 2.3–2.13 here; "
                                  f"pin torch<=2.13 or upgrade ringcheck")


@pytest.mark.parametrize(("attr", "call"), [("_get_default_store", torch_private.default_store),
                                            ("_abort_process_group", torch_private.abort_process_group)])
def test_torchs_door_falls_back_where_ringcheck_does_without(moved, attr, call):
    """No store: a failing rank's peers wait out the ring timeout; no abort: the group is destroyed."""
    moved(TORCH, "2.14.0", C10D, attr)
    assert call() is None


def test_transformers_door_says_the_version_and_the_fix(moved):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig  # optional: the hf extra

    assert transformers_private.causal_lm_class(LlamaConfig()).__name__ == "LlamaForCausalLM"
    moved(transformers_private.TRANSFORMERS, "6.0.0", "transformers.models.auto.auto_factory", "_get_model_class")
    with pytest.raises(SurfaceMoved) as excinfo:
        transformers_private.causal_lm_class(LlamaConfig())
    assert _one_line(excinfo) == ("transformers 6.0.0 moved transformers.models.auto.auto_factory._get_model_class: "
                                  "ringcheck supports transformers 5.6 to 5.23 here; pip install "
                                  "'transformers>=5.6,<5.24' or upgrade ringcheck")
    with pytest.raises(SurfaceMoved, match=r"^transformers 6\.0\.0 moved SimpleNamespace\._attn_implementation: "):
        transformers_private.attn_implementation(types.SimpleNamespace())


class _Before56:  # transformers 5.6's names of the checkpointing calls
    def __init__(self):
        self.said = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.said = gradient_checkpointing_kwargs

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.said is not None


class _Since(_Before56):  # the later names (5.23 keeps the old ones as deprecated aliases that warn)
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self.said = ("new", activation_checkpointing_kwargs)

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.said is not None


def test_transformers_attention_state_is_put_back_whatever_a_glue_left(moved):
    """`keep_attention_state`'s undo: the attention and mask registries (global and local mappings)
    and the flash path's kernel call, in both its modules, as they were; a registry that has moved
    says so in one line."""
    pytest.importorskip("transformers")
    import transformers.integrations.flash_attention as integration  # optional: the hf extra
    import transformers.modeling_flash_attention_utils as utils
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    flash, kernel, sdpa = utils._flash_attention_forward, integration._flash_attention_forward, ALL_ATTENTION_FUNCTIONS["sdpa"]
    undo = transformers_private.keep_attention_state()

    def planted(*args, **kwargs):
        raise AssertionError("a glue's leftover")

    AttentionInterface.register("ringcheck_leftover", planted)          # the global mapping
    ALL_ATTENTION_FUNCTIONS["sdpa"] = planted                           # the local one
    ALL_MASK_ATTENTION_FUNCTIONS["ringcheck_leftover"] = planted
    utils._flash_attention_forward = integration._flash_attention_forward = planted
    undo()
    assert "ringcheck_leftover" not in ALL_ATTENTION_FUNCTIONS and "ringcheck_leftover" not in ALL_MASK_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert utils._flash_attention_forward is flash and integration._flash_attention_forward is kernel
    moved(transformers_private.TRANSFORMERS, "6.0.0", "transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS")
    with pytest.raises(SurfaceMoved) as excinfo:
        transformers_private.keep_attention_state()
    assert _one_line(excinfo).startswith("transformers 6.0.0 moved transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS")


@pytest.mark.parametrize(("model", "said"), [(_Before56(), {"use_reentrant": True}),
                                             (_Since(), ("new", {"use_reentrant": True}))])
def test_checkpointing_is_asked_by_the_name_the_installed_transformers_has(moved, model, said):
    assert not transformers_private.is_activation_checkpointing(model)
    transformers_private.enable_activation_checkpointing(model, use_reentrant=True)
    assert model.said == said and transformers_private.is_activation_checkpointing(model)
    moved(transformers_private.TRANSFORMERS, "6.0.0")
    with pytest.raises(SurfaceMoved) as excinfo:
        transformers_private.enable_activation_checkpointing(object(), use_reentrant=False)
    assert _one_line(excinfo).startswith("transformers 6.0.0 moved object.activation_checkpointing_enable: ")


def _fake_deepspeed(monkeypatch, **state) -> types.ModuleType:
    """DeepSpeed's sequence-parallel state module, faked in sys.modules with `state`."""
    module = types.ModuleType(deepspeed_private.STATE)
    module.__dict__.update(state)
    monkeypatch.setitem(sys.modules, deepspeed_private.STATE, module)
    return module


def test_deepspeeds_door_says_the_version_and_the_fix(moved, monkeypatch):
    released = []
    state = _fake_deepspeed(monkeypatch, _release_sequence_parallel_groups=lambda: released.append(1),
                            _SEQUENCE_PARALLEL_GROUP=None, _SEQUENCE_DATA_PARALLEL_GROUP=None)
    moved(deepspeed_private.DEEPSPEED, "0.19.8")
    deepspeed_private.release_sequence_parallel_groups()
    deepspeed_private.hand_sequence_parallel_group("the CP group")
    assert released == [1] and vars(state)["_SEQUENCE_PARALLEL_GROUP"] == "the CP group"
    assert vars(state)["_SEQUENCE_DATA_PARALLEL_GROUP"] == "the CP group"

    _fake_deepspeed(monkeypatch)  # a DeepSpeed whose state moved: neither the release nor the groups
    moved(deepspeed_private.DEEPSPEED, "0.20.0")
    for call in (deepspeed_private.release_sequence_parallel_groups,
                 lambda: deepspeed_private.hand_sequence_parallel_group("g")):
        with pytest.raises(SurfaceMoved) as excinfo:
            call()
        assert _one_line(excinfo).startswith(f"deepspeed 0.20.0 moved {deepspeed_private.STATE}._")
        assert _one_line(excinfo).endswith(": ringcheck supports deepspeed 0.19.8 here; pip install "
                                           "deepspeed==0.19.8 or upgrade ringcheck")


def test_flash_attns_door_says_the_version_and_the_fix(moved, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", types.ModuleType("flash_attn.flash_attn_interface"))
    moved(flash_attn_private.FLASH_ATTN, "3.0.0")
    with pytest.raises(SurfaceMoved) as excinfo:
        flash_attn_private.flash_attn_backward()
    assert _one_line(excinfo) == ("flash-attn 3.0.0 moved flash_attn.flash_attn_interface._flash_attn_backward: "
                                  "ringcheck supports flash-attn 2.6–2.8 here; pip install 'flash-attn>=2.6,<2.9' "
                                  "or upgrade ringcheck")


def test_a_dependency_that_is_not_installed_says_so_as_before():
    """A door tells a moved name from a missing package: the caller's own 'pip install' stands."""
    door = Door("ringcheck_no_such_dependency", supported="1.0", fix="pin it")
    with pytest.raises(ModuleNotFoundError):
        door.reach("ringcheck_no_such_dependency.inner", "_name")
