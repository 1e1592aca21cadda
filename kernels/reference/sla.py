"""Dense PyTorch oracle of SLA (Sparse-Linear Attention, docs/algorithms.md) — for tests and diagnostics only.

fp32 throughout with explicit ``N x N`` token masks (O(N²) memory: keep ``N`` to a few thousand). It shares no code
with ``pixdit.kernels.sla`` on purpose. Query and key blocks are both ``block_size`` consecutive tokens; a partial
last block holds the remaining ``N mod block_size`` tokens.

    from pixdit.kernels.reference import sla_reference
    o_sparse, o_linear = sla_reference(q, k, v, block_size=16, topk=4, linear_scope="noncritical")
    out = o_sparse + o_linear @ W.T + b          # the layer's Proj

Linear-branch denominators (our definition; the paper leaves it open): ``linear_scope="all"`` adds ``1e-5`` like the
authors' current code; the other scopes return 0 for a row whose denominator is exactly 0 (no linear keys, or a relu
feature map that vanishes on all of them) instead of the authors' 0/0 = NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALL_SCOPE_EPS = 1e-5


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 math (fp64 inputs stay fp64, for gradcheck-grade comparisons)."""
    return x if x.dtype == torch.float64 else x.float()


def reference_feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi applied along the head dimension: ``softmax``, ``elu`` (elu + 1) or ``relu``."""
    if name == "softmax":
        return torch.softmax(x, -1)
    if name == "elu":
        return F.elu(x) + 1.0
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"feature_map must be 'softmax', 'elu' or 'relu', got {name!r}")


def _block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    block = torch.arange(x.shape[2], device=x.device) // block_size
    membership = F.one_hot(block).to(x.dtype)  # [N, T]
    return (membership.t() @ x) / membership.sum(0)[:, None]


def sla_reference_scores(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-classification scores (smooth-K form, no scale) -> ``[B, H, T, T]`` fp32."""
    q, k = _upcast(q), _upcast(k)
    k_smooth = k - k.mean(2, keepdim=True)
    return _block_mean(q, block_size) @ _block_mean(k_smooth, block_size).transpose(-1, -2)


def sla_reference(
    q,
    k,
    v,
    block_size: int,
    topk: int,
    linear_scope: str = "noncritical",
    feature_map: str = "softmax",
    num_negligible: int = 0,
    scale: float | None = None,
    crit_idx=None,
):
    """Returns ``(o_sparse, o_linear)`` in fp32, both differentiable in q, k, v (o_linear also through phi).

    ``topk`` critical key blocks per query block (clamped to [1, T]); ``num_negligible`` blocks with the lowest
    scores are skipped in ``linear_scope="marginal"`` (ties toward the larger id). ``crit_idx [B, H, T, K]`` forces the
    critical blocks (e.g. the kernel's own selection).
    """
    if linear_scope not in ("noncritical", "all", "marginal"):
        raise ValueError(f"linear_scope must be 'noncritical', 'all' or 'marginal', got {linear_scope!r}")
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    block = torch.arange(n, device=q.device) // block_size
    num_blocks = int(block[-1]) + 1

    with torch.no_grad():
        order = torch.sort(sla_reference_scores(q, k, block_size), dim=-1, descending=True, stable=True).indices
        if crit_idx is None:
            crit_idx = order[..., : min(max(int(topk), 1), num_blocks)]
        critical = torch.zeros(b, h, num_blocks, num_blocks, dtype=torch.bool, device=q.device)
        critical.scatter_(-1, crit_idx.long(), True)
        negligible = torch.zeros_like(critical)
        if linear_scope == "marginal" and num_negligible > 0:
            negligible.scatter_(-1, order[..., num_blocks - num_negligible :], True)
            if (negligible & critical).any():
                raise ValueError("critical and negligible blocks overlap: topk + num_negligible > number of blocks")
        critical_tok = critical[:, :, block][:, :, :, block]  # [B, H, N, N]
        if linear_scope == "all":
            linear_tok = torch.ones_like(critical_tok)
        else:
            linear_tok = ~(critical | negligible)[:, :, block][:, :, :, block]

    logits = (scale * q @ k.transpose(-1, -2)).masked_fill(~critical_tok, float("-inf"))
    o_sparse = torch.softmax(logits, -1) @ v

    phi_q, phi_k = reference_feature_map(q, feature_map), reference_feature_map(k, feature_map)
    weights = (phi_q @ phi_k.transpose(-1, -2)) * linear_tok
    numerator, denominator = weights @ v, weights.sum(-1, keepdim=True)
    if linear_scope == "all":
        o_linear = numerator / (denominator + ALL_SCOPE_EPS)
    else:
        nonzero = denominator > 0
        o_linear = torch.where(
            nonzero,
            numerator / torch.where(nonzero, denominator, torch.ones_like(denominator)),
            torch.zeros_like(numerator),
        )
    return o_sparse, o_linear
