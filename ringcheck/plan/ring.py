"""The ring's own arithmetic for `ringcheck plan`: what ringcheck's ring keeps and holds in
flight per GPU, its blocks per step, and a step's communication against its compute.

Sizes are bytes on one GPU for one micro-batch of `batch` sequences, `n` = seq_len / P tokens of
each on this GPU; `e` is the bytes of the model's dtype, `w` of the ring's working dtype (float32,
or float64 for float64 inputs).

What the ring keeps for its backward (`saved_bytes`): this GPU's q, k, v, its float32 output and
its log-sum-exp (`ringcheck.ring.function.RingFunction` saves the float32 output, not the one it
returns in the model's dtype). What it holds while it runs (`call_peak`), step by step:

- forward: the float32 running output and its row statistics; the K/V block it computes with
  (from step 1 on, the buffer it received), the copy it is sending and the buffer it is
  receiving into (`ringcheck.ring.comm`: one packed buffer each way per exchange);
- backward: the float32 output, lse and delta; the float32 dq accumulator; the K/V blocks as in
  the forward; the float32 dK/dV accumulators that travel with them (the pair it adds into, and
  from step 1 on the pair it is sending and the pair it is receiving);
- the block kernel's own tensors for the block of that step (`KERNELS`: flash-attn 2's, ringcheck's
  torch backend on the CPU (its fused path) and on CUDA (its plain path, by tiles of query rows)).

The peak of one attention call is the largest of these sums over the steps of both passes.
"""

from __future__ import annotations

from dataclasses import dataclass

CAUSAL_DIAGONAL = 0.5  # the share of a square block's work under the causal mask (n (n + 1) / 2 of n^2)
BACKWARD_WORK = 2.5    # a flash backward's matmuls per forward matmul: QK^T again, dV, dP, dQ, dK (5 of 2)


@dataclass(frozen=True)
class Block:
    q_rows: int
    kv_rows: int
    work: float   # the share of a q_rows x kv_rows block that is computed (causal diagonal: 1/2)

    def pairs(self) -> float:
        return self.q_rows * self.kv_rows * self.work


def blocks_at(layout: str, causal: bool, n: int, step: int) -> list[Block]:
    """The blocks a rank computes at ring `step`, one entry per kind of rank (the busiest first);
    the table `ringcheck.ring.layouts.block_plan` follows for ringcheck's layouts."""
    full, diagonal = Block(n, n, 1.0), Block(n, n, CAUSAL_DIAGONAL)
    if step == 0 or not causal:
        return [diagonal if causal else full]
    if layout == "zigzag":  # the earlier rank's K/V first half, or this rank's second half of queries
        return [Block(n, n // 2, 1.0), Block(n // 2, n, 1.0)]
    if layout == "striped":  # every rank: a square block under a causal mask (diagonal 0 or -1)
        return [diagonal]
    return [full, Block(0, 0, 0.0)]  # contiguous: a full block on the ranks after the source, none before it


def step_blocks(layout: str, causal: bool, world_size: int, n: int) -> list[list[Block]]:
    """`blocks_at` for every step of a ring of `world_size`."""
    return [blocks_at(layout, causal, n, step) for step in range(world_size)]


def busiest_pairs(layout: str, causal: bool, world_size: int, n: int) -> list[float]:
    return [max(b.pairs() for b in blocks) for blocks in step_blocks(layout, causal, world_size, n)]


@dataclass(frozen=True)
class Shape:
    """The attention one GPU runs: `batch` sequences, `n` tokens each, A heads, K kv heads, D."""

    batch: int
    n: int
    heads: int
    kv_heads: int
    head_dim: int
    e: int            # bytes per element of q, k, v and the output
    w: int = 4        # the ring's working dtype

    def q(self, rows: int | None = None, size: int | None = None) -> int:
        return self.batch * (self.n if rows is None else rows) * self.heads * self.head_dim * (size or self.w)

    def kv_block(self) -> int:
        """One K/V payload on the wire: this GPU's k and v."""
        return 2 * self.batch * self.n * self.kv_heads * self.head_dim * self.e

    def grad_block(self) -> int:
        """One dK/dV accumulator payload (working dtype) with its 16-byte origin tag."""
        return 2 * self.batch * self.n * self.kv_heads * self.head_dim * self.w + 16

    def rows(self, rows: int | None = None) -> int:
        """Bytes of one working-dtype value per head and query row (lse, delta, m, l)."""
        return self.batch * self.heads * (self.n if rows is None else rows) * self.w


def _torch_cpu(shape: Shape, block: Block, backward: bool) -> int:
    """ringcheck's CPU backend (`ringcheck.ring.backends.torch_backend`, the fused path): its
    float32 heads-first copies of q, k, v (K/V repeated over each group's query heads) and its
    outputs; the backward also copies dout and builds an out with dout's row sums."""
    q, kv = shape.q(block.q_rows), shape.q(block.kv_rows)
    if backward:  # dout, q, out*, dq  +  k, v, dk, dv (query heads)  +  lse, delta, |dout|^2, its quotient
        return 4 * q + 4 * kv + 4 * shape.rows(block.q_rows)
    return 2 * q + 2 * kv + shape.rows(block.q_rows)  # q, out  +  k, v  +  lse


def _flash_attn2(shape: Shape, block: Block, backward: bool) -> int:
    """flash-attn 2 (`flash_attn_interface._flash_attn_backward`): dq, dk, dv in the model's
    dtype (dk, dv over the query heads before a grouped sum), its float32 dq accumulator and
    softmax_d; the forward's block output and lse, and the ring's float32 copy of that output
    for its merge."""
    q, kv = shape.q(block.q_rows, shape.e), shape.q(block.kv_rows, shape.e)
    if backward:
        grouped = 2 * kv * shape.kv_heads // shape.heads if shape.kv_heads < shape.heads else 0
        return q + 2 * kv + grouped + shape.q(block.q_rows, 4) + shape.rows(block.q_rows)
    return q + shape.q(block.q_rows) + shape.rows(block.q_rows)


ROW_TILE_BYTES = 128 * 2**20  # = ringcheck.ring.backends.torch_backend.ROW_TILE_BYTES (a test holds them equal)


def _torch_cuda(shape: Shape, block: Block, backward: bool, tile_bytes: int = ROW_TILE_BYTES) -> int:
    """ringcheck's torch backend on CUDA: its plain path (`--backend torch_plain` anywhere),
    which runs a block's query rows a tile at a time. Its float32 copies of the inputs, the
    block's output (dq in the backward, with the dK/dV accumulators and a tile's dV); at the
    worst moment of a tile, two float32 score tiles of at most `tile_bytes` each (the scores
    and logsumexp's shifted copy; the probabilities and dP), or one and a K/V block repeated
    over each group's query heads for a matmul (dK before its sum over the group). A softcap
    holds its tanh as one tile more; this counts none."""
    row = shape.batch * shape.heads * block.kv_rows * shape.w       # one query row's scores
    tile = min(block.q_rows, max(1, tile_bytes // max(row, 1))) * row
    q, kv = shape.q(block.q_rows), shape.q(block.kv_rows)           # kv: over the query heads
    kv_heads = kv * shape.kv_heads // shape.heads
    grouped = kv if shape.kv_heads < shape.heads else 0             # K or V repeated for a matmul
    if backward:  # copies of q, dout, k, v; dq; dk, dv and a tile's dv
        return 2 * q + 2 * kv_heads + q + 3 * kv_heads + max(2 * tile + grouped, tile + kv)
    return q + 2 * kv_heads + max(q + max(2 * tile, tile + grouped), 2 * q) + shape.rows(block.q_rows)


KERNELS = {"flash-attn2": _flash_attn2, "torch-cpu": _torch_cpu, "torch-cuda": _torch_cuda}


def saved_bytes(shape: Shape) -> int:
    """What the ring keeps from its forward for its backward (module docstring)."""
    inputs = shape.batch * shape.n * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * shape.e
    return inputs + shape.q() + shape.rows()


def call_peak(shape: Shape, *, layout: str, causal: bool, world_size: int, kernel: str,
              row_tile_bytes: int = ROW_TILE_BYTES) -> dict[str, int]:
    """The peak bytes one attention call (forward and backward) holds beyond its inputs, and at
    which moment: {"bytes", "pass", "step", "kv_buffers", "grad_buffers", "kernel", "kept"}.
    `kept`: the float32 output, lse, delta and dq accumulator (and the returned output where
    it is a copy in another dtype), alive through the backward. `row_tile_bytes`: the torch-cuda
    kernel's score tile (`TorchBackend(row_tile_bytes=...)`)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is unknown; choose one of {', '.join(KERNELS)}")
    workspace = KERNELS[kernel]
    if kernel == "torch-cuda":
        def workspace(shape, block, backward):
            return _torch_cuda(shape, block, backward, row_tile_bytes)
    last = world_size - 1
    returned = shape.q(size=shape.e) if shape.e != shape.w else 0
    best: dict[str, int] = {"bytes": -1}
    for step in sorted({0, min(1, last), last}):  # the first, a steady and the last step: the others repeat it
        blocks = blocks_at(layout, causal, shape.n, step)
        kv = (shape.kv_block() if step else 0) + (2 * shape.kv_block() if step < last else 0)
        for backward in (False, True):
            if backward:
                kept = 2 * shape.q() + 2 * shape.rows() + returned
                grads = shape.grad_block() + (2 * shape.grad_block() if step else 0)
            else:  # the running output and (m, l), and a merge's new rows for one block
                kept, grads = shape.q() + 2 * shape.rows(), 0
            ws = max(workspace(shape, b, backward) + (0 if backward else shape.q(b.q_rows)) for b in blocks)
            total = kept + kv + grads + ws
            if total > best["bytes"]:
                best = {"bytes": total, "pass": int(backward), "step": step, "kv_buffers": kv,
                        "grad_buffers": grads, "kernel": ws, "kept": kept}
    return best


def attention_flops(shape: Shape, *, layout: str, causal: bool, world_size: int) -> list[float]:
    """Forward FLOPs of the busiest rank per ring step (4 per query-key pair per head dim: QK^T
    and PV); the backward does `BACKWARD_WORK` times these."""
    return [4.0 * shape.batch * pairs * shape.heads * shape.head_dim
            for pairs in busiest_pairs(layout, causal, world_size, shape.n)]


def hiding_length(shape: Shape, *, work: float, backward: bool, flops_per_s: float, bytes_per_s: float) -> float:
    """The fewest tokens per GPU (n = seq_len / P) at which a steady ring step's compute takes as
    long as its transfer (communication grows as n, compute as n^2); `work` is the busiest rank's
    share of a full n x n block per step (balanced causal: 1/2). For multi-head attention,
    non-causal, bf16, forward, it is F / B: the Ring Attention paper's condition (Liu et al.
    2023, section 3: block size c >= F / B)."""
    per_token_bytes = 2 * shape.batch * shape.kv_heads * shape.head_dim * (shape.e + (shape.w if backward else 0))
    per_pair_flops = 4 * shape.batch * shape.heads * shape.head_dim * work * (BACKWARD_WORK if backward else 1)
    return per_token_bytes / per_pair_flops * flops_per_s / bytes_per_s
