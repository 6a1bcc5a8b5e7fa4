"""Implementations under test: the `--impl` contract (`contract`), the one registry that loads
them (`registry.load_impl`), and one module per built-in adapter, each with its own rules."""

from .contract import (
    OPTIONAL_KEYWORDS,
    SINKS_GRAD,
    VARIANT_FLAGS,
    ContractError,
    Impl,
    ImplFn,
    accepted_keywords,
    check_signature,
    refuse_value_head_dim,
    require_variant_keywords,
    unpack,
)
from .registry import BUILTIN, load_impl

__all__ = ["BUILTIN", "OPTIONAL_KEYWORDS", "SINKS_GRAD", "VARIANT_FLAGS", "ContractError", "Impl", "ImplFn",
           "accepted_keywords", "check_signature", "load_impl", "refuse_value_head_dim", "require_variant_keywords",
           "unpack"]
