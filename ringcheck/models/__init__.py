"""The tiny models of any transformers decoder (tiny.py) and the native truth they are judged by."""

from .tiny import LayerAttention, ModelRefused, TinyModel, tiny_model, zoo_names

__all__ = ["LayerAttention", "ModelRefused", "TinyModel", "tiny_model", "zoo_names"]
