"""SLA's linear-attention branch (spec ``/work/shared/spec/sla.md`` §7, §10): feature maps, exact and Triton forms.

For a query ``t`` in query block ``i``, with ``w_tu = phi(q_t) . phi(k_u)`` and ``L(i)`` the keys of its linear set:

    O_l[t] = sum_{u in L(i)} w_tu v_u / sum_{u in L(i)} w_tu

``linear_scope="all"``: ``L`` = every key, ``+1e-5`` in the denominator (the authors' current code): two global sums
``sum_u phi(k_u) v_u^T`` (D x D) and ``sum_u phi(k_u)``, ``O(N * D^2)``. Otherwise ``L(i)`` = all keys minus the
excluded blocks ``E(i)`` (critical, and in ``marginal`` scope also negligible), and a row whose denominator is 0
(empty linear set, or relu features that vanish on it) gets ``O_l = 0`` (never the authors' 0/0 = NaN).

Two forms of the excluded-scope branch:

* ``linear_attention_torch`` (CPU, exact): per-block ``h_j = phi(K_j)^T V_j`` summed over the kept blocks with a
  ``[T, T]`` block mask (direct sums, no cancellation; ``O(T^2 D^2)``, fine at CPU sizes).
* ``linear_attention_triton`` (CUDA): ``global sums - excluded part``, where the excluded part
  ``sum_{u in E(i)} w_tu (v_u, 1)`` is a block-sparse pass over the same ``K`` blocks as the sparse branch
  (``_excluded_fwd_kernel``: two tensor-core dots per block, like attention without the exponentials), with a
  query-major dphi(q) kernel and a key-major dphi(k)/dv kernel over the CSC transpose (``blocks.csr_to_csc``): one
  writer per gradient row, no float atomics, deterministic. Cost ``O(N * K * block * D)``, the same order as the
  sparse branch, instead of the ``O(T * K * D^2)`` reads of materialised ``h_j`` blocks (4x more at block 16,
  D = 64) or the ``O(T^2 D^2)`` mask product. The subtraction is done in fp32; a row whose remaining denominator is
  below ``1e-5`` of its full one is treated as empty (fp32 rounding level of the subtraction).

Tests: ``tests/kernels/test_sla.py`` (exact form), ``tests/kernels/test_sla_triton.py`` (Triton form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .block_sparse import list_walk_start, listed_key_rows
from .blocks import csr_to_csc
from .vsa import pad_to_blocks

FEATURE_MAPS = ("softmax", "elu", "relu")
ALL_SCOPE_EPS = 1e-5
EMPTY_ROW_REL_EPS = 1e-5


def feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi along the head dimension: ``softmax``, ``elu`` (= elu(x) + 1, strictly positive) or ``relu``."""
    if name == "softmax":
        return torch.softmax(x, -1)
    if name == "elu":
        return F.elu(x) + 1.0
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {name!r}")


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where ``nonzero``, else 0 (and zero gradient, never NaN)."""
    safe = torch.where(nonzero, denominator, torch.ones_like(denominator))
    return torch.where(nonzero, numerator / safe, torch.zeros_like(numerator))


def _global_sums(phi_k: torch.Tensor, v: torch.Tensor, chunk: int = 1024):
    """fp32 ``sum_u phi(k_u) v_u^T`` ``[B, H, D, D]`` and ``sum_u phi(k_u)`` ``[B, H, D]``.

    The token sum is split into chunks of ``chunk`` tokens (a batched product per chunk, then a sum): one ``D x D``
    product per (batch, head) reduced over N tokens would run on a handful of thread blocks (measured 2.3 ms at
    N = 65536, 12 heads on an H200, forward and again in backward)."""
    b, h, n, d = phi_k.shape
    chunk = min(n, chunk)
    a, c = phi_k.float(), v.float()
    if n % chunk:                                                   # zero rows add nothing to the sums
        a, c = F.pad(a, (0, 0, 0, chunk - n % chunk)), F.pad(c, (0, 0, 0, chunk - n % chunk))
    a, c = a.reshape(b, h, -1, chunk, d), c.reshape(b, h, -1, chunk, c.shape[-1])
    return (a.transpose(-1, -2) @ c).sum(2), phi_k.sum(2, dtype=torch.float32)


def linear_attention_torch(q, k, v, block_size: int, feature_map_name: str, excluded_idx=None) -> torch.Tensor:
    """Exact fp32 linear branch ``[B, H, N, D]``, differentiable in q, k, v (through phi).

    ``excluded_idx``: None for ``linear_scope="all"``, else an int tensor ``[B, H, T, E]`` of the key blocks each
    query block leaves out.
    """
    b, h, n, d = q.shape
    phi_q, phi_k = feature_map(q.float(), feature_map_name), feature_map(k.float(), feature_map_name)
    if excluded_idx is None:
        kv_total, z_total = _global_sums(phi_k, v)
        return (phi_q @ kv_total) / (phi_q @ z_total[..., None] + ALL_SCOPE_EPS)
    phi_q_blocks = pad_to_blocks(phi_q, block_size)                                 # [B, H, T, C, D]
    phi_k_blocks = pad_to_blocks(phi_k, block_size)                                 # padded keys are 0 after phi
    t = phi_q_blocks.shape[2]
    kv_blocks = (phi_k_blocks.transpose(-1, -2) @ pad_to_blocks(v.float(), block_size)).reshape(b, h, t, d * d)
    kept = torch.ones(b, h, t, t, dtype=torch.bool, device=q.device)
    kept.scatter_(-1, excluded_idx.long(), False)
    kept = kept.float()                                                             # [B, H, T, T] block mask
    numerator = phi_q_blocks @ (kept @ kv_blocks).reshape(b, h, t, d, d)            # phi(q) . H_i
    denominator = phi_q_blocks @ (kept @ phi_k_blocks.sum(3))[..., None]            # phi(q) . Z_i
    out = safe_divide(numerator, denominator, denominator != 0)
    return out.reshape(b, h, t * block_size, d)[:, :, :n]


# ----------------------------------------------------------------------------------------------------------------------
# Triton: the excluded part sum_{u in E(i)} w_tu (v_u, 1) and its adjoint


@triton.jit
def _excluded_fwd_kernel(FQ, FK, V, NUM, DEN, LIST, stride_lb, stride_lt, n, list_len,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PER_ITER: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM
    fq = tl.load(FQ + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    num = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    den = tl.zeros([BLOCK], tl.float32)
    koff, slot, list_base = list_walk_start(LIST, bh, tile, stride_lb, stride_lt, BLOCK, PER_ITER)
    for j in range(0, list_len, PER_ITER):
        blk, krow, k_ok = listed_key_rows(list_base, j, koff, slot, list_len, n, BLOCK)
        fkt = tl.load(FK + base + krow[None, :] * HEAD_DIM + dims[:, None], mask=k_ok[None, :], other=0.0)
        v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
        w = tl.dot(fq, fkt, input_precision=PREC)                                    # [BLOCK, BLOCK * PER_ITER]
        w = tl.where(k_ok[None, :], w, 0.0)
        den += tl.sum(w, 1)
        num += tl.dot(w.to(v.dtype), v, input_precision=PREC)
    tl.store(NUM + base + rows[:, None] * HEAD_DIM + dims[None, :], num, mask=row_ok[:, None])
    tl.store(DEN + bh * n + rows, den, mask=row_ok)


@triton.jit
def _excluded_dfq_kernel(FK, V, GNUM, GDEN, DFQ, LIST, stride_lb, stride_lt, n, list_len,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PER_ITER: tl.constexpr, PREC: tl.constexpr):
    # dphi(q_t) = sum_{u in E(t)} (g_num_t . v_u + g_den_t) phi(k_u)
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM
    g_num = tl.load(GNUM + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    g_den = tl.load(GDEN + bh * n + rows, mask=row_ok, other=0.0)
    dfq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    koff, slot, list_base = list_walk_start(LIST, bh, tile, stride_lb, stride_lt, BLOCK, PER_ITER)
    for j in range(0, list_len, PER_ITER):
        blk, krow, k_ok = listed_key_rows(list_base, j, koff, slot, list_len, n, BLOCK)
        fk = tl.load(FK + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
        dw = tl.dot(g_num.to(v.dtype), tl.trans(v), input_precision=PREC) + g_den[:, None]
        dw = tl.where(k_ok[None, :], dw, 0.0)
        dfq += tl.dot(dw.to(fk.dtype), fk, input_precision=PREC)
    tl.store(DFQ + base + rows[:, None] * HEAD_DIM + dims[None, :], dfq, mask=row_ok[:, None])


@triton.jit
def _excluded_dfk_dv_kernel(FQ, FK, V, GNUM, GDEN, DFK, DV, OFFSETS, ROWS, stride_ob, stride_rb, n,
                            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PER_ITER: tl.constexpr,
                            PREC: tl.constexpr):
    # over the query tiles t that exclude key block j (CSC list):
    #   dphi(k_u) = sum_t (g_num_t . v_u + g_den_t) phi(q_t),   dv_u = sum_t w_tu g_num_t
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    QROWS: tl.constexpr = BLOCK * PER_ITER
    krow = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k_ok = krow < n
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM
    fk = tl.load(FK + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
    v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
    start = tl.load(OFFSETS + bh * stride_ob + blk)
    end = tl.load(OFFSETS + bh * stride_ob + blk + 1)
    dfk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    roff = tl.arange(0, QROWS)
    slot = roff // BLOCK
    for j in range(start, end, PER_ITER):
        e_ok = (j + slot) < end
        t = tl.load(ROWS + bh * stride_rb + j + slot, mask=e_ok, other=0)
        rows = t.to(tl.int64) * BLOCK + (roff % BLOCK)
        r_ok = e_ok & (rows < n)
        fq = tl.load(FQ + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=r_ok[:, None], other=0.0)
        g_num = tl.load(GNUM + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=r_ok[:, None], other=0.0)
        g_den = tl.load(GDEN + bh * n + rows, mask=r_ok, other=0.0)
        wt = tl.dot(fk, tl.trans(fq), input_precision=PREC)                           # [BLOCK, QROWS]
        wt = tl.where(k_ok[:, None] & r_ok[None, :], wt, 0.0)
        dwt = tl.dot(v, tl.trans(g_num.to(v.dtype)), input_precision=PREC) + g_den[None, :]
        dwt = tl.where(k_ok[:, None] & r_ok[None, :], dwt, 0.0)
        dfk += tl.dot(dwt.to(fq.dtype), fq, input_precision=PREC)
        dv += tl.dot(wt.to(v.dtype), g_num.to(v.dtype), input_precision=PREC)
    tl.store(DFK + base + krow[:, None] * HEAD_DIM + dims[None, :], dfk, mask=k_ok[:, None])
    tl.store(DV + base + krow[:, None] * HEAD_DIM + dims[None, :], dv, mask=k_ok[:, None])


def _launch_cfg(block_size: int, dtype: torch.dtype):
    per_iter = max(1, 64 // block_size)                          # >= 64-wide dots for the tensor cores
    return per_iter, ("ieee" if dtype == torch.float32 else "tf32")


class _ExcludedSum(torch.autograd.Function):
    """``(phi_q, phi_k, v, lists) -> (num [BH, N, D], den [BH, N])`` fp32: sums of ``w_tu (v_u, 1)`` over the keys
    of the blocks listed for each query block. Inputs ``[BH, N, D]`` contiguous, one dtype; lists int32
    ``[BH, T, E]`` with distinct ids per row."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, lists, block_size):
        bh, n, d = phi_q.shape
        t = lists.shape[1]
        per_iter, prec = _launch_cfg(block_size, phi_q.dtype)
        num = torch.empty(bh, n, d, device=phi_q.device, dtype=torch.float32)
        den = torch.empty(bh, n, device=phi_q.device, dtype=torch.float32)
        _excluded_fwd_kernel[(t, bh)](phi_q, phi_k, v, num, den, lists, lists.stride(0), lists.stride(1), n,
                                      lists.shape[2], HEAD_DIM=d, BLOCK=block_size, PER_ITER=per_iter, PREC=prec,
                                      num_warps=4)
        ctx.save_for_backward(phi_q, phi_k, v, lists)
        ctx.block_size = block_size
        return num, den

    @staticmethod
    def backward(ctx, g_num, g_den):
        phi_q, phi_k, v, lists = ctx.saved_tensors
        block_size = ctx.block_size
        bh, n, d = phi_q.shape
        t = lists.shape[1]
        per_iter, prec = _launch_cfg(block_size, phi_q.dtype)
        g_num = g_num.float().contiguous()
        g_den = g_den.float().contiguous()
        dfq = torch.empty(bh, n, d, device=phi_q.device, dtype=torch.float32)
        _excluded_dfq_kernel[(t, bh)](phi_k, v, g_num, g_den, dfq, lists, lists.stride(0), lists.stride(1), n,
                                      lists.shape[2], HEAD_DIM=d, BLOCK=block_size, PER_ITER=per_iter, PREC=prec,
                                      num_warps=4)
        offsets, rows = csr_to_csc(lists, t)
        dfk = torch.empty_like(dfq)
        dv = torch.empty_like(dfq)
        _excluded_dfk_dv_kernel[(t, bh)](phi_q, phi_k, v, g_num, g_den, dfk, dv, offsets, rows,
                                         offsets.stride(0), rows.stride(0), n, HEAD_DIM=d, BLOCK=block_size,
                                         PER_ITER=per_iter, PREC=prec, num_warps=4)
        return dfq.to(phi_q.dtype), dfk.to(phi_k.dtype), dv.to(v.dtype), None, None


def linear_attention_triton(q, k, v, block_size: int, feature_map_name: str, excluded_idx=None) -> torch.Tensor:
    """The linear branch ``[B, H, N, D]`` in fp32 (Triton for the excluded part); arguments as
    ``linear_attention_torch``. phi is computed in the input dtype (fp32 math inside, one rounding) and feeds the tensor
    cores; the global sums and the subtraction are fp32."""
    b, h, n, d = q.shape
    phi_q, phi_k = feature_map(q, feature_map_name), feature_map(k, feature_map_name)   # fp32 math inside
    kv_total, z_total = _global_sums(phi_k, v)
    # phi(q) . (sum phi(k) v^T | sum phi(k)) in one product: numerator [.., :D], denominator [.., D]
    both = phi_q.float() @ torch.cat([kv_total, z_total[..., None]], -1)             # [B, H, N, D + 1]
    numerator, denominator = both[..., :d], both[..., d]
    if excluded_idx is None:
        return numerator / (denominator + ALL_SCOPE_EPS)[..., None]
    num_blocks_ = excluded_idx.shape[2]
    if excluded_idx.shape[3] >= num_blocks_:                                         # nothing left to attend to
        return numerator * 0.0
    lists = excluded_idx.to(torch.int32).reshape(b * h, num_blocks_, -1).contiguous()
    flat = [x.reshape(b * h, n, d).contiguous() for x in (phi_q, phi_k, v)]
    num_excluded, den_excluded = _ExcludedSum.apply(*flat, lists, block_size)
    remaining = denominator - den_excluded.view(b, h, n)
    # an empty row divides by +inf: exactly 0 with zero gradient, one pass over [B, H, N, D] instead of three
    remaining = torch.where(remaining > EMPTY_ROW_REL_EPS * denominator, remaining, float("inf"))
    return (numerator - num_excluded.view(b, h, n, d)) / remaining[..., None]
