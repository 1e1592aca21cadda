"""qk-norm + 2-D RoPE + head layout in one pass: the DiT attention's prologue (docs/algorithms.md, "The pixel DiT"),
forward and backward.

    from pixdit.kernels import qk_norm_rope
    q, k, v = qk_norm_rope(qkv, num_heads, q_weight, k_weight, cos, sin, eps=1e-5)
    # qkv: [batch, tokens, 3 * heads * head_dim] (the qkv projection's output)
    # q, k, v: [batch, heads, tokens, head_dim]

Per token and head: ``q = rope(rms_norm(q_raw) * q_weight)``, the same for k with ``k_weight``, v unchanged, where
``rms_norm(x) = x / sqrt(mean(x^2) + eps)`` over head_dim and ``rope`` rotates the interleaved pairs
``(x[2j], x[2j+1])`` by the angle whose cos / sin are ``cos[token, j]`` / ``sin[token, j]``.

Why a kernel: in eager PyTorch this is ~15 memory-bound passes over [tokens, dim] tensors per layer (norms, fp32
casts, four multiplies and a stack per RoPE, the transposes to [batch, heads, tokens, head_dim] that the attention
kernels read); torch.compile fuses them but its kernel ran at about a quarter of the H200's bandwidth. Here the
forward reads qkv once and writes q, k, v once, contiguous in the layout the attention kernels flatten without a copy;
the backward reads the three gradients and qkv once and writes d(qkv) once. Math in fp32, one rounding at the store
(the PyTorch path rounds after the norm and again in RoPE, as the model did before this kernel). The weight gradients
are per-program partial sums added in a fixed order: deterministic, no atomics.

With ``pool_block=B`` it also returns the fp32 means of every B consecutive tokens of the q, k, v it wrote
(``block_mean`` of each; ``[3, batch, heads, tokens / B, head_dim]``, no gradient): the first level of the pyramid
that LLSA's selection and pooled bank start from, and the tile means VSA and SLA start from. The kernel has those
rows in registers already, so the means cost an fp32 write of 1/8 of the output's bf16 bytes instead of a separate
pass that reads q, k and v again (in a compiled 256² sampler, Inductor's fused means were 12% of the GPU time, at ~1
TB/s; the kernel takes 7% longer with them, and sampling got 1.10x faster: docs/kernel_notes.md v20).

With ``bias`` (the qkv projection's bias, left out of its matmul) the kernel adds it to the rows it reads, in
fp32, and its backward sums the gradient it writes over each program's rows: the bias's gradient without the
separate pass over d(qkv) that autograd's sum would make (0.6 GB per DiT-S block at 256², ~2 ms of a 157 ms
training step; docs/kernel_notes.md v40). The bias is then in q, k and v, and the means.

With ``v_view=True`` v is not written: it is returned as a view of qkv's v columns, for a consumer that reads it
there (LLSA's forward without autograd: sampling), which saves a sixth of the kernel's bytes.

CPU tensors (and ``impl="torch"``) run ``qk_norm_rope_torch``, the plain PyTorch composition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .blocks import block_mean
from .common import use_triton
from .ops import cdiv, custom_op, next_power_of_2

__all__ = ["apply_rope", "qk_norm_rope", "qk_norm_rope_torch"]

ROWS_PER_PROGRAM = 64  # tokens per program (the forward: more when pooling, ``_forward_rows``)
MAX_POOL_BLOCK = 128  # a forward program holds whole blocks (max(64, pool_block) rows): bigger tiles are untried


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs: (a, b) -> (a cos - b sin, a sin + b cos). x: [..., tokens, heads, head_dim];
    cos / sin: [tokens, head_dim / 2]."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # broadcast over heads
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps=1e-5, pool_block=None, bias=None):
    """The PyTorch composition (the CPU path; what the model ran before the kernel). Returns [b, heads, n, d] views
    (and the stacked block means when ``pool_block`` is given)."""
    if bias is not None:  # as the projection adds it: in fp32, rounded once to qkv's dtype
        qkv = (qkv.float() + bias.float()).to(qkv.dtype)
    b, n, width = qkv.shape
    head_dim = width // (3 * num_heads)
    q, k, v = qkv.view(b, n, 3, num_heads, head_dim).unbind(2)
    # Under CUDA autocast the norms may return fp32: cast back so q, k, v share one dtype.
    q = F.rms_norm(q, (head_dim,), q_weight.to(q.dtype), eps).to(v.dtype)
    k = F.rms_norm(k, (head_dim,), k_weight.to(k.dtype), eps).to(v.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if pool_block is None:
        return q, k, v
    with torch.no_grad():
        means = torch.stack([block_mean(x, pool_block) for x in (q, k, v)])
    return q, k, v, means


@triton.jit
def _forward_program(n, ROWS: tl.constexpr):
    """A forward program's part (0 = q, 1 = k, 2 = v), batch index and token tile, and the batch size. One program
    per (batch, token tile, part), the part varying fastest (``_forward_grid``), that walks every head of its part:
    a q or k program loads its rows' fp32 cos and sin once for all heads instead of once per head (per token, the
    twelve loads of a 6-head model were 6 KB of L2 reads against 2.3 KB of qkv), and the three programs of a tile
    read whole rows of qkv. Measured 1.13-1.15x faster than one program per head (docs/kernel_notes.md v29). The
    backward keeps one program per head: walking the heads there held 168 registers and measured 1.23x slower."""
    n_tiles = tl.cdiv(n, ROWS)
    part, rest = tl.program_id(0) % 3, tl.program_id(0) // 3
    return part, rest // n_tiles, rest % n_tiles, tl.num_programs(0) // (3 * n_tiles)


@triton.jit
def _backward_program(n, num_heads, ROWS: tl.constexpr):
    """A backward program's part (0 = q, 1 = k, 2 = v), batch * head index and token tile, and the number of (batch,
    head) pairs and of token tiles. A one-dimensional launch (``_backward_grid``) with the parts and heads varying
    fastest: the programs in flight read the neighbouring channels of the same token rows, so whole rows of qkv
    stream from memory, instead of one head's 128 bytes of each row, 2,304 bytes apart, in a tile-major order."""
    parts = 3 * num_heads  # (part, head) pairs
    n_tiles = tl.cdiv(n, ROWS)
    pair, rest = tl.program_id(0) % parts, tl.program_id(0) // parts
    batch, tile = rest // n_tiles, rest % n_tiles
    n_bh = tl.num_programs(0) // (parts * n_tiles) * num_heads
    return pair // num_heads, batch * num_heads + pair % num_heads, tile, n_bh, n_tiles


@triton.jit
def _out_offset(bh, rows, dims, n, HEAD_DIM: tl.constexpr):
    """Offsets of these token rows and channels in one [b, heads, n, d] output (``bh = batch * heads + head``)."""
    return bh.to(tl.int64) * n * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]


@triton.jit
def _tile(bh, part, rows, num_heads, n, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One tile of q, k or v with these token rows: its channels, mask of real rows and channels (DIM_PAD = head_dim
    rounded up to a power of two), batch index, channel offsets in a [b, n, 3, heads, d] row, and offsets in one
    [b, heads, n, d] output. Whole rows are loaded and stored: contiguous accesses."""
    dims = tl.arange(0, DIM_PAD)
    mask = (rows < n)[:, None] & (dims < HEAD_DIM)[None, :]
    channels = (part * num_heads + bh % num_heads) * HEAD_DIM + dims[None, :]
    out_offset = _out_offset(bh, rows, dims, n, HEAD_DIM)
    # the batch index in int64: batch * stride_b passes 2^31 at e.g. 32 images of 256^2 tokens x 1152 channels
    return dims, mask, (bh // num_heads).to(tl.int64), channels, out_offset


@triton.jit
def _pooling_order(ROWS: tl.constexpr, POOL: tl.constexpr, LANES: tl.constexpr):
    """The token rows (0..ROWS-1) of a pooling program, in an order in which each block of POOL consecutive tokens
    lands in one warp. Triton spreads a [ROWS, head_dim] tile's rows over LANES lanes of a warp, then over the warps,
    then repeats; a block of consecutive rows would span every warp and its sum would go through shared memory
    (measured: the kernel 2.3x slower). Tile row i = (repeat, warp, lane) holds token warp * POOL + repeat * LANES +
    lane, so a block is summed in registers and across lanes. Any order is correct; this one is fast when LANES
    matches Triton's layout (``_lanes``)."""
    i = tl.arange(0, ROWS)
    WARPS: tl.constexpr = ROWS // POOL
    return ((i // LANES) % WARPS) * POOL + (i // (WARPS * LANES)) * LANES + i % LANES


@triton.jit
def _pairs(x, ROWS: tl.constexpr, DIM_PAD: tl.constexpr):
    """[ROWS, DIM_PAD] -> its even and odd channels, each [ROWS, DIM_PAD / 2] (the interleaved RoPE pairs)."""
    return tl.split(tl.reshape(x, [ROWS, DIM_PAD // 2, 2]))


@triton.jit
def _unpairs(even, odd, ROWS: tl.constexpr, DIM_PAD: tl.constexpr):
    return tl.reshape(tl.join(even, odd), [ROWS, DIM_PAD])


@triton.jit
def _rotation(COS, SIN, rows, n, needed, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """cos and sin of the rows' RoPE angles (zeros, and nothing read, unless ``needed``)."""
    pairs = tl.arange(0, DIM_PAD // 2)
    mask = needed & (rows < n)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    angle = rows[:, None] * (HEAD_DIM // 2) + pairs[None, :]
    return tl.load(COS + angle, mask=mask, other=0.0), tl.load(SIN + angle, mask=mask, other=0.0)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    QKV,
    W,
    BIAS,
    COS,
    SIN,
    OUT,
    MEANS,
    n,
    num_heads,
    stride_b,
    stride_n,
    eps,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    POOL: tl.constexpr,
    LANES: tl.constexpr,
    STORE_V: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    part, batch, tile, n_batch = _forward_program(n, ROWS)
    if not STORE_V and POOL == 0 and part == 2:  # v stays where it is in qkv (``v_view``): nothing to do
        return
    if POOL > 0:
        rows = tile * ROWS + _pooling_order(ROWS, POOL, LANES)
    else:
        rows = tile * ROWS + tl.arange(0, ROWS)
    rotate = part < 2  # q and k: norm and RoPE; v: only the layout changes
    dims = tl.arange(0, DIM_PAD)
    cos, sin = _rotation(COS, SIN, rows, n, rotate, HEAD_DIM, DIM_PAD)
    w = tl.load(W + part * HEAD_DIM + dims, mask=rotate & (dims < HEAD_DIM), other=0.0)[None, :]
    n_bh = n_batch * num_heads
    out = OUT + (part * n_bh).to(tl.int64) * n * HEAD_DIM  # q, k (and v) stacked: [3 or 2, b, heads, n, d]
    # Triton pipelines only loads that feed a dot, so the head loop loads the next head's tile before working on
    # this one's: two tiles in flight per program instead of one, for 128 registers instead of 96-111 (four programs
    # per SM). Bitwise the same; 1.02x faster without the v store (sampling), 1.004x with it (docs/kernel_notes.md v35).
    dims, mask, batch64, channels, _ = _tile(batch * num_heads, part, rows, num_heads, n, HEAD_DIM, DIM_PAD)
    head0 = QKV + batch64 * stride_b + rows[:, None] * stride_n + channels  # head 0's channels of these rows
    x_next = tl.load(head0, mask=mask, other=0.0)
    for head in range(num_heads):
        bh = batch * num_heads + head
        out_offset = _out_offset(bh, rows, dims, n, HEAD_DIM)
        x = x_next.to(tl.float32)
        x_next = tl.load(head0 + (head + 1) * HEAD_DIM, mask=mask & (head + 1 < num_heads), other=0.0)
        if HAS_BIAS:  # this head's channels of the bias (masked rows then hold the bias: never stored)
            x += tl.load(BIAS + (part * num_heads + head) * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0)[None, :]
        if rotate:
            x = x * tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None] * w
            even, odd = _pairs(x, ROWS, DIM_PAD)
            x = _unpairs(even * cos - odd * sin, even * sin + odd * cos, ROWS, DIM_PAD)
        x = x.to(OUT.dtype.element_ty)
        if STORE_V or part < 2:
            tl.store(out + out_offset, x, mask=mask)
        if POOL > 0:  # fp32 means of the stored (rounded) rows, POOL per block; n is a multiple of POOL
            blocks = tile * (ROWS // POOL) + tl.arange(0, ROWS // POOL)
            tiles = tl.reshape(x.to(tl.float32), [POOL // LANES, ROWS // POOL, LANES, DIM_PAD])  # (repeat, block, lane)
            sums = tl.sum(tl.sum(tiles, 0), 1)  # the repeats in registers first, then across lanes: fewer shuffles
            means = MEANS + ((part * n_bh + bh).to(tl.int64) * (n // POOL)) * HEAD_DIM
            block_mask = (blocks < n // POOL)[:, None] & (dims < HEAD_DIM)[None, :]
            tl.store(means + blocks[:, None] * HEAD_DIM + dims[None, :], sums / POOL, mask=block_mask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    QKV,
    W,
    BIAS,
    COS,
    SIN,
    DQ,
    DK,
    DV,
    DQKV,
    DW_PARTIAL,
    DB_PARTIAL,
    n,
    num_heads,
    stride_b,
    stride_n,
    stride_db,
    stride_dn,
    eps,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    part, bh, tile, n_bh, n_tiles = _backward_program(n, num_heads, ROWS)
    rows = tile * ROWS + tl.arange(0, ROWS)
    dims, mask, batch, channels, out_offset = _tile(bh, part, rows, num_heads, n, HEAD_DIM, DIM_PAD)
    qkv_offset = batch * stride_b + rows[:, None] * stride_n + channels
    d_offset = batch * stride_db + rows[:, None] * stride_dn + channels  # d(qkv): its own strides
    # the bias's gradient: this program's partial sum over its rows of the gradient it writes (before rounding)
    b_partial = DB_PARTIAL + ((part * n_bh + bh) * n_tiles + tile) * HEAD_DIM + dims
    if part == 2:  # v: only the layout changes
        dv = tl.load(DV + out_offset, mask=mask, other=0.0)
        tl.store(DQKV + d_offset, dv.to(DQKV.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            tl.store(b_partial, tl.sum(dv.to(tl.float32), 0), mask=dims < HEAD_DIM)
    else:
        if part == 0:
            g = tl.load(DQ + out_offset, mask=mask, other=0.0).to(tl.float32)
        else:
            g = tl.load(DK + out_offset, mask=mask, other=0.0).to(tl.float32)
        # RoPE's adjoint is the rotation by the opposite angle: the gradient w.r.t. the normalised, weighted y
        g_even, g_odd = _pairs(g, ROWS, DIM_PAD)
        cos, sin = _rotation(COS, SIN, rows, n, True, HEAD_DIM, DIM_PAD)
        dy = _unpairs(g_even * cos + g_odd * sin, g_odd * cos - g_even * sin, ROWS, DIM_PAD)
        x = tl.load(QKV + qkv_offset, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # masked rows hold the bias, but their dy is 0, so are their gradients
            x += tl.load(BIAS + channels, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        xhat = x * inv_rms
        w = tl.load(W + part * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0)[None, :]
        # d weight: this program's partial sum over its rows (masked rows load 0 and contribute 0)
        partial = DW_PARTIAL + ((part * n_bh + bh) * n_tiles + tile) * HEAD_DIM + dims
        tl.store(partial, tl.sum(dy * xhat, 0), mask=dims < HEAD_DIM)
        # d x = inv_rms * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dy * w
        dxhat = dy * w
        mean_dot = (tl.sum(dxhat * xhat, 1) / HEAD_DIM)[:, None]
        dx = inv_rms * (dxhat - xhat * mean_dot)
        tl.store(DQKV + d_offset, dx.to(DQKV.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            tl.store(b_partial, tl.sum(dx, 0), mask=dims < HEAD_DIM)


def _tiles(n: int, rows: int = ROWS_PER_PROGRAM) -> int:
    return cdiv(n, rows)


def _backward_grid(b, n, num_heads):
    """The backward's programs: one per (batch, token tile, part, head), the last varying fastest
    (``_backward_program``)."""
    return (b * _tiles(n) * 3 * num_heads,)


def _forward_grid(b, n, rows):
    """The forward's programs: one per (batch, token tile, part), the last varying fastest (``_forward_program``)."""
    return (b * _tiles(n, rows) * 3,)


def _forward_rows(pool_block: int) -> int:
    """Token rows per forward program: whole blocks of ``pool_block`` (a power of two) when pooling."""
    return max(ROWS_PER_PROGRAM, pool_block)


def _lanes(dtype: torch.dtype, dim_pad: int, pool_block: int) -> int:
    """Lanes of a warp that Triton's default layout gives a tile's rows: 16-byte vectors along head_dim, the rest of
    the warp's 32 lanes along the rows (bf16, head_dim 64: 8 lanes along head_dim, 4 along the rows); at most a
    block, so that ``_pooling_order`` stays an order of the block's tokens."""
    along_dim = min(32, max(1, dim_pad // (16 // dtype.itemsize)))
    return max(1, min(32 // along_dim, pool_block))


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, num_heads, eps, pool_block, store_v, bias):
        # store_v False: v is not written (the caller takes a view of qkv), so it gets no gradient here
        weights = torch.stack([q_weight, k_weight]).float().contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        bias32 = bias.float().contiguous() if bias is not None else None
        out, means = _qk_norm_rope_op(qkv, weights, cos, sin, num_heads, eps, pool_block, store_v, bias32)
        ctx.save_for_backward(qkv, weights, cos, sin, bias32)
        ctx.num_heads, ctx.eps, ctx.weight_dtypes = num_heads, eps, (q_weight.dtype, k_weight.dtype)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(means)
        return (*out.unbind(0), means)  # q, k, (v,) means

    @staticmethod
    def backward(ctx, dq, dk, *rest):
        dv = rest[0] if len(rest) == 2 else None  # rest: (dv, d means), or (d means,) without store_v
        qkv, weights, cos, sin, bias32 = ctx.saved_tensors
        b, n, width = qkv.shape
        num_heads = ctx.num_heads
        head_dim = width // (3 * num_heads)
        zeros = None
        grads = []
        for g in (dq, dk, dv):  # a q/k/v that did not reach the loss has no gradient
            if g is None:
                zeros = (
                    zeros
                    if zeros is not None
                    else torch.zeros(b, num_heads, n, head_dim, device=qkv.device, dtype=qkv.dtype)
                )
                g = zeros
            grads.append(g.contiguous())
        dqkv, dw_partial, db_partial = _qk_norm_rope_backward_op(
            qkv, weights, cos, sin, *grads, num_heads, ctx.eps, bias32
        )
        dw = dw_partial.sum(dim=(1, 2))  # fixed reduction order: deterministic
        (q_dtype, k_dtype) = ctx.weight_dtypes
        dbias = None
        if bias32 is not None:  # [3, b * heads, tiles, d] -> the channels (part, head, d) of qkv's last dim
            db = db_partial.view(3, b, num_heads, -1, head_dim).sum(dim=(1, 3))
            dbias = db.reshape(width).to(ctx.bias_dtype)
        return dqkv, dw[0].to(q_dtype), dw[1].to(k_dtype), None, None, None, None, None, None, dbias


# The two launches as torch custom ops (opaque to torch.compile, which traces the code around them). Each op's
# outputs are allocated by one function that its fake-tensor rule returns too, so the two cannot disagree on a shape
# or a layout.
def _forward_out(
    qkv: torch.Tensor, num_heads: int, pool_block: int, store_v: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k and v (q and k without ``store_v``) stacked ``[3 or 2, b, heads, n, head_dim]`` in qkv's dtype, and the
    fp32 block means of q, k, v stacked ``[3, b, heads, n / pool_block, head_dim]`` (no blocks when ``pool_block`` is
    0)."""
    b, n, width = qkv.shape
    head_dim = width // (3 * num_heads)
    blocks = n // pool_block if pool_block else 0
    return qkv.new_empty((3 if store_v else 2, b, num_heads, n, head_dim)), qkv.new_empty(
        (3, b, num_heads, blocks, head_dim), dtype=torch.float32
    )


def _backward_out(qkv: torch.Tensor, num_heads: int, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d qkv (contiguous ``[b, n, width]``, whatever qkv's layout), the weights' per-program partial gradients
    (fp32 ``[2, b * heads, programs, head_dim]``) and the bias's (``[3, b * heads, programs, head_dim]``; empty without
    a bias)."""
    b, n, width = qkv.shape
    programs = _tiles(n)
    head_dim = width // (3 * num_heads)
    dw_partial = qkv.new_empty((2, b * num_heads, programs, head_dim), dtype=torch.float32)
    db_shape = (3, b * num_heads, programs, head_dim) if has_bias else (0,)
    return qkv.new_empty((b, n, width)), dw_partial, qkv.new_empty(db_shape, dtype=torch.float32)


@custom_op("qk_norm_rope")
def _qk_norm_rope_op(
    qkv: torch.Tensor,
    weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    eps: float,
    pool_block: int,
    store_v: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, _ = qkv.shape
    out, means = _forward_out(qkv, num_heads, pool_block, store_v)
    head_dim = out.shape[-1]
    rows = _forward_rows(pool_block)
    _qk_norm_rope_fwd_kernel[_forward_grid(b, n, rows)](
        qkv,
        weights,
        bias if bias is not None else weights,  # not read without HAS_BIAS
        cos,
        sin,
        out,
        means,
        n,
        num_heads,
        qkv.stride(0),
        qkv.stride(1),
        eps,
        HEAD_DIM=head_dim,
        DIM_PAD=next_power_of_2(head_dim),
        ROWS=rows,
        POOL=pool_block,
        LANES=_lanes(qkv.dtype, next_power_of_2(head_dim), pool_block) if pool_block else 1,
        STORE_V=store_v,
        HAS_BIAS=bias is not None,
        # No FMA contraction: with the head walk, the compiler fused the multiply-adds of the norm and the rotation
        # differently with and without POOL, so fp32 outputs differed in the last bit; unfused, both round every op
        # the same way (and as fast: the kernel is bound by memory).
        enable_fp_fusion=False,
    )
    return out, means


@_qk_norm_rope_op.register_fake
def _(qkv, weights, cos, sin, num_heads, eps, pool_block, store_v, bias):
    return _forward_out(qkv, num_heads, pool_block, store_v)


# Returns ``_backward_out``'s three tensors, filled.
@custom_op("qk_norm_rope_backward")
def _qk_norm_rope_backward_op(
    qkv: torch.Tensor,
    weights: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    num_heads: int,
    eps: float,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, _ = qkv.shape
    dqkv, dw_partial, db_partial = _backward_out(qkv, num_heads, bias is not None)
    head_dim = dw_partial.shape[-1]
    _qk_norm_rope_bwd_kernel[_backward_grid(b, n, num_heads)](
        qkv,
        weights,
        bias if bias is not None else weights,  # not read without HAS_BIAS
        cos,
        sin,
        dq,
        dk,
        dv,
        dqkv,
        dw_partial,
        db_partial if bias is not None else dw_partial,  # not written without HAS_BIAS
        n,
        num_heads,
        qkv.stride(0),
        qkv.stride(1),
        dqkv.stride(0),
        dqkv.stride(1),
        eps,
        HEAD_DIM=head_dim,
        DIM_PAD=next_power_of_2(head_dim),
        ROWS=ROWS_PER_PROGRAM,
        HAS_BIAS=bias is not None,
    )
    return dqkv, dw_partial, db_partial


@_qk_norm_rope_backward_op.register_fake
def _(qkv, weights, cos, sin, dq, dk, dv, num_heads, eps, bias):
    return _backward_out(qkv, num_heads, bias is not None)


def check_norm_args(caller: str, n: int, head_dim: int, q_weight, k_weight, cos, sin, pool_block) -> None:
    """The norm weights, RoPE tables and ``pool_block`` of a prologue over ``n`` tokens with heads of ``head_dim``
    (``qk_norm_rope``, ``qkv_norm_rope``): one message naming the bad argument, prefixed by ``caller``."""
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (head_dim,):
            raise ValueError(f"{caller}: {name} must have shape ({head_dim},) (head_dim), got {tuple(weight.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (n, head_dim // 2):
            raise ValueError(
                f"{caller}: {name} must have shape ({n}, {head_dim // 2}) (tokens, head_dim / 2), "
                f"got {tuple(table.shape)}"
            )
    if pool_block is not None and (
        isinstance(pool_block, bool)
        or not isinstance(pool_block, int)
        or not 1 <= pool_block <= MAX_POOL_BLOCK
        or pool_block & (pool_block - 1)
        or n % pool_block
    ):
        raise ValueError(
            f"{caller}: pool_block must be None or a power of two up to {MAX_POOL_BLOCK} that divides "
            f"tokens={n}, got {pool_block!r}"
        )


def qk_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    impl: str = "auto",
    pool_block: int | None = None,
    v_view: bool = False,
    bias: torch.Tensor | None = None,
):
    """RMS qk-norm with per-channel weights, 2-D RoPE on q and k, and the head split, differentiable in qkv and
    both weights; with ``pool_block``, also the block means of q, k and v.

    Args:
        qkv: ``[batch, tokens, 3 * num_heads * head_dim]`` (q, k, v concatenated, each heads-major), last dim
            contiguous. Triton path: fp16/bf16/fp32, an even head_dim up to 256.
        q_weight, k_weight: ``[head_dim]`` norm weights (shared across heads).
        cos, sin: ``[tokens, head_dim / 2]`` rotation of each interleaved pair (fp32).
        eps: added to the mean square.
        impl: "auto" (Triton on CUDA, PyTorch on CPU), "triton" (also under TRITON_INTERPRET=1), "torch".
        pool_block: None, or a power of two up to 128 dividing ``tokens``: also return ``means``.
        v_view: return v as a view of qkv's v columns (``[batch, num_heads, tokens, head_dim]`` with qkv's strides)
            instead of writing a contiguous copy: a sixth of the kernel's bytes, for a consumer that reads v where
            it is (``llsa_attention`` when no gradient is needed, i.e. sampling). Still differentiable (v's gradient
            then reaches qkv through the view, an extra pass), so meant for inference.
        bias: None, or ``[3 * num_heads * head_dim]``: added to qkv first (in fp32 on the Triton path; the qkv
            projection's bias, left out of its matmul), differentiable, its gradient summed in the backward's pass.
            Not with ``v_view`` (the view would lack it).
    Returns:
        q, k, v: ``[batch, num_heads, tokens, head_dim]`` in qkv's dtype (contiguous on the Triton path, but v with
        ``v_view``).
        means (only with ``pool_block``): fp32 ``[3, batch, num_heads, tokens / pool_block, head_dim]``, the means of
        each ``pool_block`` consecutive tokens of the returned q, k, v (``block_mean``; the summation order may
        differ, so equal to fp32 rounding), without gradient.
    """
    if qkv.ndim != 3 or num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(
            f"qk_norm_rope: qkv must be [batch, tokens, 3 * num_heads * head_dim] with "
            f"num_heads={num_heads}, got shape {tuple(qkv.shape)}"
        )
    b, n, width = qkv.shape
    head_dim = width // (3 * num_heads)
    check_norm_args("qk_norm_rope", n, head_dim, q_weight, k_weight, cos, sin, pool_block)
    if bias is not None and (tuple(bias.shape) != (width,) or v_view):
        raise ValueError(
            f"qk_norm_rope: bias must be None or of shape ({width},) (qkv's last dim), and None with v_view=True "
            f"(v is then a view of qkv, without the bias), got shape {tuple(bias.shape)} and v_view={v_view}"
        )
    if not use_triton(qkv, impl):
        return qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps, pool_block, bias)
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qk_norm_rope: qkv dtype must be float16, bfloat16 or float32, got {qkv.dtype}")
    if head_dim % 2 or head_dim > 256:
        raise ValueError(f"qk_norm_rope: head_dim must be even and at most 256 on the Triton path, got {head_dim}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    *outs, means = _QKNormRope.apply(
        qkv, q_weight, k_weight, cos, sin, num_heads, float(eps), pool_block or 0, not v_view, bias
    )
    q, k, v = outs if not v_view else (*outs, qkv.unflatten(-1, (3, num_heads, head_dim))[:, :, 2].transpose(1, 2))
    return (q, k, v) if pool_block is None else (q, k, v, means)
