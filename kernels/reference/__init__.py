"""Dense PyTorch oracles of the sparse-attention methods (tests and diagnostics; small sizes only)."""

from .llsa import llsa_block_mean, llsa_dense, llsa_hier_topk, llsa_rank_topk
from .sla import sla_reference, sla_reference_scores  # dense SLA oracle
from .vsa import vsa_reference, vsa_reference_scores  # dense VSA oracle

__all__ = [
    "llsa_block_mean",
    "llsa_dense",
    "llsa_hier_topk",
    "llsa_rank_topk",
    "sla_reference",
    "sla_reference_scores",
    "vsa_reference",
    "vsa_reference_scores",
]
