"""transformers' private surface, the one door to it: the causal-LM class of a config
(`auto_factory._get_model_class` over `AutoModelForCausalLM._model_mapping`), whether a model
class can set its experts' implementation, a config's attention implementation
(`config._attn_implementation`), the flash path's kernel loader (`_lazy_imports` of
`modeling_flash_attention_utils`, answered for one name: `answer_flash_imports`; its
`_flash_attention_forward` kept: `keep_flash_attention_forward`), which core
attentions a model class takes (`supports_attention`, `compatible_flash_implementations`), and the
names that moved within the versions ringcheck supports (5.6 to 5.23: `activation_checkpointing_enable`,
named `gradient_checkpointing_enable` before). transformers is optional (the `hf` extra); it is imported on
call. A moved name raises `SurfaceMoved`: "transformers 6.0.0 moved ...: ringcheck supports
transformers 5.6 to 5.23 here; pip install 'transformers>=5.6,<5.24' or upgrade ringcheck".
"""

from __future__ import annotations

from collections.abc import Callable
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


SUPPORTS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}


def supports_attention(cls: type, core: str) -> bool:
    """Whether transformers builds `cls` with the core attention `core` ("sdpa" or
    "flash_attention_2"): the class's own flag (`_supports_sdpa`, `_supports_flash_attn`)."""
    if not hasattr(cls, SUPPORTS[core]):
        raise TRANSFORMERS.moved(f"{cls.__name__}.{SUPPORTS[core]}")
    return bool(getattr(cls, SUPPORTS[core]))


def compatible_flash_implementations(cls: type) -> list[str]:
    """The flash kernels `cls` names as its own (`_compatible_flash_implementations`): where the
    list is not empty and lacks the one asked for, transformers builds the model with its first
    instead (gpt_oss: "flash_attention_2" becomes the hub kernel with sinks); [] where it names none."""
    return list(getattr(cls, "_compatible_flash_implementations", None) or [])


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


FLASH_UTILS = "transformers.modeling_flash_attention_utils"


def answer_flash_imports(name: str, flash_attn_func, flash_attn_varlen_func) -> Callable[[], None]:
    """transformers' flash path (`_flash_attention_forward`) asks `_lazy_imports(implementation)`
    for its kernels; for `implementation == name` it is answered with `flash_attn_func` and
    `flash_attn_varlen_func` (and transformers' own pad and unpad), as it answers
    "flash_attention_2" when flash-attn is installed; every other name as before. Returns the undo,
    which puts `_lazy_imports` back and forgets the kernels loaded under `name`."""
    utils = TRANSFORMERS.reach(FLASH_UTILS)
    original = TRANSFORMERS.reach(FLASH_UTILS, "_lazy_imports")
    original = getattr(original, "ringcheck_original", original)  # installed twice: wrap transformers' own once
    pad, unpad = TRANSFORMERS.reach(FLASH_UTILS, "_pad_input"), TRANSFORMERS.reach(FLASH_UTILS, "_unpad_input")
    TRANSFORMERS.reach(FLASH_UTILS, "_loaded_implementation")  # the cache the undo clears is where it was

    def lazy_imports(implementation, *args, **kwargs):
        if implementation == name:
            return flash_attn_func, flash_attn_varlen_func, None, pad, unpad
        return original(implementation, *args, **kwargs)

    lazy_imports.ringcheck_original = original
    utils._lazy_imports = lazy_imports

    def undo() -> None:
        utils._lazy_imports = original
        if utils._loaded_implementation == name:
            utils._loaded_implementation = None

    return undo


FLASH_FORWARD = "_flash_attention_forward"  # the kernel call of transformers' flash path, which trainers patch
FLASH_INTEGRATION = "transformers.integrations.flash_attention"


def flash_forward_holders(model_module: str) -> dict[str, Any]:
    """The modules whose `_flash_attention_forward` a trainer's patch of the flash path replaces
    (verl's `apply_monkey_patch`: the model's own module where it holds one, legacy models; else
    `transformers.integrations.flash_attention`'s), each with the function it holds now, for
    `restore_flash_forward`."""
    held = {FLASH_INTEGRATION: TRANSFORMERS.reach(FLASH_INTEGRATION, FLASH_FORWARD)}
    own = TRANSFORMERS.reach(model_module, FLASH_FORWARD, fallback=None)
    if own is not None:
        held[model_module] = own
    return held


def restore_flash_forward(held: dict[str, Any]) -> None:
    """Every module of `held` (`flash_forward_holders`) given back the function it held."""
    for module, function in held.items():
        setattr(TRANSFORMERS.reach(module), FLASH_FORWARD, function)
def keep_flash_attention_forward() -> Callable[[], None]:
    """The undo that puts back `_flash_attention_forward` of `modeling_flash_attention_utils` as it
    is now (a trainer's glue replaces it where flash-attn is installed: ms-swift's `prepare`)."""
    utils = TRANSFORMERS.reach(FLASH_UTILS)
    original = TRANSFORMERS.reach(FLASH_UTILS, "_flash_attention_forward")

    def undo() -> None:
        setattr(utils, "_flash_attention_forward", original)

    return undo


# transformers' attention state that a glue's install may change: the registries of attention and mask
# functions (`AttentionInterface.register` writes the class's global mapping, `ALL_ATTENTION_FUNCTIONS[k] = f`
# the instance's local one) and the flash path's kernel call and kernel loader
REGISTRIES = (("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
              ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS"))
FLASH_STATE = ((FLASH_UTILS, FLASH_FORWARD), (FLASH_INTEGRATION, FLASH_FORWARD), (FLASH_UTILS, "_lazy_imports"))


def keep_attention_state() -> Callable[[], None]:
    """The undo that puts transformers' attention state back as it is now: both registries' mappings
    (global and local) and the flash path's `_flash_attention_forward` (in both its modules) and
    `_lazy_imports`; the kernels it loaded forgotten (`_loaded_implementation`), to be loaded
    again. A glue that patches them and does not put them back (ring-flash-attn's
    `substitute_hf_flash_attn` sets `ALL_ATTENTION_FUNCTIONS["flash_attention_2"]`) would otherwise
    leave the next glue run in the same process a patched transformers."""
    maps = []
    for module, name in REGISTRIES:
        for mapping in (TRANSFORMERS.reach(module, f"{name}._local_mapping"),
                        TRANSFORMERS.reach(module, f"{name}._global_mapping")):
            maps.append((mapping, dict(mapping)))
    held = [(TRANSFORMERS.reach(module), attr, TRANSFORMERS.reach(module, attr)) for module, attr in FLASH_STATE]

    def undo() -> None:
        for mapping, was in maps:
            mapping.clear()
            mapping.update(was)
        for module, attr, was in held:
            setattr(module, attr, was)
        # the kernels the flash path loaded are cached under the name they were loaded for: forgotten, so that
        # the next flash call loads them again through the loader put back (never a glue's kernels under that name)
        TRANSFORMERS.reach(FLASH_UTILS)._loaded_implementation = None

    return undo
