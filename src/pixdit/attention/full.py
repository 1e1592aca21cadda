"""`full`: dense softmax attention over all tokens, in any token order.

python train.py experiment=quickstart attention=full attention.kernel=triton
"""

from __future__ import annotations

import torch.nn.functional as F

from pixdit.attention.base import AttentionBackend, check_head_dim, register_attention
from pixdit.errors import PixditError
from pixdit.kernels import flash_attention
from pixdit.kernels.common import HEAD_DIMS

FULL_ATTENTION_KERNELS = ("sdpa", "triton")


@register_attention("full")
class FullAttention(AttentionBackend):
    """Dense softmax attention (scale 1/sqrt(head_dim)).

    kernel: "sdpa"   torch.nn.functional.scaled_dot_product_attention (FlashAttention / cuDNN / efficient on GPU)
            "triton" pixdit.kernels.flash_attention (our block-sparse kernels with every key attended: the
                     like-for-like baseline of the sparse methods)
    """

    renamed_options = {"impl": "kernel (sdpa | triton)"}

    def __init__(self, dim: int, num_heads: int, kernel: str = "sdpa"):
        super().__init__(dim, num_heads)
        if kernel not in FULL_ATTENTION_KERNELS:
            raise PixditError(
                f"attention.kernel={kernel!r} is not known; allowed values: {', '.join(FULL_ATTENTION_KERNELS)}"
            )
        self.kernel = kernel
        if kernel == "triton":
            check_head_dim("full attention.kernel=triton", dim, num_heads, HEAD_DIMS)

    def forward(self, q, k, v, *, grid_hw, hidden):
        if self.kernel == "triton":
            return flash_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}"
