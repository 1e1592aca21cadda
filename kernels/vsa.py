"""VSA — Video Sparse Attention (arXiv 2505.13389), spec ``/work/shared/spec/vsa.md``: coarse + top-K fine attention.

    from pixdit.kernels import vsa_attention
    out = vsa_attention(q, k, v, block_size=16, topk=32, gate=g)      # q, k, v, g: [batch, heads, tokens, head_dim]

What it computes, per (batch, head), with tiles = ``block_size`` consecutive tokens (square pixel patches under the
model's Z-order; the last tile may be partial and then holds the ``tokens mod block_size`` remaining tokens):

1. coarse stage: mean-pool q, k, v per tile (fp32, over the tile's real tokens), dense softmax attention between the
   ``T`` pooled tokens, the tile's output broadcast to all its tokens (``O_coarse``);
2. selection: per query tile the ``K`` key tiles with the largest coarse scores, ties toward the smaller tile id;
3. fine stage: exact softmax attention of every query over the real tokens of its tile's ``K`` selected tiles;
4. ``out = O_fine + gate * O_coarse`` (``gate=None``: ungated). The gate is the layer's zero-initialised projection
   of its hidden states (spec §2.2), so at initialisation VSA equals the fine stage.

Arguments: exactly one of ``topk`` (int >= 1, clamped to ``T``) or ``sparsity`` (float in [0, 1],
``K = clamp(ceil((1 - sparsity) * T), 1, T)``, the product rounded to 6 decimals first so that float noise such as
``(1 - 0.7) * 10 = 3.0000000000000004`` does not add a tile). ``block_size`` in {16, 32, 64}; ``head_dim`` in
{32, 64, 128}; any number of tokens >= 1; ``scale`` defaults to ``head_dim ** -0.5`` (both stages).

CPU tensors run an exact PyTorch path (gather form, fp32 math, output in the input dtype). CUDA tensors run the
Triton path (phase 2; until it exists, the PyTorch path). Selection is not differentiable; gradients reach q, k, v
through both stages and reach ``gate``.
Tests: ``.venv/bin/python -m pytest tests/kernels/test_vsa.py``.
"""

from __future__ import annotations

import math

import torch

from .blocks import block_mean, topk_desc

BLOCK_SIZES = (16, 32, 64)
HEAD_DIMS = (32, 64, 128)


# ----------------------------------------------------------------------------------------------------------------------
# validation and the K rule


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` consecutive tokens (the last one may be partial)."""
    return -(-num_tokens // block_size)


def topk_from_fraction(fraction: float, num_tiles: int) -> int:
    """``clamp(ceil(fraction * num_tiles), 1, num_tiles)``; the product is rounded to 6 decimals before the ceil."""
    return min(max(math.ceil(round(fraction * num_tiles, 6)), 1), num_tiles)


def resolve_topk(num_tiles: int, topk, fraction, topk_name: str, fraction_name: str, keep_fraction: bool) -> int:
    """The number of selected blocks from exactly one of an int ``topk`` or a float fraction (K >= 1 always).

    ``keep_fraction``: the fraction is the share of blocks kept (SLA ``topk_ratio``) rather than dropped
    (VSA ``sparsity``)."""
    if (topk is None) == (fraction is None):
        raise ValueError(f"give exactly one of {topk_name} (int >= 1) or {fraction_name} (float in [0, 1]); "
                         f"got {topk_name}={topk!r}, {fraction_name}={fraction!r}")
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"{topk_name} must be an int >= 1 (it is clamped to the number of blocks), got {topk!r}")
        return min(topk, num_tiles)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{fraction_name} must be a float in [0, 1], got {fraction!r}")
    return topk_from_fraction(fraction if keep_fraction else 1.0 - fraction, num_tiles)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, scale) -> None:
    """Shared argument checks of vsa_attention / sla_attention (clear errors naming the parameter)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape (self-attention), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must have the same dtype and device")
    if q.shape[2] < 1:
        raise ValueError("the token dimension of q, k, v is empty")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[3]}")
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise ValueError(f"scale must be a positive float or None (head_dim ** -0.5), got {scale!r}")


# ----------------------------------------------------------------------------------------------------------------------
# exact PyTorch building blocks (gather form: nothing larger than the pooled [T, T] scores)


def pad_to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, T, block_size, D]``, the partial last block zero-padded."""
    b, h, n, d = x.shape
    t = num_blocks(n, block_size)
    if t * block_size != n:
        x = torch.nn.functional.pad(x, (0, 0, 0, t * block_size - n))
    return x.reshape(b, h, t, block_size, d)


def block_sparse_attention_torch(q, k, v, block_idx, block_size: int, scale: float) -> torch.Tensor:
    """Exact softmax attention of each query block over the key blocks listed in ``block_idx [B, H, T, K]``.

    fp32 math, gather form (memory ``O(N * K * block_size)``); keys of a partial last block beyond the sequence
    are masked. Differentiable in q, k, v. Returns fp32 ``[B, H, N, D]``.
    """
    b, h, n, d = q.shape
    t, kk = block_idx.shape[2], block_idx.shape[3]
    c = block_size
    q_blocks = pad_to_blocks(q.float(), c)                                       # [B, H, T, C, D]
    idx = block_idx.long().reshape(b, h, t * kk, 1)

    def gather_blocks(x):                                                       # -> [B, H, T, K*C, D]
        flat = pad_to_blocks(x.float(), c).reshape(b, h, t, c * d)
        return torch.gather(flat, 2, idx.expand(-1, -1, -1, c * d)).reshape(b, h, t, kk * c, d)

    k_sel, v_sel = gather_blocks(k), gather_blocks(v)
    logits = scale * q_blocks @ k_sel.transpose(-1, -2)                          # [B, H, T, C, K*C]
    if t * c != n:
        key_pos = block_idx.long()[..., None] * c + torch.arange(c, device=q.device)   # [B, H, T, K, C]
        valid = (key_pos < n).reshape(b, h, t, 1, kk * c)
        logits = logits.masked_fill(~valid, float("-inf"))
    out = torch.softmax(logits, -1) @ v_sel                                      # [B, H, T, C, D]
    return out.reshape(b, h, t * c, d)[:, :, :n]


# ----------------------------------------------------------------------------------------------------------------------
# public API


def vsa_scores(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Coarse scores ``scale * mean(q_i) . mean(k_j)`` -> fp32 ``[B, H, T, T]`` (no grad)."""
    with torch.no_grad():
        return scale * block_mean(q, block_size) @ block_mean(k, block_size).transpose(-1, -2)


def vsa_select(q, k, block_size: int = 16, topk=None, sparsity=None, scale=None) -> torch.Tensor:
    """The key tiles each query tile attends to in the fine stage: int32 ``[B, H, T, K]``, best first."""
    check_qkv(q, k, k, block_size, scale)
    num_tiles = num_blocks(q.shape[2], block_size)
    kk = resolve_topk(num_tiles, topk, sparsity, "topk", "sparsity", keep_fraction=False)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return topk_desc(vsa_scores(q, k, block_size, scale), kk)


def _vsa_torch(q, k, v, block_size: int, topk: int, gate, scale: float) -> torch.Tensor:
    """Exact PyTorch path: autograd through pooling, coarse attention, gathered fine attention and the gate."""
    n = q.shape[2]
    q_pool, k_pool, v_pool = (block_mean(x, block_size) for x in (q, k, v))
    coarse_scores = scale * q_pool @ k_pool.transpose(-1, -2)                    # [B, H, T, T]
    out_coarse = torch.softmax(coarse_scores, -1) @ v_pool                       # [B, H, T, D]
    out_coarse = out_coarse.repeat_interleave(block_size, dim=2)[:, :, :n]      # broadcast to the tile's tokens
    tile_idx = topk_desc(coarse_scores.detach(), topk)
    out_fine = block_sparse_attention_torch(q, k, v, tile_idx, block_size, scale)
    out = out_fine + (out_coarse if gate is None else out_coarse * gate.float())
    return out.to(q.dtype)


def vsa_attention(q, k, v, block_size: int = 16, topk=None, sparsity=None, gate=None, scale=None) -> torch.Tensor:
    """VSA output ``O_fine + gate * O_coarse`` ``[batch, heads, tokens, head_dim]``; see the module docstring."""
    check_qkv(q, k, v, block_size, scale)
    if gate is not None and (not isinstance(gate, torch.Tensor) or gate.shape != q.shape):
        raise ValueError(f"gate must be None or a tensor shaped like q {tuple(q.shape)}, "
                         f"got {tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__}")
    num_tiles = num_blocks(q.shape[2], block_size)
    kk = resolve_topk(num_tiles, topk, sparsity, "topk", "sparsity", keep_fraction=False)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _vsa_torch(q, k, v, block_size, kk, gate, scale)
