"""flash-attn's private surface, the one door to it: `flash_attn_interface._flash_attn_backward`,
the kernel behind flash-attn's own autograd backward, which ringcheck's flash_attn block backend
calls. flash-attn is optional (CUDA only); the backend imports it first and says how to install
it. A moved name raises `SurfaceMoved`: "flash-attn 3.0.0 moved ...: ringcheck supports
flash-attn 2.6–2.8 here; pip install 'flash-attn>=2.6,<2.9' or upgrade ringcheck".
"""

from __future__ import annotations

from typing import Any

from .door import Door

FLASH_ATTN = Door("flash-attn", supported="2.6–2.8", fix="pip install 'flash-attn>=2.6,<2.9'")


def flash_attn_backward() -> Any:
    """`flash_attn.flash_attn_interface._flash_attn_backward` (a torch custom op from 2.7)."""
    return FLASH_ATTN.reach("flash_attn.flash_attn_interface", "_flash_attn_backward")
