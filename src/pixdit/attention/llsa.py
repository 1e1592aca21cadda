"""`llsa`: Log-linear Sparse Attention, a thin wrapper over `pixdit.kernels.llsa_attention`.

    python train.py experiment=ffhq256_llsa attention.topk=16 attention.num_levels=2

What it computes and what the knobs mean: docs/algorithms.md ("LLSA").
"""

from __future__ import annotations

from pixdit.attention.base import AttentionBackend, register_attention
from pixdit.errors import PixditError
from pixdit.kernels import llsa_attention, llsa_check
from pixdit.kernels.common import HEAD_DIMS


@register_attention("llsa")
class LLSAAttention(AttentionBackend):
    """Hierarchical top-K block selection + KV enrichment (Triton on CUDA, exact PyTorch gather form on CPU).

    block_size (B):     tokens pooled per level (16 = 4x4 pixel patches in Z-order); a power of two >= 16
    topk (K):           blocks kept per query block at every level (an int, or a list, one per level, finest first)
    num_levels (L):     pooled levels; null = paper formula floor(log_B N - 1) (clamped to >= 1) for each grid
    enrich_levels (Le): pooled levels 1..Le whose tokens enter the softmax; null = all L levels, 0 = none
    reference_l1_grad:  reproduce the authors' l1 kernel's pooled-K/V gradient, B times too small (L = 1 only)
    """

    token_order = "zorder"
    head_dims = HEAD_DIMS
    # Without autograd, the forward reads v from the qkv projection's output (a strided view), so the prologue does
    # not copy it (docs/kernel_notes.md v34)
    reads_v_view = True

    def __init__(
        self,
        dim: int,
        num_heads: int,
        block_size: int = 16,
        topk: int | list[int] = 8,
        num_levels: int | None = None,
        enrich_levels: int | None = None,
        reference_l1_grad: bool = False,
    ):
        super().__init__(dim, num_heads)
        self.block_size = block_size
        self.topk = list(topk) if isinstance(topk, (list, tuple)) else topk
        self.num_levels = num_levels
        self.enrich_levels = enrich_levels
        self.reference_l1_grad = bool(reference_l1_grad)
        # The selection and the pooled bank start from q, k, v's block means: the model's prologue writes them. Only
        # for B = 16, the measured case (docs/kernel_notes.md v20): the kernel sums a block of 16 inside one warp,
        # while a larger block spans warps and is summed through shared memory, which made the kernel 2.3x slower.
        self.pool_block = 16 if block_size == 16 else None

    def plan(self, num_tokens: int) -> dict:
        """pixdit.kernels.llsa_check with this backend's settings: the levels, K per level and tokens per query."""
        return llsa_check(
            num_tokens,
            block_size=self.block_size,
            num_levels=self.num_levels,
            topk=self.topk,
            enrich_levels=self.enrich_levels,
        )

    def check_grid(self, grid_hw):
        num_tokens = grid_hw[0] * grid_hw[1]
        try:
            self.plan(num_tokens)
        except (ValueError, TypeError) as error:
            raise PixditError(
                f"attention=llsa cannot handle a {grid_hw[0]}x{grid_hw[1]} token grid ({num_tokens} tokens): {error}"
            ) from None

    def tokens_per_query(self, num_tokens: int) -> float:
        """Fine keys of the K selected blocks + the pooled tokens of the enriched levels (pixdit.kernels.llsa_check)."""
        return float(self.plan(num_tokens)["tokens_per_query"])

    def forward(self, q, k, v, *, grid_hw, hidden, means=None):
        return llsa_attention(
            q,
            k,
            v,
            means=means,
            block_size=self.block_size,
            topk=self.topk,
            num_levels=self.num_levels,
            enrich_levels=self.enrich_levels,
            reference_l1_grad=self.reference_l1_grad,
        )

    def extra_repr(self) -> str:
        return (
            f"block_size={self.block_size}, topk={self.topk}, num_levels={self.num_levels}, "
            f"enrich_levels={self.enrich_levels}"
        )
