"""The glues between a transformers model's attention layers and a ring (`ringcheck step --model
--glue`): ringcheck's own (a ring, and Ulysses: `ulysses`), ring-flash-attn's shipped Hugging Face
adapter, and the user's (`PKG.MOD:OBJ`, see `contract`)."""

from .contract import Glue, GlueRefused, check_refusals, refusals
from .loader import BUILT_IN, load_glue

__all__ = ["BUILT_IN", "Glue", "GlueRefused", "check_refusals", "load_glue", "refusals"]
