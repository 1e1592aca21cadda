"""Dense PyTorch oracles of the sparse-attention methods (tests and diagnostics; small sizes only)."""
from .llsa import llsa_block_mean, llsa_dense, llsa_hier_topk, llsa_rank_topk
