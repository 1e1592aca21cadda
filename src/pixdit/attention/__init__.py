"""Attention backends: the swappable attention of every DiT layer, selected with ``attention=<name>``.

    base.py   AttentionBackend (the interface), the name registry, build_attention(cfg, dim, num_heads)
    full.py   `full`: dense softmax attention (SDPA or our Triton kernel)
    llsa.py   `llsa`: Log-linear Sparse Attention
    vsa.py    `vsa`: Video Sparse Attention on 2-D tiles
    sla.py    `sla`: Sparse-Linear Attention
    variants.py  `NAME[:KEY=VALUE,...]` variants of the benchmark scripts (parse_variant)

Each backend is one class and one config file (`configs/attention/<name>.yaml`); importing this package registers
them all. `attention.dense_blocks` keeps full attention in the listed blocks of the model (block_attention_configs). The methods are described in docs/algorithms.md, the interface in docs/architecture.md.
"""

from pixdit.attention.base import (
    AttentionBackend,
    attention_class,
    attention_names,
    attention_options,
    block_attention_configs,
    build_attention,
    register_attention,
)
from pixdit.attention.full import FullAttention
from pixdit.attention.llsa import LLSAAttention
from pixdit.attention.sla import SLAAttention
from pixdit.attention.vsa import VSAAttention, vsa_annealed_topk

__all__ = [
    "AttentionBackend",
    "FullAttention",
    "LLSAAttention",
    "SLAAttention",
    "VSAAttention",
    "attention_class",
    "attention_names",
    "attention_options",
    "block_attention_configs",
    "build_attention",
    "register_attention",
    "vsa_annealed_topk",
]
