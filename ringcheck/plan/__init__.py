"""`ringcheck plan`'s room: the arithmetic of a ring-attention training run on GPUs, per GPU
(memory, whether it fits, the smallest ring that fits; a ring step's communication against its
compute), as pure functions of the settings. No torch, no I/O: the CLI reads the flags and
renders the document `plan_document` returns."""

from .document import EXIT_OF, plan_document
from .hardware import DEVICES, LINKS
from .model import KNOWN, ModelShape, default_ffn
from .ring import KERNELS, Shape, call_peak, saved_bytes, step_blocks
from .settings import OPTIMIZERS, Settings

__all__ = ["DEVICES", "EXIT_OF", "KERNELS", "KNOWN", "LINKS", "OPTIMIZERS", "ModelShape", "Settings", "Shape",
           "call_peak", "default_ffn", "plan_document", "saved_bytes", "step_blocks"]
