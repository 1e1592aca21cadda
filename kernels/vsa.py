"""VSA — Video Sparse Attention (arXiv 2505.13389): coarse attention over tiles + top-K fine attention.

    from pixdit.kernels import vsa_attention
    out = vsa_attention(q, k, v, block_size=16, topk=32, gate=g)      # q, k, v, g: [batch, heads, tokens, head_dim]

What it computes (docs/algorithms.md, "VSA"), per (batch, head), with tiles = ``block_size`` consecutive tokens
(square pixel patches under the model's Z-order; the last tile may be partial and then holds the
``tokens mod block_size`` remaining tokens):

1. coarse stage: mean-pool q, k, v per tile (fp32, over the tile's real tokens), dense softmax attention between the
   ``T`` pooled tokens, the tile's output broadcast to all its tokens (``O_coarse``);
2. selection: per query tile the ``K`` key tiles with the largest coarse scores, ties toward the smaller tile id;
3. fine stage: exact softmax attention of every query over the real tokens of its tile's ``K`` selected tiles;
4. ``out = O_fine + gate * O_coarse`` (``gate=None``: ungated). The gate is the layer's zero-initialised projection
   of its hidden states, so at initialisation VSA equals the fine stage. The paper's optional fine gate
   ``gate_fine`` multiplies ``O_fine`` (absent = 1, as in the authors' production code).

Arguments: exactly one of ``topk`` (int >= 1, clamped to ``T``) or ``topk_ratio`` (the share of tiles kept, a float
in [0, 1]: ``K = clamp(ceil(topk_ratio * T), 1, T)``, the product rounded to 6 decimals first so that float noise such
as ``0.3 * 10 = 3.0000000000000004`` does not add a tile). ``block_size`` in {16, 32, 64}; ``head_dim`` in
{16, 32, 64, 128}; any number of tokens >= 1; ``scale`` defaults to ``head_dim ** -0.5`` (both stages).

``impl="auto"``: CPU tensors run the exact PyTorch path (fp32 math, gather form, output in the input dtype); CUDA
tensors the Triton path: the fine stage is the shared block-sparse FlashAttention (``block_sparse.py``, backward
over the deterministic CSC transpose of the tile lists, no float atomics, no dense mask), the coarse stage our dense
FlashAttention (same kernels, every key walked as one range) over the pooled tokens in the input dtype; both stages
are one autograd node whose fine backward kernels add the pooled tokens' gradients in their epilogues, and the gated
sum is one Triton pass each way (``_GatedCombine``: the coarse output is never broadcast in memory).
``impl="triton"`` forces Triton (CPU under TRITON_INTERPRET=1), ``impl="torch"`` the PyTorch path. Selection (fp32
pooled scores, chunked) is not differentiable; gradients reach q, k, v through both stages and reach ``gate``.
Tests: ``.venv/bin/python -m pytest tests/kernels/test_vsa.py tests/kernels/test_vsa_triton.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .block_sparse import (
    DENSE_KV_TILE,
    DENSE_TILE,
    block_sparse_attention,
    bsa_backward,
    bsa_forward,
    dense_walk,
    flat_lists,
    flatten_grad,
    flatten_heads,
    flatten_kv,
    head_offset,
)
from .blocks import block_mean, block_means
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
from .ops import cdiv, custom_op


def _tile_means(xs: list[torch.Tensor], block_size: int, triton_path: bool) -> list[torch.Tensor]:
    """fp32 tile means ``[B, H, T, D]`` of each of ``xs`` without gradient: on the Triton path by one kernel
    (``block_means``; SLA's pooling by it took 0.076 ms at 256² against 0.162 for PyTorch's reductions,
    docs/kernel_notes.md v50), else ``block_mean``; the same values up to fp32 summation order."""
    if triton_path:
        return list(block_means([x.detach() for x in xs], block_size).unbind(0))
    return [block_mean(x.detach(), block_size) for x in xs]


def vsa_select(
    q, k, block_size: int = 16, topk=None, topk_ratio=None, scale=None, impl: str = "auto", means=None
) -> torch.Tensor:
    """The key tiles each query tile attends to in the fine stage: int32 ``[B, H, T, K]``, best first. ``means``:
    as ``vsa_attention``'s."""
    check_qkv(q, k, k, name="vsa_select", scale=scale)
    check_block_size(block_size)
    kk = resolve_topk(num_blocks(q.shape[2], block_size), topk, topk_ratio)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    triton_path = use_triton(q, impl)
    if means is None:
        q_pool, k_pool = _tile_means([q, k], block_size, triton_path)
    else:
        q_pool, k_pool, _ = check_means(means, q, block_size, "vsa_select").unbind(0)
    return select_topk_blocks(q_pool, k_pool, kk, scale, use_triton_topk=triton_path)


def vsa_attention(
    q,
    k,
    v,
    block_size: int = 16,
    topk=None,
    topk_ratio=None,
    gate=None,
    scale=None,
    impl: str = "auto",
    tile_idx=None,
    gate_fine=None,
    means=None,
) -> torch.Tensor:
    """VSA output ``O_fine + gate * O_coarse`` ``[batch, heads, tokens, head_dim]``; see the module docstring.

    ``tile_idx``: optional precomputed selection from ``vsa_select`` (then ``topk``/``topk_ratio`` are not needed),
    e.g. to run two paths on the same selection. ``gate_fine``: the paper's optional fine gate ``G_f`` (shaped like
    q): ``O_fine * gate_fine + gate * O_coarse`` (absent = 1, as in the authors' production code). ``means``: the
    fp32 tile means of q, k and v stacked, ``[3, batch, heads, T, head_dim]``, when the caller has them
    (``qk_norm_rope(..., pool_block=block_size)`` computes them while writing q, k, v); they replace the pooling
    wherever no gradient flows through it: the selection, and on the Triton path the coarse stage (whose backward
    adds the pooled tokens' gradients itself). Means that are not those of q, k, v give a wrong result."""
    check_qkv(q, k, v, name="vsa_attention", scale=scale)
    check_block_size(block_size)
    for name, x in (("gate", gate), ("gate_fine", gate_fine)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != q.shape):
            raise ValueError(
                f"{name} must be None or a tensor shaped like q {tuple(q.shape)}, "
                f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
    triton_path = use_triton(q, impl)
    if tile_idx is None:
        kk = resolve_topk(num_blocks(q.shape[2], block_size), topk, topk_ratio)
    else:
        check_selection(tile_idx, q, block_size, "tile_idx")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n, c = q.shape[2], block_size
    if means is not None:
        means = check_means(means, q, block_size, "vsa_attention")

    if triton_path:
        # [B, H, T, D] fp32 without gradient: the pooled tokens' gradients are added inside the fused backward
        pooled = _tile_means([q, k, v], c, True) if means is None else list(means.unbind(0))
        if tile_idx is None:
            tile_idx = select_topk_blocks(pooled[0], pooled[1], kk, scale, use_triton_topk=True)
        q, k, v = autocast_inputs(q, k, v)
        out_fine, out_coarse = _VSATriton.apply(q, k, v, flat_lists(tile_idx, q), c, scale, *pooled)
        out_fine = out_fine.transpose(1, 2)  # [b, h, n, d], a view of the fine pass's tokens-major output
        if gate_fine is not None:
            out_fine = out_fine * gate_fine
        return _add_coarse(out_fine, out_coarse, gate, c)

    # exact fp32 PyTorch path: coarse stage differentiable through the pooling, fine stage in the gather form
    q_pool, k_pool, v_pool = (block_mean(x, c) for x in (q, k, v))  # [B, H, T, D] fp32
    if tile_idx is None:
        scored = (q_pool, k_pool) if means is None else (means[0], means[1])
        tile_idx = select_topk_blocks(*scored, kk, scale, use_triton_topk=False)
    out_coarse = torch.softmax(scale * q_pool @ k_pool.transpose(-1, -2), -1) @ v_pool
    b, h, t, d = out_coarse.shape
    out_coarse = out_coarse[:, :, :, None].expand(b, h, t, c, d).reshape(b, h, t * c, d)[:, :, :n]
    out_fine = block_sparse_attention(
        q.float(), k.float(), v.float(), tile_idx, query_block=c, key_block=c, scale=scale, impl="torch"
    )
    if gate_fine is not None:
        out_fine = out_fine * gate_fine.float()
    return (out_fine + (out_coarse if gate is None else out_coarse * gate.float())).to(q.dtype)


class _VSATriton(torch.autograd.Function):
    """Both stages of VSA as one autograd node: ``(q, k, v) -> (O_fine, O_coarse)``, the fine output tokens-major
    ``[b, n, h, d]`` (the layout of the gated sum and of a model's projection input, so neither direction copies it)
    and the coarse output per tile ``[b, h, T, d]``, both in the input dtype. Its backward runs the coarse (pooled)
    pass first and hands the pooled tokens' fp32 gradients to the fine pass's dq and dk/dv kernels, which add each
    tile's ``g / count`` in their epilogues: without this node autograd would broadcast three pooled gradients to
    token size and add them to the fine gradients, six extra full-size passes (docs/kernel_notes.md v12)."""

    @staticmethod
    def forward(ctx, q, k, v, lists, block_size, scale, q_pool, k_pool, v_pool):
        b, h, n, d = q.shape
        t = q_pool.shape[2]
        qf, (kf, vf) = flatten_heads(q), flatten_kv(k, v)
        # coarse stage: our dense FlashAttention over the T pooled tokens, in the input dtype (no [T, T] kept)
        pq, pk, pv = (x.to(q.dtype).reshape(b * h, t, d) for x in (q_pool, k_pool, v_pool))
        dense, dense_tail, dense_csc = dense_walk(t, t, q.device)
        o_coarse, lse_coarse = bsa_forward(pq, pk, pv, dense, DENSE_TILE, DENSE_TILE, scale, dense_tail=dense_tail)
        # fine stage: each query tile over its K selected key tiles (the shared block-sparse kernel)
        o_fine, lse_fine = bsa_forward(qf, kf, vf, lists, block_size, block_size, scale, out_heads=h)
        ctx.save_for_backward(qf, kf, vf, lists, o_fine, lse_fine, pq, pk, pv, o_coarse, lse_coarse)
        ctx.cfg = (block_size, scale, q.shape, dense, dense_tail, dense_csc)
        return o_fine, o_coarse.view(b, h, t, d)

    @staticmethod
    def backward(ctx, do_fine, do_coarse):
        qf, kf, vf, lists, o_fine, lse_fine, pq, pk, pv, o_coarse, lse_coarse = ctx.saved_tensors
        c, scale, shape, dense, dense_tail, dense_csc = ctx.cfg
        pooled_grads = bsa_backward(  # fp32 gradients of the pooled tokens, first
            pq,
            pk,
            pv,
            flatten_grad(do_coarse),
            o_coarse,
            lse_coarse,
            dense,
            DENSE_TILE,
            DENSE_TILE,
            scale,
            csc=dense_csc,
            out_dtype=torch.float32,
            dkdv_block=DENSE_KV_TILE,
            dense_tail=dense_tail,
        )
        # dO_fine tokens-major like O_fine (the kernels read both with dO's strides)
        grads = bsa_backward(qf, kf, vf, do_fine, o_fine, lse_fine, lists, c, c, scale, pooled_add=pooled_grads)
        return (*(g.view(shape) for g in grads), None, None, None, None, None, None)


# ------------------------------------------------------------------------------ out = O_fine + gate * O_coarse
# One Triton pass each way instead of PyTorch's broadcast addcmul, whose backward runs the gate's product, the coarse
# output's product and the sum over each tile as separate passes; with the gate's gradient (training), measured on the
# H200 at 128² and 256²: 0.46-0.59 ms -> 0.24-0.35 ms per call (docs/kernel_notes.md v14).
_COMBINE_ROWS = 64  # token rows per program (whole tiles: the tile size divides it)


@triton.jit
def _combine_rows(n, heads, D: tl.constexpr, ROWS: tl.constexpr):
    """This program's ``ROWS`` token rows of one (batch, head): ``(bh, rows, row mask [ROWS, 1], dims, their offsets
    in a contiguous tokens-major [b, n, heads, D] tensor)``."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    offsets = head_offset(bh, heads, n * heads * D, D) + rows[:, None] * (heads * D) + dims[None, :]
    return bh, rows, (rows < n)[:, None], dims, offsets


@triton.jit
def _coarse_of_rows(COARSE, bh, rows, ok, dims, t, D: tl.constexpr, C: tl.constexpr):
    """Each row's tile output, gathered from the per-tile ``[BH, t, D]`` rows (the broadcast, never written)."""
    return tl.load(COARSE + bh * t * D + (rows // C)[:, None] * D + dims[None, :], mask=ok, other=0.0)


@triton.jit
def _gate_of_rows(GATE, bh, rows, ok, dims, heads, stride_gb, stride_gh, stride_gn):
    """The rows of the gate ``[b, h, n, D]``, any layout with a unit last stride (``_gate_strides``)."""
    gate_rows = head_offset(bh, heads, stride_gb, stride_gh) + rows[:, None] * stride_gn
    return tl.load(GATE + gate_rows + dims[None, :], mask=ok, other=0.0)


@triton.jit
def _combine_fwd_kernel(
    FINE,
    COARSE,
    GATE,
    OUT,
    n,
    t,
    heads,
    stride_gb,
    stride_gh,
    stride_gn,
    D: tl.constexpr,
    C: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    bh, rows, ok, dims, offsets = _combine_rows(n, heads, D, ROWS)
    coarse = _coarse_of_rows(COARSE, bh, rows, ok, dims, t, D, C)
    out = tl.load(FINE + offsets, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        gate = _gate_of_rows(GATE, bh, rows, ok, dims, heads, stride_gb, stride_gh, stride_gn)
        out += gate.to(tl.float32) * coarse.to(tl.float32)
    else:
        out += coarse.to(tl.float32)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _combine_bwd_kernel(
    GO,
    COARSE,
    GATE,
    D_GATE,
    D_COARSE,
    n,
    t,
    heads,
    stride_gb,
    stride_gh,
    stride_gn,
    D: tl.constexpr,
    C: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    GATE_GRAD: tl.constexpr,
):
    # d_gate = dO * coarse (broadcast); d_coarse[tile] = sum over its tokens of dO * gate, in fp32 in a fixed order
    bh, rows, ok, dims, offsets = _combine_rows(n, heads, D, ROWS)
    go = tl.load(GO + offsets, mask=ok, other=0.0).to(tl.float32)
    if HAS_GATE:
        if GATE_GRAD:
            coarse = _coarse_of_rows(COARSE, bh, rows, ok, dims, t, D, C)
            tl.store(D_GATE + offsets, (go * coarse.to(tl.float32)).to(D_GATE.dtype.element_ty), mask=ok)
        go *= _gate_of_rows(GATE, bh, rows, ok, dims, heads, stride_gb, stride_gh, stride_gn).to(tl.float32)
    TILES: tl.constexpr = ROWS // C
    d_coarse = tl.sum(tl.reshape(go, [TILES, C, D]), 1)  # masked rows hold 0
    tiles = tl.program_id(0).to(tl.int64) * TILES + tl.arange(0, TILES)
    tile_offsets = bh * t * D + tiles[:, None] * D + dims[None, :]
    tl.store(D_COARSE + tile_offsets, d_coarse.to(D_COARSE.dtype.element_ty), mask=(tiles < t)[:, None])


def _gate_strides(gate):
    """(batch, head, token) strides of ``gate`` ``[b, h, n, d]`` (any layout with a unit last stride, e.g. the
    head-split view of a projection), 0s without a gate."""
    return gate.stride()[:3] if gate is not None else (0, 0, 0)


class _GatedCombine(torch.autograd.Function):
    """``(O_fine [b, n, h, d], O_coarse per tile [b, h, t, d], gate [b, h, n, d] or None) -> O_fine + gate *
    O_coarse`` ``[b, n, h, d]`` with each tile's coarse output broadcast to its ``c`` tokens, never written at token
    size. The fine output, the sum and its gradient are tokens-major, the layout of the fine pass's output and of a
    model's projection input (``[b, h, n, d]`` here cost a copy each way); the gate's gradient is returned in that
    layout too, as a ``[b, h, n, d]`` view."""

    @staticmethod
    def forward(ctx, fine, coarse, gate, c):
        fine, coarse = fine.contiguous(), coarse.contiguous()
        if gate is not None and gate.stride(-1) != 1:
            gate = gate.contiguous()
        ctx.save_for_backward(coarse, gate)
        ctx.cfg = (c, fine.dtype)
        return _combine_op(fine, coarse, gate, c)

    @staticmethod
    def backward(ctx, grad_out):
        coarse, gate = ctx.saved_tensors
        c, fine_dtype = ctx.cfg
        go = grad_out.contiguous()
        gate_grad = gate is not None and ctx.needs_input_grad[2]
        d_coarse, *d_gate = _combine_backward_op(go, coarse, gate, c, gate_grad)
        return go.to(fine_dtype), d_coarse, d_gate[0].transpose(1, 2) if gate_grad else None, None


# The two gated-sum launches as custom ops. Each op's outputs are allocated by one function that its fake-tensor rule
# returns too, so the two cannot disagree on a shape or a dtype.
def _combine_out(fine, coarse, gate) -> torch.Tensor:
    """The gated sum, ``fine``'s shape in the promoted dtype of the inputs."""
    dtypes = [fine.dtype, coarse.dtype] + ([gate.dtype] if gate is not None else [])
    return fine.new_empty(fine.shape, dtype=functools.reduce(torch.promote_types, dtypes))


def _combine_backward_out(go, coarse, gate, gate_grad: bool) -> list[torch.Tensor]:
    """``[d coarse]``, or ``[d coarse, d gate]`` with ``gate_grad`` (a list: no placeholder for an absent gradient;
    d gate tokens-major like ``go``)."""
    d_coarse = torch.empty_like(coarse)
    return [d_coarse, go.new_empty(go.shape, dtype=gate.dtype)] if gate_grad else [d_coarse]


@custom_op("vsa_combine")
def _combine_op(fine: torch.Tensor, coarse: torch.Tensor, gate: torch.Tensor | None, c: int) -> torch.Tensor:
    b, n, h, d = fine.shape
    out = _combine_out(fine, coarse, gate)
    _combine_fwd_kernel[(cdiv(n, _COMBINE_ROWS), b * h)](
        fine,
        coarse,
        gate if gate is not None else fine,
        out,
        n,
        coarse.shape[2],
        h,
        *_gate_strides(gate),
        D=d,
        C=c,
        ROWS=_COMBINE_ROWS,
        HAS_GATE=gate is not None,
    )
    return out


@_combine_op.register_fake
def _(fine, coarse, gate, c):
    return _combine_out(fine, coarse, gate)


# Returns ``_combine_backward_out``'s list, filled.
@custom_op("vsa_combine_backward")
def _combine_backward_op(
    go: torch.Tensor, coarse: torch.Tensor, gate: torch.Tensor | None, c: int, gate_grad: bool
) -> list[torch.Tensor]:
    b, n, h, d = go.shape
    grads = _combine_backward_out(go, coarse, gate, gate_grad)
    _combine_bwd_kernel[(cdiv(n, _COMBINE_ROWS), b * h)](
        go,
        coarse,
        gate if gate is not None else go,
        grads[1] if gate_grad else go,
        grads[0],
        n,
        coarse.shape[2],
        h,
        *_gate_strides(gate),
        D=d,
        C=c,
        ROWS=_COMBINE_ROWS,
        HAS_GATE=gate is not None,
        GATE_GRAD=gate_grad,
    )
    return grads


@_combine_backward_op.register_fake
def _(go, coarse, gate, c, gate_grad):
    return _combine_backward_out(go, coarse, gate, gate_grad)


def _add_coarse(out_fine, out_coarse, gate, c):
    """``out_fine + gate * O_coarse`` ``[b, h, n, d]`` with each tile's coarse output ``[b, h, t, d]`` broadcast to its
    ``c`` tokens (``_GatedCombine``): a view of tokens-major ``[b, n, h, d]`` memory, read from ``out_fine`` (any
    layout; a view of tokens-major memory is read without a copy)."""
    return _GatedCombine.apply(out_fine.transpose(1, 2), out_coarse, gate, c).transpose(1, 2)
