"""transformers' private surface, the one door to it: the causal-LM class of a config
(`auto_factory._get_model_class` over `AutoModelForCausalLM._model_mapping`), whether a model
class can set its experts' implementation, and a config's attention implementation
(`config._attn_implementation`). transformers is optional (the `hf` extra); it is imported on
call. A moved name raises `SurfaceMoved`: "transformers 6.0.0 moved ...: ringcheck supports
transformers 5.23 here; pip install transformers==5.23.0 or upgrade ringcheck".
"""

from __future__ import annotations

from typing import Any

from .door import Door

TRANSFORMERS = Door("transformers", supported="5.23", fix="pip install transformers==5.23.0")


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
