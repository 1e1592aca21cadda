"""pixdit.kernels: sparse-attention kernels (Triton on CUDA, exact PyTorch on CPU). Imports only torch and triton.

    from pixdit.kernels import llsa_attention
    o = llsa_attention(q, k, v, block_size=16, topk=8)      # q, k, v: [batch, heads, tokens, head_dim]
"""
from .block_sparse import block_sparse_attention, flash_attention
from .blocks import block_mean, csr_to_csc, topk_desc
from .llsa import llsa_attention, llsa_check, llsa_num_levels, llsa_select
from .sla import sla_attention, sla_select  # noqa: F401  (SLA: top-K sparse + linear attention)
from .vsa import vsa_attention, vsa_select  # noqa: F401  (VSA: coarse + top-K block-sparse fine attention)
