"""SLA's linear-attention branch (spec ``/work/shared/spec/sla.md`` §7): feature maps and the block-masked form.

For a query ``t`` in query block ``i`` and the set ``L(i)`` of key blocks in its linear set:

    O_l[t] = phi(q_t) . H_i / phi(q_t) . Z_i,   H_i = sum_{j in L(i)} phi(K_j)^T V_j  (D x D),  Z_i = sum_j phi(K_j)^T 1

``linear_scope="all"`` uses every key (``L(i)`` = all blocks) and adds ``1e-5`` to the denominator like the authors'
current code; otherwise a row whose denominator is exactly 0 (empty linear set, or relu features that vanish on all its
keys) gets ``O_l = 0`` with zero gradient, where the authors' SLA-1 kernel returns 0/0 = NaN.
Cost: ``O(N * D^2)`` for the per-block ``h_j`` and the output, plus ``O(T^2 * D^2)`` for the masked block sums of the
``noncritical``/``marginal`` scopes (the exact CPU form below sums the kept blocks directly: no cancellation).

    from pixdit.kernels.linear_attention import linear_attention_torch
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .vsa import pad_to_blocks

FEATURE_MAPS = ("softmax", "elu", "relu")
ALL_SCOPE_EPS = 1e-5


def feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi along the head dimension: ``softmax``, ``elu`` (= elu(x) + 1, strictly positive) or ``relu``."""
    if name == "softmax":
        return torch.softmax(x, -1)
    if name == "elu":
        return F.elu(x) + 1.0
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {name!r}")


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where the denominator is non-zero, else 0 (and zero gradient, never NaN)."""
    nonzero = denominator != 0
    safe = torch.where(nonzero, denominator, torch.ones_like(denominator))
    return torch.where(nonzero, numerator / safe, torch.zeros_like(numerator))


def linear_attention_torch(q, k, v, block_size: int, feature_map_name: str, excluded_idx=None) -> torch.Tensor:
    """Exact fp32 linear branch ``[B, H, N, D]``, differentiable in q, k, v (through phi).

    ``excluded_idx``: None for ``linear_scope="all"`` (every key, +1e-5 in the denominator), else an int tensor
    ``[B, H, T, E]`` of the key blocks each query block leaves out (its critical, and in ``marginal`` scope also its
    negligible, blocks).
    """
    b, h, n, d = q.shape
    phi_q = pad_to_blocks(feature_map(q.float(), feature_map_name), block_size)     # [B, H, T, C, D]
    phi_k = pad_to_blocks(feature_map(k.float(), feature_map_name), block_size)     # padded keys are 0 after phi
    v_blocks = pad_to_blocks(v.float(), block_size)
    t = phi_q.shape[2]
    if excluded_idx is None:
        kv_total = torch.einsum("bhtcd,bhtce->bhde", phi_k, v_blocks)               # [B, H, D, D]
        z_total = phi_k.sum((2, 3))                                                 # [B, H, D]
        numerator = phi_q @ kv_total[:, :, None]
        denominator = phi_q @ z_total[:, :, None, :, None] + ALL_SCOPE_EPS
        out = numerator / denominator
    else:
        kv_blocks = (phi_k.transpose(-1, -2) @ v_blocks).reshape(b, h, t, d * d)   # h_j, flattened
        z_blocks = phi_k.sum(3)                                                     # z_j
        kept = torch.ones(b, h, t, t, dtype=torch.bool, device=q.device)
        kept.scatter_(-1, excluded_idx.long(), False)
        kept = kept.float()                                                         # [B, H, T, T] block mask
        kv_rows = (kept @ kv_blocks).reshape(b, h, t, d, d)                         # H_i
        z_rows = kept @ z_blocks                                                    # Z_i
        numerator = phi_q @ kv_rows
        denominator = phi_q @ z_rows[..., None]
        out = safe_divide(numerator, denominator)
    return out.reshape(b, h, t * block_size, d)[:, :, :n]
