"""Dense PyTorch oracles of the sparse-attention methods (tests and diagnostics; small sizes only)."""
from .llsa import llsa_block_mean, llsa_dense, llsa_hier_topk, llsa_rank_topk
from .sla import sla_reference, sla_reference_scores  # noqa: F401  (dense SLA oracle)
from .vsa import vsa_reference, vsa_reference_scores  # noqa: F401  (dense VSA oracle)
