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
   of its hidden states (spec §2.2), so at initialisation VSA equals the fine stage. The paper's optional fine gate
   ``gate_fine`` multiplies ``O_fine`` (absent = 1, as in FastVideo).

Arguments: exactly one of ``topk`` (int >= 1, clamped to ``T``) or ``sparsity`` (float in [0, 1],
``K = clamp(ceil((1 - sparsity) * T), 1, T)``, the product rounded to 6 decimals first so that float noise such as
``(1 - 0.7) * 10 = 3.0000000000000004`` does not add a tile). ``block_size`` in {16, 32, 64}; ``head_dim`` in
{16, 32, 64, 128}; any number of tokens >= 1; ``scale`` defaults to ``head_dim ** -0.5`` (both stages).

``impl="auto"``: CPU tensors run the exact PyTorch path (fp32 math, gather form, output in the input dtype); CUDA
tensors the Triton path: the fine stage is the shared block-sparse FlashAttention (``block_sparse.py``, backward
over the deterministic CSC transpose of the tile lists, no float atomics, no dense mask), the coarse stage our dense
FlashAttention (same kernel, every block listed) over the pooled tokens in the input dtype. ``impl="triton"`` forces
Triton (CPU under TRITON_INTERPRET=1), ``impl="torch"`` the PyTorch path. Selection (fp32 pooled scores, chunked) is
not differentiable; gradients reach q, k, v through both stages and reach ``gate``.
Tests: ``.venv/bin/python -m pytest tests/kernels/test_vsa.py tests/kernels/test_vsa_triton.py``.
"""

from __future__ import annotations

import math

import torch

from .block_sparse import block_sparse_attention, flash_attention
from .blocks import block_mean
from . import topk as shared_topk

BLOCK_SIZES = (16, 32, 64)
HEAD_DIMS = (16, 32, 64, 128)


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
# block layout and selection


def pad_to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, T, block_size, D]``, the partial last block zero-padded."""
    b, h, n, d = x.shape
    t = num_blocks(n, block_size)
    if t * block_size != n:
        x = torch.nn.functional.pad(x, (0, 0, 0, t * block_size - n))
    return x.reshape(b, h, t, block_size, d)


# ----------------------------------------------------------------------------------------------------------------------
# public API


def select_topk_blocks(q_pool: torch.Tensor, k_pool: torch.Tensor, topk: int, scale: float = 1.0,
                       use_triton_topk: bool = False) -> torch.Tensor:
    """Per query block, the ``topk`` key blocks with the largest ``scale * q_pool . k_pool`` (fp32, TF32 off): int32
    ``[B, H, T, K]``, best first, ties toward the smaller id (``blocks.topk_desc`` semantics). No grad.

    ``use_triton_topk``: the shared Triton selection ``topk.pooled_topk`` (nothing ``[T, T]`` in memory); otherwise
    its PyTorch form (chunked fp32 scores + ``topk_desc_fast``).
    """
    b, h, t, d = q_pool.shape
    with torch.no_grad():
        # the scale goes on the [T, D] operand, not on the [T, T] scores (one pass less over the big matrix)
        q_rows = scale * q_pool.float() if scale != 1.0 else q_pool.float()
        return shared_topk.pooled_topk(q_rows, k_pool.float(), topk, impl="triton" if use_triton_topk else "torch")


def use_triton(q: torch.Tensor, impl: str) -> bool:
    """``impl``: "auto" (Triton for CUDA tensors, PyTorch otherwise), "triton" (also on CPU under
    TRITON_INTERPRET=1) or "torch" (the exact PyTorch path on any device)."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return impl == "triton" or (impl == "auto" and q.is_cuda)


# ----------------------------------------------------------------------------------------------------------------------
# public API


@torch.compiler.disable  # opaque to torch.compile (see pixdit.kernels)
def vsa_select(q, k, block_size: int = 16, topk=None, sparsity=None, scale=None, impl: str = "auto") -> torch.Tensor:
    """The key tiles each query tile attends to in the fine stage: int32 ``[B, H, T, K]``, best first."""
    check_qkv(q, k, k, block_size, scale)
    kk = resolve_topk(num_blocks(q.shape[2], block_size), topk, sparsity, "topk", "sparsity", keep_fraction=False)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return select_topk_blocks(block_mean(q, block_size), block_mean(k, block_size), kk, scale,
                              use_triton_topk=use_triton(q, impl))


def check_selection(idx, q: torch.Tensor, block_size: int, name: str) -> None:
    """A precomputed block selection must be an int tensor ``[B, H, T, K]`` of ids in ``[0, T)`` on q's device."""
    b, h, n, _ = q.shape
    t = num_blocks(n, block_size)
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 4 \
            or tuple(idx.shape[:3]) != (b, h, t) or idx.device != q.device:
        raise ValueError(f"{name} must be an int32/int64 tensor [{b}, {h}, {t}, K] on {q.device} "
                         f"(as returned by the matching *_select), got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}")


@torch.compiler.disable  # opaque to torch.compile (see pixdit.kernels)
def vsa_attention(q, k, v, block_size: int = 16, topk=None, sparsity=None, gate=None, scale=None,
                  impl: str = "auto", tile_idx=None, gate_fine=None) -> torch.Tensor:
    """VSA output ``O_fine + gate * O_coarse`` ``[batch, heads, tokens, head_dim]``; see the module docstring.

    ``tile_idx``: optional precomputed selection from ``vsa_select`` (then ``topk``/``sparsity`` are not needed),
    e.g. to run two paths on the same selection. ``gate_fine``: the paper's optional fine gate ``G_f`` (shaped like
    q): ``O_fine * gate_fine + gate * O_coarse`` (spec §2.2; absent = 1, as in FastVideo)."""
    check_qkv(q, k, v, block_size, scale)
    for name, x in (("gate", gate), ("gate_fine", gate_fine)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != q.shape):
            raise ValueError(f"{name} must be None or a tensor shaped like q {tuple(q.shape)}, "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    triton_path = use_triton(q, impl)
    if tile_idx is None:
        kk = resolve_topk(num_blocks(q.shape[2], block_size), topk, sparsity, "topk", "sparsity",
                          keep_fraction=False)
    else:
        check_selection(tile_idx, q, block_size, "tile_idx")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n, c = q.shape[2], block_size

    # coarse stage (differentiable through the fp32 pooling)
    q_pool, k_pool, v_pool = (block_mean(x, c) for x in (q, k, v))                 # [B, H, T, D] fp32
    if tile_idx is None:
        tile_idx = select_topk_blocks(q_pool, k_pool, kk, scale, use_triton_topk=triton_path)
    if triton_path:   # our deterministic FlashAttention over the T pooled tokens, in the input dtype (no [T, T] kept)
        out_coarse = flash_attention(q_pool.to(q.dtype), k_pool.to(q.dtype), v_pool.to(q.dtype), scale=scale,
                                     impl="triton")
    else:             # exact fp32
        out_coarse = torch.softmax(scale * q_pool @ k_pool.transpose(-1, -2), -1) @ v_pool
    b, h, t, d = out_coarse.shape
    out_coarse = out_coarse[:, :, :, None].expand(b, h, t, c, d).reshape(b, h, t * c, d)[:, :, :n]

    # fine stage: block-sparse FlashAttention over each query tile's K selected key tiles (shared kernel)
    if triton_path:
        out_fine = block_sparse_attention(q, k, v, tile_idx, query_block=c, key_block=c, scale=scale, impl="triton")
        if gate_fine is not None:
            out_fine = out_fine * gate_fine
        return out_fine + (out_coarse if gate is None else out_coarse * gate)
    out_fine = block_sparse_attention(q.float(), k.float(), v.float(), tile_idx, query_block=c, key_block=c,
                                      scale=scale, impl="torch")
    if gate_fine is not None:
        out_fine = out_fine * gate_fine.float()
    return (out_fine + (out_coarse if gate is None else out_coarse * gate.float())).to(q.dtype)
