"""The adapters moved to `ringcheck.adapters` (one registry, one module per peer library); this
name stays for scripts that import `load_impl` from here."""

from ..adapters import BUILTIN, Impl, ImplFn, accepted_keywords, load_impl, require_variant_keywords

__all__ = ["BUILTIN", "Impl", "ImplFn", "accepted_keywords", "load_impl", "require_variant_keywords"]
