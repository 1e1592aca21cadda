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
bound by those bytes. Here the GEMM's epilogue holds 128 tokens x a head in registers, normalises and rotates it
there and writes q, k, v once. Training keeps the two ops: their backward needs qkv, which this form never
writes. Measured on an H100 it only ties with the two launches (0.99x): its products, with plain loads, run 1.34-1.51x
behind cuBLAS's at DiT-S width, which costs what the epilogue saves; so the model leaves it off
(``Attention.fuse_inference_qkv``). The loads by TMA (``TMA_LOADS``) are the next form to measure
(docs/kernel_notes.md v60; the comparison: scripts/ab_qkv_gemm.py).

Row strips: a program loads the x rows of 128 tokens (64 where 128 do not fit) once, all ``dim`` channels, and
walks the heads with them in shared memory, W's head rows streamed through a two-stage pipeline. Each token strip
is read from HBM once and only W comes again (from L2): 115 products per byte of L2 traffic at DiT-S width, against
64 for 128 x 128 tiles, whose products ran 1.34-1.51x behind cuBLAS (v60). The walk's step is whole heads (one head of
64 or 128 channels, or 64 channels of smaller heads), so the epilogue normalises whole heads, and the strip's RoPE angles are loaded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import autocast_inputs, use_triton
from .ops import custom_op
from .qk_norm_rope import check_norm_args, qk_norm_rope_torch

__all__ = ["qkv_norm_rope", "qkv_norm_rope_fits", "qkv_norm_rope_products", "qkv_norm_rope_ref"]

STAGES, WARPS = 2, 8  # W's head rows double-buffered: with the x strip, 208 KiB of shared memory at DiT-S width
SHARED_BYTES = 216 * 1024  # what a program's x strip, W stages and epilogue tile may take (sm_90: 227 KiB)
# the widths whose x strip is 1-4 chunks of a power of two up to 128 channels (the kernel's a0 .. a3: Triton's
# blocks are powers of two)
KERNEL_DIMS = (32, 64, 96, 128, 192, 256, 384, 512)
# W's head rows loaded by TMA (2-D descriptors) instead of pointer loads; the x strip, loaded once, keeps plain loads
TMA_LOADS = False
# W's head rows for the next step loaded into registers before this step's products, instead of Triton's two-stage
# pipeline (which issues them after the epilogue and waits for them at the next step's start: TTGIR, Triton 3.6)
PREFETCH = False


def qkv_norm_rope_ref(x, weight, bias, q_weight, k_weight, cos, sin, num_heads, eps=1e-5, pool_block=None):
    """The two ops this kernel replaces: the projection (rounded to x's dtype) and ``qk_norm_rope``'s PyTorch path."""
    qkv = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps, pool_block)


@triton.jit
def _epilogue(
    x, tm, col0, BIAS, NW, cos, sin, OUT, MEANS, n, n_bh, eps,
    C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, POOL: tl.constexpr,
):  # fmt: skip
    """x: the fp32 products of token rows ``tm * BM ..`` and channels ``col0 ..`` (whole heads of q, k or v; past
    3 * C: padding, not stored); cos, sin: ``[BM, 1, D / 2]``, those rows' angles. Stores q, k, v as
    ``qk_norm_rope`` computes them, and their block means."""
    HT: tl.constexpr = BN // D  # heads in the step
    dims = tl.arange(0, D)
    cols = col0 + tl.arange(0, BN)
    x = x + tl.load(BIAS + cols, mask=cols < 3 * C, other=0.0).to(tl.float32)[None, :]  # the bias in x's dtype
    x = x.to(OUT.dtype.element_ty).to(tl.float32)  # qkv, rounded once as the projection's output
    heads = col0 // D + tl.arange(0, HT)  # heads over q, k, v: part = heads // H
    part = heads // H
    x = tl.reshape(x, [BM, HT, D])
    tok = (tm * BM) % n + tl.arange(0, BM)  # token index in its image (n % BM == 0: one image per strip)
    if col0 >= 2 * C:  # v, stored as it is (no step holds both k and v: 2 C is a multiple of BN in KERNEL_DIMS)
        y = x.to(OUT.dtype.element_ty)
    else:  # q, k or both
        w = tl.load(NW + (part % 2)[:, None] * D + dims[None, :])[None, :, :]
        normed = x * tl.math.rsqrt(tl.sum(x * x, 2) / D + eps)[:, :, None] * w
        even, odd = tl.split(tl.reshape(normed, [BM, HT, D // 2, 2]))  # the interleaved RoPE pairs
        y = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [BM, HT, D]).to(OUT.dtype.element_ty)
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
def _w_rows(W, col0, chunk, C: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """W's rows ``col0 .. col0 + BN`` (zeros past 3 C), channels of x's chunk ``chunk``: ``[BN, BK]``."""
    if TMA:
        w = W.load([col0, chunk * BK])
    else:
        cols = col0 + tl.arange(0, BN)
        w = tl.load(W + cols[:, None] * C + chunk * BK + tl.arange(0, BK)[None, :], mask=(cols < 3 * C)[:, None],
                    other=0.0)  # fmt: skip
    return w


@triton.jit
def _qkv_norm_rope_kernel(
    X, W, BIAS, NW, COS, SIN, OUT, MEANS, n, n_bh, eps,
    C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    CHUNKS: tl.constexpr, POOL: tl.constexpr, STAGES: tl.constexpr, PRODUCTS_ONLY: tl.constexpr, TMA: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    # One strip of BM token rows; its x in CHUNKS chunks of BK channels (C = CHUNKS * BK), loaded once; with TMA, W
    # is a descriptor of [BN, BK] tiles of W [3 C, C] (rows past 3 C read as 0). PREFETCH: each step loads the next
    # step's W rows into registers before its products (STAGES = 1); else Triton's pipeline stages them.
    tm = tl.program_id(0)
    rows = tm * BM + tl.arange(0, BM)
    xs = X + rows[:, None].to(tl.int64) * C + tl.arange(0, BK)[None, :]
    a0 = tl.load(xs)
    if CHUNKS > 1:
        a1 = tl.load(xs + BK)
    if CHUNKS > 2:
        a2 = tl.load(xs + 2 * BK)
    if CHUNKS > 3:
        a3 = tl.load(xs + 3 * BK)
    if not PRODUCTS_ONLY:  # the strip's RoPE angles, the same for every q and k head
        angle = ((tm * BM) % n + tl.arange(0, BM))[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
        cos = tl.load(COS + angle)[:, None, :]
        sin = tl.load(SIN + angle)[:, None, :]
    if PREFETCH:
        next0 = _w_rows(W, 0, 0, C, BN, BK, TMA)
        if CHUNKS > 1:
            next1 = _w_rows(W, 0, 1, C, BN, BK, TMA)
        if CHUNKS > 2:
            next2 = _w_rows(W, 0, 2, C, BN, BK, TMA)
        if CHUNKS > 3:
            next3 = _w_rows(W, 0, 3, C, BN, BK, TMA)
    for step in tl.range(0, tl.cdiv(3 * C, BN), num_stages=STAGES):
        col0 = step * BN
        if PREFETCH:  # this step's rows came in during the last step; the last step's prefetch reads zeros
            w0 = next0
            next0 = _w_rows(W, col0 + BN, 0, C, BN, BK, TMA)
            if CHUNKS > 1:
                w1 = next1
                next1 = _w_rows(W, col0 + BN, 1, C, BN, BK, TMA)
            if CHUNKS > 2:
                w2 = next2
                next2 = _w_rows(W, col0 + BN, 2, C, BN, BK, TMA)
            if CHUNKS > 3:
                w3 = next3
                next3 = _w_rows(W, col0 + BN, 3, C, BN, BK, TMA)
        else:
            w0 = _w_rows(W, col0, 0, C, BN, BK, TMA)
            if CHUNKS > 1:
                w1 = _w_rows(W, col0, 1, C, BN, BK, TMA)
            if CHUNKS > 2:
                w2 = _w_rows(W, col0, 2, C, BN, BK, TMA)
            if CHUNKS > 3:
                w3 = _w_rows(W, col0, 3, C, BN, BK, TMA)
        acc = tl.dot(a0, tl.trans(w0))
        if CHUNKS > 1:
            acc = tl.dot(a1, tl.trans(w1), acc)
        if CHUNKS > 2:
            acc = tl.dot(a2, tl.trans(w2), acc)
        if CHUNKS > 3:
            acc = tl.dot(a3, tl.trans(w3), acc)
        if PRODUCTS_ONLY:  # qkv + bias stored [M, 3 C]: the GEMM's pace without the epilogue (benchmarks)
            cols = col0 + tl.arange(0, BN)
            y = acc + tl.load(BIAS + cols, mask=cols < 3 * C, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT + rows[:, None].to(tl.int64) * (3 * C) + cols[None, :], y.to(OUT.dtype.element_ty),
                     mask=(cols < 3 * C)[None, :])  # fmt: skip
        else:
            _epilogue(acc, tm, col0, BIAS, NW, cos, sin, OUT, MEANS, n, n_bh, eps, C, H, D, BM, BN, POOL)


def _strips(n: int, dim: int, head_dim: int) -> dict | None:
    """The launch's blocks for these shapes, or None where the kernel does not take them: the walk's step BN (whole
    heads, at least 64 channels), the x strip's chunks (CHUNKS x BK channels), its token rows BM (128, or 64 where
    128 rows do not divide the tokens or do not fit in shared memory)."""
    if dim not in KERNEL_DIMS or head_dim & (head_dim - 1) or not 16 <= head_dim <= 128:
        return None
    step = max(64, head_dim)
    chunk = 128
    while dim % chunk:
        chunk //= 2
    for rows in (128, 64):
        if n % rows == 0 and 2 * (rows * dim + STAGES * step * dim + rows * step) <= SHARED_BYTES:
            return dict(BM=rows, BN=step, BK=chunk, CHUNKS=dim // chunk)
    return None


def qkv_norm_rope_fits(x: torch.Tensor, num_heads: int, pool_block: int | None) -> bool:
    """Whether the kernel takes these shapes: head_dim a power of two from 16 to 128, dim one of ``KERNEL_DIMS``
    (up to 4 chunks of a power of two; DiT-S: 384, and DiT-B's 768 no longer fits: the x strip stays in shared
    memory), tokens a multiple of 64, whole blocks of ``pool_block`` (up to 64) in a strip. Callers fall back to
    the two ops."""
    if x.ndim != 3 or num_heads < 1 or x.shape[-1] % num_heads:
        return False
    n, dim = x.shape[1], x.shape[2]
    pool_ok = pool_block is None or (pool_block & (pool_block - 1) == 0 and 1 <= pool_block <= 64)
    return n > 0 and pool_ok and _strips(n, dim, dim // num_heads) is not None


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
    blocks = _strips(n, dim, dim // num_heads)
    if TMA_LOADS:
        weight = TensorDescriptor(weight, [3 * dim, dim], [dim, 1], [blocks["BN"], blocks["BK"]])
    _qkv_norm_rope_kernel[(b * n // blocks["BM"],)](
        x, weight, bias, norm_weights, cos, sin, out, means, n, b * num_heads, eps,
        C=dim, H=num_heads, D=dim // num_heads, POOL=pool_block, STAGES=1 if PREFETCH else STAGES,
        PRODUCTS_ONLY=products_only, TMA=TMA_LOADS, PREFETCH=PREFETCH, num_warps=WARPS, **blocks,
    )  # fmt: skip


def qkv_norm_rope_products(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x fp16 / bf16 ``[batch, tokens, dim]``, the weight and bias in its dtype) by
    ``qkv_norm_rope``'s GEMM with the strips and steps it takes for ``num_heads``, no epilogue: for benchmarks
    (scripts/ab_qkv_gemm.py), what its products cost against cuBLAS's. Shapes as ``qkv_norm_rope_fits`` takes them."""
    b, n, dim = x.shape
    out, unused = x.new_empty((b, n, 3 * dim)), x.new_empty(0)
    _launch(x.contiguous(), weight.contiguous(), bias.contiguous(), unused, unused, unused, out, unused, num_heads,
            0.0, 0, products_only=True)  # fmt: skip
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
            f"qkv_norm_rope: the kernel needs head_dim a power of two from 16 to 128, dim one of {KERNEL_DIMS}, "
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
