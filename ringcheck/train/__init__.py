"""`ringcheck train`'s room: does training under a ring match training without it?

- `config`: the settings (`TrainConfig`: the implementation, the ring and mesh, the model
  presets and shape flags, the variants), checked before any rank starts;
- `data`: the seeded copy task whose answers sit on other ranks, and each rank's part of it;
- `model`: a small Llama-style decoder as functions of float32 master weights;
- `attention`: the single-device kernels (exact, fused, naive) and one rank's ring attention;
- `loop`: the training loop, the ring's run on every rank of a mesh (the framework's gradient
  reduction included) and the single-device runs (the reference and the noise runs);
- `verdict`: the noise floor, the gradient and loss rules, the TE-style reading.

`ringcheck.commands.train` drives a run; `ringcheck.render.train_*` presents it.
"""

from .config import PRESETS, TrainConfig
from .verdict import K_GRAD, K_LOSS, judge

__all__ = ["K_GRAD", "K_LOSS", "PRESETS", "TrainConfig", "judge"]
