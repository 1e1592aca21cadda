"""pixdit.kernels: sparse-attention kernels (Triton on CUDA, exact PyTorch on CPU). Imports only torch and triton.

    from pixdit.kernels import llsa_attention
    o = llsa_attention(q, k, v, block_size=16, topk=8)      # q, k, v: [batch, heads, tokens, head_dim]

torch.compile: every kernel launcher is a torch custom op (``torch.ops.pixdit.*``, with a fake-tensor rule and its
mutated arguments declared), opaque to the compiler; everything around the launches (pooling, selection tables, CSC
transposes, layout changes, the autograd Functions) is traced, so a model with any backend compiles as one graph
(``fullgraph=True``) and Inductor fuses that glue with the model's own elementwise work. Opaque rather than traced
into: Dynamo would hand the Triton kernels to Inductor, which types their float arguments as fp64 and fails to build
them (torch 2.11), and their host logic (autotuning, routing between selection paths) is not traceable.
"""

from .block_sparse import block_sparse_attention, flash_attention
from .blocks import block_mean, csr_to_csc, topk_desc
from .llsa import llsa_attention, llsa_check, llsa_num_levels, llsa_select
from .qk_norm_rope import qk_norm_rope  # the attention prologue: qk-norm + RoPE + head layout
from .sla import sla_attention, sla_select  # SLA: top-K sparse + linear attention
from .vsa import vsa_attention, vsa_select  # VSA: coarse + top-K block-sparse fine attention

__all__ = [
    "block_sparse_attention",
    "flash_attention",
    "block_mean",
    "csr_to_csc",
    "topk_desc",
    "llsa_attention",
    "llsa_check",
    "llsa_num_levels",
    "llsa_select",
    "qk_norm_rope",
    "sla_attention",
    "sla_select",
    "vsa_attention",
    "vsa_select",
]
