"""SLA — Sparse-Linear Attention (arXiv 2509.24006): top-K softmax + linear attention on the rest.

    from pixdit.kernels import sla_attention
    o_sparse, o_linear = sla_attention(q, k, v, block_size=16, topk=32)     # [batch, heads, tokens, head_dim] each
    out = o_sparse + proj(o_linear)      # proj: the layer's zero-initialised Linear(head_dim, head_dim)

Why two outputs: ``Proj`` is a learnable parameter shared across heads and owned by the attention layer (fp32 master
weights under autocast, checkpointed with the model); keeping it out of the op keeps the op parameter-free and lets
plain autograd differentiate it. ``o_sparse + o_linear @ W.T + b`` is the method's output (docs/algorithms.md, "SLA").

Per (batch, head), with blocks = ``block_size`` consecutive tokens for queries and keys alike (the last block may be
partial: pooled over its real tokens, its missing keys masked):

1. classification scores ``mean(q_i) . mean(k_j - mean(k))`` (fp32, smooth-K); per query block the ``K`` key
   blocks with the largest scores are *critical* (ties toward the smaller block id);
2. ``o_sparse``: exact softmax attention (``scale``, default ``head_dim ** -0.5``) over the critical blocks;
3. ``o_linear``: linear attention ``phi(q) . sum phi(k)^T v / phi(q) . sum phi(k)`` over the keys chosen by
   ``linear_scope``: ``"noncritical"`` (default; the authors' SLA-1 code: every non-critical block), ``"all"`` (their
   current ``main``: all keys, ``+1e-5`` in the denominator) or ``"marginal"`` (the paper: non-critical blocks minus
   the ``floor(negligible_ratio * T)`` lowest-scoring ones, ties toward the larger id, capped at ``T - K``).
   A row whose linear denominator is 0 (no linear keys, or relu features that vanish) gets ``o_linear = 0``, never NaN.

K rule: exactly one of ``topk`` (int >= 1, clamped to ``T``) or ``topk_ratio`` (float in [0, 1],
``K = clamp(ceil(topk_ratio * T), 1, T)`` with the product rounded to 6 decimals first). The authors use
``int(topk_ratio * T)``, which can be 0 (NaN) and truncates ``0.29 * 100`` to 28. ``feature_map``: ``softmax``
(default), ``elu`` (elu + 1), ``relu``. ``block_size`` in {16, 32, 64}; ``head_dim`` in {16, 32, 64, 128}; any
number of tokens >= 1.

``impl="auto"``: CPU tensors run the exact PyTorch path (fp32 math, outputs in the input dtype); CUDA tensors the
Triton path (``sla_triton.py``): one autograd Function over the block-sparse FlashAttention (``block_sparse.py``)
and the linear branch's "global sums minus the excluded blocks" (``linear_attention.py``), whose dq kernel walks each
query block's critical list once for both branches, with deterministic key-major dk/dv passes over the CSC
transpose of the lists (no dense mask, no float atomics).
Tests: ``.venv/bin/python -m pytest tests/kernels/test_sla.py tests/kernels/test_sla_triton.py``.
"""

from __future__ import annotations

import math

import torch

from .block_sparse import block_sparse_attention
from .blocks import block_mean, block_means, exact_fp32_matmul
from .common import (
    autocast_inputs,
    check_block_size,
    check_means,
    check_qkv,
    check_selection,
    num_blocks,
    resolve_topk,
    select_topk_blocks,
    use_triton,
)
from .linear_attention import FEATURE_MAPS, linear_attention_torch
from .sla_triton import sla_triton

LINEAR_SCOPES = ("noncritical", "all", "marginal")


def _pooled_for_scores(
    q: torch.Tensor, k: torch.Tensor, block_size: int, triton_path: bool = False, means: torch.Tensor | None = None
):
    """fp32 ``mean(q_i)`` and smooth-K ``mean(k_j) - mean(k)`` (= ``mean(k_j - mean(k))``), ``[B, H, T, D]`` each.
    ``triton_path`` or ``means`` (checked block means of q, k, v): the block means by one kernel (``block_means``)
    or given, and ``mean(k)`` as their token-weighted mean, instead of three PyTorch reductions over the tokens (the
    same values up to fp32 summation order; ``mean(k)`` moves a row's scores all by one ``mean(q_i) . mean(k)``, so
    its rounding cannot reorder a row's blocks beyond the scores' own rounding)."""
    if means is not None:
        q_pool, k_pool = means[0], means[1]
    elif triton_path:
        q_pool, k_pool = block_means([q.detach(), k.detach()], block_size)
    else:
        return block_mean(q, block_size), block_mean(k, block_size) - k.mean(2, keepdim=True, dtype=torch.float32)
    n, t = k.shape[2], k_pool.shape[2]
    tokens = torch.full((t, 1), float(block_size), device=k.device)  # each block's real tokens
    tokens[-1] = n - (t - 1) * block_size
    return q_pool, k_pool - (k_pool * tokens).sum(2, keepdim=True) / n


def sla_scores(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-classification scores ``mean(q_i) . mean(k_j - mean(k))`` -> fp32 ``[B, H, T, T]`` (no grad)."""
    with torch.no_grad(), exact_fp32_matmul():
        q_pool, k_pool = _pooled_for_scores(q, k, block_size)
        return q_pool @ k_pool.transpose(-1, -2)


def num_negligible(negligible_ratio: float, num_blocks_: int, topk: int) -> int:
    """``floor(negligible_ratio * T)`` (product rounded to 6 decimals), capped so that K + negligible <= T."""
    return min(math.floor(round(negligible_ratio * num_blocks_, 6)), num_blocks_ - topk)


def _check_options(linear_scope, feature_map, negligible_ratio) -> None:
    if linear_scope not in LINEAR_SCOPES:
        raise ValueError(f"linear_scope must be one of {LINEAR_SCOPES}, got {linear_scope!r}")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    if (
        isinstance(negligible_ratio, bool)
        or not isinstance(negligible_ratio, (int, float))
        or not 0.0 <= negligible_ratio < 1.0
    ):
        raise ValueError(f"negligible_ratio must be a float in [0, 1), got {negligible_ratio!r}")
    if negligible_ratio > 0 and linear_scope != "marginal":
        raise ValueError(
            f"negligible_ratio={negligible_ratio} only applies to linear_scope='marginal' "
            f"(got linear_scope={linear_scope!r}); set it to 0"
        )


def sla_select(
    q,
    k,
    block_size: int = 16,
    topk=None,
    topk_ratio=None,
    negligible_ratio: float = 0.0,
    impl: str = "auto",
    means=None,
):
    """Block classification: ``(critical, negligible)`` int32 ``[B, H, T, K]`` and ``[B, H, T, K_neg]``.

    ``critical`` is best first; ``negligible`` lists the lowest-scoring blocks (used by ``linear_scope="marginal"``),
    an empty last dimension when ``negligible_ratio`` gives 0 blocks. ``means``: as ``sla_attention``'s.
    """
    check_qkv(q, k, k, name="sla_select")
    check_block_size(block_size)
    if means is not None:
        means = check_means(means, q, block_size, "sla_select")
    return _select_blocks(q, k, block_size, topk, topk_ratio, negligible_ratio, use_triton(q, impl), means)


def _select_blocks(q, k, block_size, topk, topk_ratio, negligible_ratio, triton_topk, means):
    """``sla_select`` on arguments its callers have checked."""
    t = num_blocks(q.shape[2], block_size)
    kk = resolve_topk(t, topk, topk_ratio)
    with torch.no_grad():
        q_pool, k_pool = _pooled_for_scores(q, k, block_size, triton_topk, means)
    critical = select_topk_blocks(q_pool, k_pool, kk, use_triton_topk=triton_topk)
    k_neg = num_negligible(negligible_ratio, t, kk)
    if k_neg == 0:
        return critical, critical[..., :0]
    # the k_neg lowest scores, ties toward the larger id: the top k_neg of the negated scores (negation is exact) over
    # the key blocks in reverse order, through the same selection as the critical blocks (never all [T, T] at once)
    reversed_ids = select_topk_blocks(-q_pool, k_pool.flip(-2), k_neg, use_triton_topk=triton_topk)
    return critical, (t - 1) - reversed_ids


def sla_attention(
    q,
    k,
    v,
    block_size: int = 16,
    topk=None,
    topk_ratio=None,
    linear_scope: str = "noncritical",
    feature_map: str = "softmax",
    negligible_ratio: float = 0.0,
    scale=None,
    impl: str = "auto",
    selection=None,
    means=None,
):
    """``(o_sparse, o_linear)``, each ``[batch, heads, tokens, head_dim]`` in the input dtype; see the module
    docstring. ``impl``: "auto" (Triton for CUDA tensors), "triton" (also CPU under TRITON_INTERPRET=1), "torch".
    ``selection``: optional precomputed ``(critical, negligible)`` from ``sla_select`` (then ``topk``/``topk_ratio``/
    ``negligible_ratio`` are not used), e.g. to run two paths on the same selection. ``means``: the fp32 block
    means of q, k and v stacked, ``[3, batch, heads, T, head_dim]``, when the caller has them (``qk_norm_rope(...,
    pool_block=block_size)`` computes them while writing q, k, v): the selection's scores start from q's and k's
    instead of pooling them. Means that are not those of q, k, v give a wrong selection."""
    check_qkv(q, k, v, name="sla_attention", scale=scale)
    check_block_size(block_size)
    _check_options(linear_scope, feature_map, negligible_ratio)
    if means is not None:
        means = check_means(means, q, block_size, "sla_attention")
    triton_path = use_triton(q, impl)
    if selection is None:
        critical, negligible = _select_blocks(q, k, block_size, topk, topk_ratio, negligible_ratio, triton_path, means)
    else:
        critical, negligible = selection
        check_selection(critical, q, block_size, "selection[0] (critical)")
        check_selection(negligible, q, block_size, "selection[1] (negligible)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    c = block_size
    if triton_path:  # both branches in one autograd Function (sla_triton.py)
        o_sparse, o_linear = sla_triton(
            *autocast_inputs(q, k, v), critical, negligible, c, feature_map, scale, exclude=linear_scope != "all"
        )
    else:  # exact fp32
        excluded = None if linear_scope == "all" else torch.cat([critical, negligible], -1)
        o_sparse = block_sparse_attention(
            q.float(), k.float(), v.float(), critical, query_block=c, key_block=c, scale=scale, impl="torch"
        )
        o_linear = linear_attention_torch(q, k, v, c, feature_map, excluded)
    return o_sparse.to(q.dtype), o_linear.to(q.dtype)
