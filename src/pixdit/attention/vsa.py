"""`vsa`: Video Sparse Attention on 2-D tiles, a thin wrapper over `pixdit.kernels.vsa_attention`.

    python train.py experiment=ffhq128_vsa attention.topk=16

What it computes and what the knobs mean: docs/algorithms.md ("VSA").
"""

from __future__ import annotations

import torch

from pixdit.attention.base import (
    AttentionBackend,
    check_kernel_options,
    check_one_of_topk,
    register_attention,
    uninitialized_linear,
)
from pixdit.errors import PixditError
from pixdit.kernels import vsa_attention
from pixdit.kernels.common import HEAD_DIMS, num_blocks, resolve_topk, topk_from_fraction


def vsa_annealed_topk(step: int, num_tiles: int, target_topk: int, anneal_every: int, anneal_rate: float) -> int:
    """Dense-to-sparse schedule for fine-tuning a dense checkpoint (the authors' rule): the share of tiles dropped
    grows by ``anneal_rate`` every ``anneal_every`` steps from 0 (all tiles) until the target K is reached.
    ``anneal_every = 0``: the target K from step 0."""
    if anneal_every <= 0:
        return target_topk
    dropped = min(1.0, (step // anneal_every) * anneal_rate)
    return max(target_topk, topk_from_fraction(1.0 - dropped, num_tiles))


@register_attention("vsa")
class VSAAttention(AttentionBackend):
    """Coarse attention between tile means + exact fine attention to the top-K tiles of each query tile,
    output = fine + gate * coarse.

    block_size (C):  tokens per tile (16 = 4x4 pixels in Z-order; 16, 32 or 64)
    topk (K):        key tiles kept per query tile (clamped to the number of tiles); or
    topk_ratio:      instead of topk, the share of tiles kept: K = clamp(ceil(topk_ratio * T), 1, T)
    gate:            true = G_c = Linear(dim, dim) of the modulated hidden states, zero-initialised (VSA starts as
                     its fine stage); false = coarse output added ungated
    fine_gate:       true = also the paper's G_f = Linear(dim, dim) on the fine output, W = 0 and b = 1 (starts as
                     no gate; experimental: the paper gives no init, the authors' production code drops it);
                     false (default) = G_f = 1
    anneal_every, anneal_rate: dense-to-sparse schedule for fine-tuning a dense checkpoint: the share of tiles dropped
                     grows by anneal_rate every anneal_every optimizer steps from 0 (dense) to the target K;
                     anneal_every = 0 (default) = target K from step 0. Needs the training loop to call
                     ``set_training_step(global_step)`` on the backend (the step is stored in the state dict).
    """

    token_order = "zorder"
    head_dims = HEAD_DIMS
    renamed_options = {"sparsity": "topk_ratio = 1 - sparsity (the share of tiles kept)"}

    def __init__(
        self,
        dim: int,
        num_heads: int,
        block_size: int = 16,
        topk: int | None = 32,
        topk_ratio: float | None = None,
        gate: bool = True,
        anneal_every: int = 0,
        anneal_rate: float = 0.02,
        fine_gate: bool = False,
    ):
        super().__init__(dim, num_heads)
        self.block_size, self.topk, self.topk_ratio = block_size, topk, topk_ratio
        check_one_of_topk("vsa", topk, topk_ratio)
        check_kernel_options(
            "vsa",
            self.head_dim,
            block_size,
            lambda x: vsa_attention(x, x, x, block_size=block_size, topk=topk, topk_ratio=topk_ratio),
        )
        if isinstance(anneal_every, bool) or not isinstance(anneal_every, int) or anneal_every < 0:
            raise PixditError(
                f"attention=vsa: anneal_every must be an int >= 0 (0 = no annealing), got {anneal_every!r}"
            )
        if not isinstance(anneal_rate, (int, float)) or not 0 < anneal_rate <= 1:
            raise PixditError(f"attention=vsa: anneal_rate must be a float in (0, 1], got {anneal_rate!r}")
        self.anneal_every, self.anneal_rate = anneal_every, float(anneal_rate)
        for name, value in (("gate", gate), ("fine_gate", fine_gate)):
            if not isinstance(value, bool):
                raise PixditError(f"attention=vsa: {name} must be true or false, got {value!r}")
        self.gate = uninitialized_linear(dim, dim) if gate else None
        self.fine_gate = uninitialized_linear(dim, dim) if fine_gate else None
        self.register_buffer("training_step", torch.zeros((), dtype=torch.long))
        # the tile means of q, k, v from the model's prologue, as LLSA's (only for C = 16: see LLSAAttention)
        self.pool_block = 16 if block_size == 16 else None
        self._step_was_set = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """G_c starts at 0 (VSA = its fine stage), G_f at the identity (W = 0, b = 1)."""
        with torch.no_grad():
            for projection, bias in ((self.gate, 0.0), (self.fine_gate, 1.0)):
                if projection is not None:
                    projection.weight.zero_()
                    projection.bias.fill_(bias)

    def set_training_step(self, step: int) -> None:
        """The optimizer step that drives the annealing schedule (call once per training step)."""
        self.training_step.fill_(int(step))
        self._step_was_set = True

    def current_topk(self, num_tokens: int) -> int:
        num_tiles = num_blocks(num_tokens, self.block_size)
        target = min(self.topk, num_tiles) if self.topk is not None else topk_from_fraction(self.topk_ratio, num_tiles)
        if self.anneal_every and self.training and not self._step_was_set:
            raise PixditError(
                "attention=vsa with anneal_every > 0 needs the training loop to call "
                "set_training_step(global_step) on the attention backends"
            )
        if not self.anneal_every:
            return target  # without annealing, do not read the step buffer (a GPU sync in every layer's forward)
        return vsa_annealed_topk(int(self.training_step), num_tiles, target, self.anneal_every, self.anneal_rate)

    def tokens_per_query(self, num_tokens: int) -> float:
        """Fine stage: the target K tiles' tokens; coarse stage: T pooled queries x T pooled keys (T tiles), i.e.
        T^2 / N per token."""
        num_tiles = num_blocks(num_tokens, self.block_size)
        return float(resolve_topk(num_tiles, self.topk, self.topk_ratio) * self.block_size + num_tiles**2 / num_tokens)

    def forward(self, q, k, v, *, grid_hw, hidden, means=None):
        b, h, n, d = q.shape

        def per_head(projection):  # [b, N, dim] -> [b, heads, N, head_dim], no activation
            return None if projection is None else projection(hidden).view(b, n, h, d).transpose(1, 2).to(q.dtype)

        return vsa_attention(
            q,
            k,
            v,
            block_size=self.block_size,
            topk=self.current_topk(n),
            gate=per_head(self.gate),
            gate_fine=per_head(self.fine_gate),
            means=means,
        )

    def extra_repr(self) -> str:
        return (
            f"block_size={self.block_size}, topk={self.topk}, topk_ratio={self.topk_ratio}, "
            f"gate={self.gate is not None}, fine_gate={self.fine_gate is not None}, "
            f"anneal_every={self.anneal_every}"
        )
