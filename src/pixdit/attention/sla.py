"""`sla`: Sparse-Linear Attention, a thin wrapper over `pixdit.kernels.sla_attention` plus the layer's projection.

    python train.py experiment=ffhq128_sla attention.linear_scope=all

What it computes and what the knobs mean: docs/algorithms.md ("SLA").
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
from pixdit.kernels import sla_attention
from pixdit.kernels.common import HEAD_DIMS, num_blocks, resolve_topk


@register_attention("sla")
class SLAAttention(AttentionBackend):
    """Exact softmax attention over the top-K ("critical") key blocks + linear attention over the rest, output =
    O_sparse + Proj(O_linear) with Proj a Linear(head_dim, head_dim) shared across heads, zero-initialised (SLA
    starts as block-sparse attention).

    block_size:        tokens per block for queries and keys (16 = 4x4 pixels in Z-order; 16, 32 or 64)
    topk (K):          critical key blocks per query block (clamped to the number of blocks); or
    topk_ratio:        instead of topk, the share of blocks kept: K = clamp(ceil(topk_ratio * T), 1, T)
    linear_scope:      noncritical (the authors' first code, default) | all (their current code) | marginal (paper)
    feature_map:       softmax (default) | elu (elu + 1) | relu
    negligible_ratio:  marginal scope only: the fraction of lowest-scoring blocks skipped entirely
    """

    token_order = "zorder"
    head_dims = HEAD_DIMS

    def __init__(
        self,
        dim: int,
        num_heads: int,
        block_size: int = 16,
        topk: int | None = 32,
        topk_ratio: float | None = None,
        linear_scope: str = "noncritical",
        feature_map: str = "softmax",
        negligible_ratio: float = 0.0,
    ):
        super().__init__(dim, num_heads)
        check_one_of_topk("sla", topk, topk_ratio)
        self.options = dict(
            block_size=block_size,
            topk=topk,
            topk_ratio=topk_ratio,
            linear_scope=linear_scope,
            feature_map=feature_map,
            negligible_ratio=negligible_ratio,
        )
        check_kernel_options("sla", self.head_dim, block_size, lambda x: sla_attention(x, x, x, **self.options))
        # the selection's block means of q and k from the model's prologue, as LLSA's (only for C = 16: see
        # LLSAAttention)
        self.pool_block = 16 if block_size == 16 else None
        self.proj_linear = uninitialized_linear(self.head_dim, self.head_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Proj starts at 0: SLA = its sparse branch."""
        with torch.no_grad():
            self.proj_linear.weight.zero_()
            self.proj_linear.bias.zero_()

    def tokens_per_query(self, num_tokens: int) -> float:
        """Sparse branch: the K critical blocks' tokens; linear branch: phi(K)^T V and phi(Q) (KV), 4 N d^2 FLOPs per
        head = head_dim keys per query in the dense formula."""
        num_tiles = num_blocks(num_tokens, self.options["block_size"])
        topk = resolve_topk(num_tiles, self.options["topk"], self.options["topk_ratio"])
        return float(topk * self.options["block_size"] + self.head_dim)

    def forward(self, q, k, v, *, grid_hw, hidden, means=None):
        o_sparse, o_linear = sla_attention(q, k, v, **self.options, means=means)
        # fp32 master weights; under autocast F.linear runs in the autocast dtype
        projected = self.proj_linear(
            o_linear if torch.is_autocast_enabled(o_linear.device.type) else o_linear.to(self.proj_linear.weight.dtype)
        )
        return o_sparse + projected.to(o_sparse.dtype)

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.options.items())
