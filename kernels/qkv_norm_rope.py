"""The qkv projection with qk-norm, RoPE, the head layout and the block means in its epilogue: one GEMM for what
inference otherwise runs as ``F.linear`` + ``qk_norm_rope`` (forward only).

    from pixdit.kernels.qkv_norm_rope import qkv_norm_rope
    with torch.no_grad():
        q, k, v, means = qkv_norm_rope(x, weight, bias, q_weight, k_weight, cos, sin, num_heads, pool_block=16)
    # x: [batch, tokens, dim]; weight [3 * dim, dim], bias [3 * dim] (the nn.Linear's); q, k, v: [batch, heads,
    # tokens, head_dim]; means: fp32 [3, batch, heads, tokens / pool_block, head_dim]

The same values as ``qkv_norm_rope_ref`` (the two ops it replaces) up to the products' summation order: the
projection's output is rounded to x's dtype once, as cuBLAS's bias epilogue rounds it, and the norm, rotation and
means follow ``qk_norm_rope``'s math in fp32.

Why: the projection writes qkv (2,304 bytes per token and layer at DiT-S width) and the prologue kernel reads it
back to write q, k, v in the attention's layout; in a compiled 256² sampler that kernel was ~9 % of the GPU time,
bound by those bytes. Here the GEMM's epilogue holds a tile of 128 tokens x whole heads in registers, normalises and
rotates it there and writes q, k, v once. Training keeps the two ops: their backward needs qkv, which this form never
writes. Measured on an H100 it only ties with the two launches (0.90-0.99x; 1.01-1.03x with ``TMA_LOADS``): its
products run 1.33-1.51x behind cuBLAS's at DiT-S width, which costs what the epilogue saves; so the model leaves it
off (``Attention.fuse_inference_qkv``; docs/kernel_notes.md v60, v61, where row strips of x held in shared memory
lost, 0.72x; the comparison: scripts/ab_qkv_gemm.py).

A persistent grid (one program per SM walking the tiles, the next tile's loads in flight during this one's epilogue:
``tl.range(flatten=True)``), tiles of 128 tokens x 128 channels: with the products' 6 steps of 64 at DiT-S width, a
program per tile would pay the pipeline's fill and drain per tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import autocast_inputs, use_triton
from .ops import cdiv, custom_op
from .qk_norm_rope import check_norm_args, qk_norm_rope_torch

__all__ = ["qkv_norm_rope", "qkv_norm_rope_fits", "qkv_norm_rope_products", "qkv_norm_rope_ref"]

BLOCK_N = 128  # channels per tile: whole heads (head_dim divides it)
WARPS, STAGES = 8, 3
# x and W loaded by TMA (2-D descriptors of the tiles) instead of pointer loads: the form in which a Triton GEMM kept
# cuBLAS's pace for the MLP (docs/kernel_notes.md v38). Here its products still ran 1.33-1.35x behind cuBLAS (the
# pointer loads' 1.50x), the fused kernel 1.013-1.027x against the two launches (v61, H100). Off: the compiled and
# sampler tests ran with pointer loads, and the model leaves the kernel off.
TMA_LOADS = False


def qkv_norm_rope_ref(x, weight, bias, q_weight, k_weight, cos, sin, num_heads, eps=1e-5, pool_block=None):
    """The two ops this kernel replaces: the projection (rounded to x's dtype) and ``qk_norm_rope``'s PyTorch path."""
    qkv = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps, pool_block)


@triton.jit
def _epilogue(
    x, tm, col0, BIAS, NW, COS, SIN, OUT, MEANS, n, n_bh, eps,
    C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, POOL: tl.constexpr,
):  # fmt: skip
    """x: the fp32 products of token rows ``tm * BM ..`` and channels ``col0 ..`` (whole heads of q, k or v; past
    3 * C: padding, not stored). Stores q, k, v as ``qk_norm_rope`` computes them, and their block means."""
    HT: tl.constexpr = BN // D  # heads in the tile
    dims = tl.arange(0, D)
    cols = col0 + tl.arange(0, BN)
    x = x + tl.load(BIAS + cols, mask=cols < 3 * C, other=0.0).to(tl.float32)[None, :]  # the bias in x's dtype
    x = x.to(OUT.dtype.element_ty).to(tl.float32)  # qkv, rounded once as the projection's output
    heads = col0 // D + tl.arange(0, HT)  # heads over q, k, v: part = heads // H
    part = heads // H
    x = tl.reshape(x, [BM, HT, D])
    tok = (tm * BM) % n + tl.arange(0, BM)  # token index in its image (n % BM == 0: one image per tile)
    if col0 >= 2 * C:  # v only: stored as it is
        y = x.to(OUT.dtype.element_ty)
    else:
        w = tl.load(NW + (part % 2)[:, None] * D + dims[None, :])[None, :, :]
        normed = x * tl.math.rsqrt(tl.sum(x * x, 2) / D + eps)[:, :, None] * w
        even, odd = tl.split(tl.reshape(normed, [BM, HT, D // 2, 2]))  # the interleaved RoPE pairs
        angle = tok[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
        cos = tl.load(COS + angle)[:, None, :]
        sin = tl.load(SIN + angle)[:, None, :]
        roped = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [BM, HT, D])
        y = tl.where((part < 2)[None, :, None], roped, x).to(OUT.dtype.element_ty)  # a tile may end in v's heads
    bh = ((tm * BM) // n) * H + heads % H
    real = (part < 3)[None, :, None]
    out = (part * n_bh + bh).to(tl.int64)[None, :, None] * n * D
    tl.store(OUT + out + tok[:, None, None] * D + dims[None, None, :], y, mask=real)
    if POOL > 0:  # fp32 means of the stored (rounded) rows
        sums = tl.sum(tl.reshape(y.to(tl.float32), [BM // POOL, POOL, HT, D]), 1)
        blocks = ((tm * BM) % n) // POOL + tl.arange(0, BM // POOL)
        means = (part * n_bh + bh).to(tl.int64)[None, :, None] * (n // POOL) * D
        tl.store(MEANS + means + blocks[:, None, None] * D + dims[None, None, :], sums / POOL, mask=real)


@triton.jit
def _qkv_norm_rope_kernel(
    X, W, BIAS, NW, COS, SIN, OUT, MEANS, M, n, n_bh, eps,
    C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    POOL: tl.constexpr, PROGRAMS: tl.constexpr, STAGES: tl.constexpr, PRODUCTS_ONLY: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # TMA: X and W are descriptors of [BM, BK] / [BN, BK] tiles of x [M, C] and W [3 C, C] (rows past 3 C read as 0)
    tiles_n = tl.cdiv(3 * C, BN)  # the channel tiles vary fastest: a token tile's x is read from L2 after the first
    ks = tl.arange(0, BK)
    for tile in tl.range(tl.program_id(0), (M // BM) * tiles_n, PROGRAMS, flatten=True, num_stages=STAGES):
        tm = tile // tiles_n
        rows = tm * BM + tl.arange(0, BM)
        cols = (tile % tiles_n) * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kk in range(0, C // BK):
            if TMA:
                a = X.load([tm * BM, kk * BK])
                w = W.load([(tile % tiles_n) * BN, kk * BK])
            else:
                a = tl.load(X + rows[:, None].to(tl.int64) * C + (kk * BK + ks)[None, :])
                w = tl.load(W + cols[:, None] * C + (kk * BK + ks)[None, :], mask=(cols < 3 * C)[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        if PRODUCTS_ONLY:  # qkv + bias stored [M, 3 C]: the tiles' pace without the epilogue (benchmarks)
            y = acc + tl.load(BIAS + cols, mask=cols < 3 * C, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + rows[:, None].to(tl.int64) * (3 * C) + cols[None, :], y.to(OUT.dtype.element_ty),
                     mask=(cols < 3 * C)[None, :])  # fmt: skip
        else:
            _epilogue(acc, tm, (tile % tiles_n) * BN, BIAS, NW, COS, SIN, OUT, MEANS, n, n_bh, eps, C, H, D, BM, BN,
                      POOL)  # fmt: skip


def _tile_rows(n: int) -> int:
    """Token rows per tile: 128, or 64 where 128 does not divide the tokens (a tile stays in one image)."""
    return 128 if n % 128 == 0 else 64


def qkv_norm_rope_fits(x: torch.Tensor, num_heads: int, pool_block: int | None) -> bool:
    """Whether the kernel takes these shapes: head_dim a power of two from 16 to 128, dim a multiple of 32, tokens a
    multiple of 64, whole blocks of ``pool_block`` (up to 64) in a tile. Callers fall back to the two ops."""
    if x.ndim != 3 or num_heads < 1 or x.shape[-1] % num_heads:
        return False
    n, dim = x.shape[1], x.shape[2]
    d = dim // num_heads
    pool_ok = pool_block is None or (pool_block & (pool_block - 1) == 0 and 1 <= pool_block <= 64)
    return d & (d - 1) == 0 and 16 <= d <= BLOCK_N and dim % 32 == 0 and n % 64 == 0 and n > 0 and pool_ok


def _outputs(x: torch.Tensor, num_heads: int, pool_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v stacked ``[3, b, heads, n, head_dim]`` in x's dtype, and fp32 means ``[3, b, heads, n / pool, d]``."""
    b, n, dim = x.shape
    d = dim // num_heads
    blocks = n // pool_block if pool_block else 0
    return x.new_empty((3, b, num_heads, n, d)), x.new_empty((3, b, num_heads, blocks, d), dtype=torch.float32)


@custom_op("qkv_norm_rope")
def _qkv_norm_rope_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    norm_weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    eps: float,
    pool_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, means = _outputs(x, num_heads, pool_block)
    _launch(x, weight, bias, norm_weights, cos, sin, out, means, num_heads, eps, pool_block, products_only=False)
    return out, means


def _launch(x, weight, bias, norm_weights, cos, sin, out, means, num_heads, eps, pool_block, products_only):
    b, n, dim = x.shape
    rows = _tile_rows(n)
    tiles = b * n // rows * cdiv(3 * dim, BLOCK_N)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    programs = min(sms, tiles)
    step = 64 if dim % 64 == 0 else 32
    if TMA_LOADS:
        x = TensorDescriptor(x, [b * n, dim], [dim, 1], [rows, step])
        weight = TensorDescriptor(weight, [3 * dim, dim], [dim, 1], [BLOCK_N, step])
    _qkv_norm_rope_kernel[(programs,)](
        x, weight, bias, norm_weights, cos, sin, out, means, b * n, n, b * num_heads, eps,
        C=dim, H=num_heads, D=dim // num_heads, BM=rows, BN=BLOCK_N, BK=step, POOL=pool_block, PROGRAMS=programs,
        STAGES=STAGES, PRODUCTS_ONLY=products_only, TMA=TMA_LOADS, num_warps=WARPS,
    )  # fmt: skip


def qkv_norm_rope_products(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x fp16 / bf16 ``[batch, tokens, dim]``, the weight and bias in its dtype) by
    ``qkv_norm_rope``'s GEMM with its tiles and grid, no epilogue: for benchmarks (scripts/ab_qkv_gemm.py), what the
    tiles' products cost against cuBLAS's. Shapes as ``qkv_norm_rope_fits`` takes them."""
    b, n, dim = x.shape
    out, unused = x.new_empty((b, n, 3 * dim)), x.new_empty(0)
    # one head: the heads are the epilogue's, which does not run
    _launch(x.contiguous(), weight.contiguous(), bias.contiguous(), unused, unused, unused, out, unused, 1, 0.0, 0,
            products_only=True)  # fmt: skip
    return out


@_qkv_norm_rope_op.register_fake
def _(x, weight, bias, norm_weights, cos, sin, num_heads, eps, pool_block):
    return _outputs(x, num_heads, pool_block)


def qkv_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    eps: float = 1e-5,
    pool_block: int | None = None,
    impl: str = "auto",
):
    """``qk_norm_rope(F.linear(x, weight, bias), ...)`` without autograd, as one kernel on CUDA.

    Args:
        x: ``[batch, tokens, dim]`` fp16 / bf16 (fp32 under CUDA autocast is cast to its dtype, as F.linear would).
        weight, bias: the qkv projection's ``[3 * dim, dim]`` and ``[3 * dim]`` (or None), cast to x's dtype.
        q_weight, k_weight, cos, sin, eps, pool_block: as in ``qk_norm_rope``.
        impl: "auto" (Triton on CUDA, ``qkv_norm_rope_ref`` on CPU), "triton", "torch".
    Returns:
        q, k, v ``[batch, heads, tokens, head_dim]`` (views of one ``[3, ...]`` buffer on the Triton path), and with
        ``pool_block`` the fp32 block means ``[3, batch, heads, tokens / pool_block, head_dim]``.
    """
    if x.ndim != 3 or num_heads < 1 or x.shape[-1] % num_heads:
        raise ValueError(
            f"qkv_norm_rope: x must be [batch, tokens, dim] with dim divisible by num_heads={num_heads}, "
            f"got shape {tuple(x.shape)}"
        )
    b, n, dim = x.shape
    d = dim // num_heads
    if tuple(weight.shape) != (3 * dim, dim) or (bias is not None and tuple(bias.shape) != (3 * dim,)):
        raise ValueError(
            f"qkv_norm_rope: weight must be ({3 * dim}, {dim}) and bias None or ({3 * dim},) (the qkv projection "
            f"of dim={dim}), got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}"
        )
    check_norm_args("qkv_norm_rope", n, d, q_weight, k_weight, cos, sin, pool_block)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, q_weight, k_weight)
    ):
        raise ValueError(
            "qkv_norm_rope: has no backward; call it under torch.no_grad() (inference), or use F.linear + "
            "qk_norm_rope where gradients are needed"
        )
    (x,) = autocast_inputs(x)
    if not use_triton(x, impl):
        return qkv_norm_rope_ref(x, weight, bias, q_weight, k_weight, cos, sin, num_heads, eps, pool_block)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"qkv_norm_rope: x must be float16 or bfloat16 on the Triton path, got {x.dtype}")
    if not qkv_norm_rope_fits(x, num_heads, pool_block):
        raise ValueError(
            f"qkv_norm_rope: the kernel needs head_dim a power of two from 16 to {BLOCK_N}, dim a multiple of 32, "
            f"tokens a multiple of 64 and pool_block None or a power of two up to 64; got head_dim={d}, dim={dim}, "
            f"tokens={n}, pool_block={pool_block!r} (check qkv_norm_rope_fits first, or use impl='torch')"
        )
    # The bias in x's dtype, as F.linear under autocast takes it, widened in the kernel: a cast to bf16 and back on
    # the host would be elided by Inductor, which does not emulate precision casts (the compiled outputs differed).
    bias = torch.zeros(3 * dim, device=x.device, dtype=x.dtype) if bias is None else bias.to(x.dtype)
    out, means = _qkv_norm_rope_op(
        x.contiguous(),
        weight.to(x.dtype).contiguous(),
        bias.contiguous(),
        torch.stack([q_weight, k_weight]).float(),
        cos.float().contiguous(),
        sin.float().contiguous(),
        num_heads,
        float(eps),
        pool_block or 0,
    )
    q, k, v = out.unbind(0)
    return (q, k, v) if pool_block is None else (q, k, v, means)
