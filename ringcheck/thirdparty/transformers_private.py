"""transformers' private surface, the one door to it: the causal-LM class of a config
(`auto_factory._get_model_class` over `AutoModelForCausalLM._model_mapping`), whether a model
class can set its experts' implementation, and a config's attention implementation
(`config._attn_implementation`), and the names that moved within the versions ringcheck supports
(5.6 to 5.23: `activation_checkpointing_enable`, named `gradient_checkpointing_enable` before).
transformers is optional (the `hf` extra); it is imported on
call. A moved name raises `SurfaceMoved`: "transformers 6.0.0 moved ...: ringcheck supports
transformers 5.6 to 5.23 here; pip install 'transformers>=5.6,<5.24' or upgrade ringcheck".
"""

from __future__ import annotations

from typing import Any

from .door import Door

TRANSFORMERS = Door("transformers", supported="5.6 to 5.23", fix="pip install 'transformers>=5.6,<5.24'")


def causal_lm_class(config) -> type:
    """The class `AutoModelForCausalLM.from_config(config)` would build."""
    get = TRANSFORMERS.reach("transformers.models.auto.auto_factory", "_get_model_class")
    return get(config, TRANSFORMERS.reach("transformers", "AutoModelForCausalLM._model_mapping"))


def can_set_experts_implementation(cls: type) -> bool:
    """Whether `cls` takes an experts implementation (False where transformers has no such hook:
    the fallback, as for a model without experts)."""
    return bool(getattr(cls, "_can_set_experts_implementation", lambda: False)())


def attn_implementation(config) -> Any:
    """The attention implementation a transformers config holds."""
    if not hasattr(config, "_attn_implementation"):
        raise TRANSFORMERS.moved(f"{type(config).__name__}._attn_implementation")
    return config._attn_implementation


def set_attn_implementation(config, name: str) -> None:
    """Build models of `config` with the attention implementation `name` (a config that is not a
    model's yet: a model's own goes through `model.set_attn_implementation`)."""
    attn_implementation(config)  # the attribute is where this ringcheck knows it
    config._attn_implementation = name


def enable_activation_checkpointing(model, *, use_reentrant: bool) -> None:
    """Checkpoint every decoder layer of `model` (transformers' own: `activation_checkpointing_enable`,
    whose name before 5.x was `gradient_checkpointing_enable`, the same call; 5.23 keeps that name as a
    deprecated alias that warns)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TRANSFORMERS.moved(f"{type(model).__name__}.activation_checkpointing_enable")


def is_activation_checkpointing(model) -> bool:
    """Whether `model` checkpoints its layers (`is_activation_checkpointing`, before 5.x
    `is_gradient_checkpointing`)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    raise TRANSFORMERS.moved(f"{type(model).__name__}.is_activation_checkpointing")
