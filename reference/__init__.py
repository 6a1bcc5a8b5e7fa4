"""Single-device references that ring attention is judged against.

- `dense_attention`: attention in float64 (the truth for every test; products of
  bf16/fp16/fp32 values are exact in float64), differentiable, with an analytic backward in
  `dense_grads`.
- `peer_attention`: the same naive computation in the *input* dtype (flash-attention's
  ``upcast=False`` reference); its error to the truth sets a ring's error budget.

Nothing here imports the ring code of ``ringcheck``. This folder is imported, and installed, as
``ringcheck.reference`` (setup.py; in a checkout, ``ringcheck._ReferenceBeside``), never as a
top-level ``reference``, a name a user's own package often has: so its modules import each other
relatively.
"""

from .dense import attention_mask, dense_attention, dense_grads, peer_attention
from .mp import MPResult, UncertifiedError, mp_attention

__all__ = ["attention_mask", "dense_attention", "dense_grads", "peer_attention", "mp_attention", "MPResult", "UncertifiedError"]
