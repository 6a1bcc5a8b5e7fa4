"""Measurements of a ring beside its values: `memory` (the peak bytes of tensor storage one
call holds). The commands (validate, bench, plan) and the test kit share these instruments;
nothing here imports a command, the test kit, a renderer or a document."""

from .memory import peak_bytes

__all__ = ["peak_bytes"]
