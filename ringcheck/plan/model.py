"""The model `ringcheck plan` sizes: a Llama-style decoder (RMSNorm, grouped-query attention with
RoPE, SwiGLU feed-forward, untied embeddings unless said), its parameters and the activations
one layer keeps for its backward.

Counts are of elements per token of one sequence unless a name says bytes. What a layer keeps
for the backward, in eager PyTorch with fused RMSNorm and the ring's attention:

- attention (the ring's own, `ring.saved_bytes`): q, k, v as the projections made them (after
  RoPE), the ring's output and its log-sum-exp;
- the rest: the layer's input (the first norm keeps it, with one float32 rstd per token), the
  first norm's output (the q/k/v projections keep their input), the attention output in the
  model's dtype (the output projection keeps its input), the residual after attention (the
  second norm's input, with its rstd), the second norm's output (the gate and up projections'
  input), and the feed-forward's gate, up, SiLU(gate) and their product (the down projection's
  input): ``4 H + A D + 4 F`` elements and 8 bytes per token.

A check: `ModelShape.llama("llama-2-70b").parameters()` is 68,976,648,192, the count Meta
publishes for Llama 2 70B; TinyLlama 1.1B's is 1,100,048,384.
"""

from __future__ import annotations

from dataclasses import dataclass

# named shapes (layers, hidden, heads, kv_heads, head_dim, ffn, vocab) from the models' config.json
KNOWN = {
    "llama-2-70b": (80, 8192, 64, 8, 128, 28672, 32000),
    "llama-3.1-70b": (80, 8192, 64, 8, 128, 28672, 128256),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256),
    "tinyllama-1.1b": (22, 2048, 32, 4, 64, 5632, 32000),
}


def default_ffn(hidden: int) -> int:
    """Llama's rule when --ffn-hidden is not given: 2/3 of 4 H, rounded up to a multiple of 256."""
    return -(-(8 * hidden // 3) // 256) * 256


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False      # one matrix for the input embedding and the output head

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}: each K/V head "
                             f"serves a group of query heads")

    @classmethod
    def llama(cls, name: str) -> ModelShape:
        return cls(*KNOWN[name])

    def layer_parameters(self) -> int:
        h, a, k, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        attention = h * a * d + 2 * h * k * d + a * d * h
        return attention + 3 * h * self.ffn + 2 * h

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters() + embeddings + self.hidden

    def rest_elements(self) -> int:
        """Elements per token a layer keeps for its backward besides the ring's (module docstring)."""
        return 4 * self.hidden + self.heads * self.head_dim + 4 * self.ffn

    def backward_working_elements(self) -> int:
        """Elements per token alive at once in one layer's backward besides what it kept: the
        gradient of the residual stream and three feed-forward gradients (of the product, of
        SiLU(gate) and of up) before the down projection's are freed."""
        return self.hidden + 3 * self.ffn

    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token's forward through every layer's projections and the head
        (2 per multiply-add), attention scores excluded (`ring.attention_flops`)."""
        per_layer = 2 * (self.layer_parameters() - 2 * self.hidden)
        return self.layers * per_layer + 2 * self.vocab * self.hidden
