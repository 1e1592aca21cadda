"""SLA's Triton path: one autograd Function for both branches, whose backward walks the critical lists once.

Both branches walk the same critical lists: the sparse branch attends to the listed key blocks, the linear branch
subtracts them from its global sums (``linear_attention.py``; with ``linear_scope="marginal"`` it also subtracts
the negligible blocks, walked after the critical ones, and with ``"all"`` it walks nothing).

  forward  ``linear_attention.feature_sums`` (phi(k) and the global sums), then ``_sla_fwd_kernel``, one warp per
           16-row block: phi(q) and its global term as the linear branch's fp32 start values, then per step of
           the walk K, V and phi(K) loaded once for the sparse branch's online softmax (o_sparse, LSE) and the
           linear branch's excluded part (o_linear, 1/den). The two branches' own walks, one after the other,
           loaded V twice (docs/kernel_notes.md v49); a fused forward on 4 warps (v13) had lost to them by its
           registers; the global term had its own 64-row kernel writing fp32 start values (v50).
  backward ``_sla_dq_kernel``, one warp per 16-row block: both Δ and the linear branch's global part of d phi(q)
           as start values, then per step of the walk K, phi(K) and V loaded once for the sparse dq
           (``block_sparse.gathered_dq_step``) and the linear one (``linear_attention.excluded_dq_step``); dq of
           both summed in fp32 and rounded once. Then the global sums' gradients (``feature_sums``) and
           ``_sla_dkdv_kernel``, its key-major twin over the CSC transpose of the critical lists (and of the
           negligible ones): one warp per 16-key block, per step one query block's q, phi(q), dO of both branches
           and their row statistics loaded once for the sparse dk/dv (``block_sparse.key_major_step``) and the
           linear one (``linear_attention.excluded_dkdv_step``), from the linear branch's global part as fp32 start
           values; dv of both summed in fp32 and rounded once. The two branches' own key-major kernels, one after
           the other, read the query rows twice and passed the sparse dk/dv through an fp32 buffer
           (docs/kernel_notes.md v49). No full-size gradient sums outside the kernels.

Every gradient row has one writer and sums run in a fixed order: bitwise deterministic. The exact PyTorch form of
both branches stays the oracle (``sla.py``'s ``impl="torch"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse import (
    LOG2E,
    finish_softmax,
    first_scalar_id,
    flatten_grad,
    gathered_dq_step,
    key_major_step,
    list_slots,
    list_walk_start,
    listed_ids,
    scalar_step_id,
    softmax_step,
    walk_key_rows,
)
from .blocks import csr_to_csc
from .common import AUTOTUNE, autotuned
from .linear_attention import (
    ALL_SCOPE_EPS,
    EMPTY_ROW_REL_EPS,
    ONE_WARP_CONFIGS,
    WALK_CONFIGS,
    WALK_KEYS,
    excluded_dkdv_step,
    excluded_dq_step,
    excluded_fwd_step,
    feature_sums,
    global_dkdv_start,
    linear_global_grads,
    one_warp_walk,
    phi_rows,
    phi_rows_backward,
    prune_query_walk,
    query_walk_options,
    row_tile,
    rows_times_sums,
)
from .ops import cdiv, custom_op


@triton.jit
def _sla_fwd_kernel(
    Q,
    K,
    V,
    PHI_K,
    KV_TOTAL,
    Z_TOTAL,
    PHI_Q,
    O_S,
    LSE,
    O_L,
    INV_DEN,
    LIST,
    NEG,
    stride_lb,
    stride_lt,
    stride_nb,
    stride_nt,
    n,
    list_len,
    neg_len,
    qk_scale,
    empty_row_rel_eps,
    all_scope_eps,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FEATURE: tl.constexpr,
    EXCLUDE: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    LIST_SLOTS: tl.constexpr,
    NEG_SLOTS: tl.constexpr,
):
    # One program per query block, one listed key block per step, K, V and phi(K) loaded once for both branches:
    #   sparse: the online softmax over the critical blocks (block_sparse.softmax_step) -> o_sparse, LSE
    #   linear: phi(q) (stored for the backward) and its global term phi(q) . [KV_total | Z_total] in fp32 minus
    #           the excluded pairs, w = phi(q) phi(k)^T: num -= w v, den -= sum w; then the empty-row rule ->
    #           o_linear, 1/den (0 for an empty row). Without exclusion ("all" scope) o_linear = num / (den + eps).
    # An empty list slot (-1) is a -inf bias for the softmax and a zero weight for the linear branch.
    tile = tl.program_id(0)
    bh, rows, row_ok, tile_offsets = row_tile(n, BLOCK, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM  # the head's rows, for the listed key blocks
    q = tl.load(Q + tile_offsets, mask=row_ok[:, None], other=0.0)
    x = q.to(tl.float32)
    a = phi_rows(x, row_ok, FEATURE).to(q.dtype)  # one rounding, as the walks read it
    tl.store(PHI_Q + tile_offsets, a, mask=row_ok[:, None])
    den = tl.sum(a.to(tl.float32) * tl.load(Z_TOTAL + bh * HEAD_DIM + dims)[None, :], 1)  # exact fp32
    # phi(q) read back, by slices for the global term and whole for the walk (the barrier orders the program's store
    # before the loads): kept from its computation instead, it held 212 registers in a 64-row program against 167
    # (sm_90, Triton 3.6)
    tl.debug_barrier()
    num = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    num = rows_times_sums(PHI_Q, base + rows * HEAD_DIM, row_ok, KV_TOTAL + bh * HEAD_DIM * HEAD_DIM, HEAD_DIM, 1,
                          num, HEAD_DIM, CHUNK, PREC)  # fmt: skip
    a = tl.load(PHI_Q + tile_offsets, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    den_excluded = tl.zeros([BLOCK], tl.float32)
    koff = tl.arange(0, BLOCK)
    list_base = LIST + bh * stride_lb + tile.to(tl.int64) * stride_lt
    ids = listed_ids(list_base, list_len, LIST_SLOTS, 1)
    nxt = first_scalar_id(list_base, list_len, LIST_SLOTS)
    for j in range(0, list_len):  # the critical blocks: both branches
        blk, nxt = scalar_step_id(ids, list_base, nxt, j, list_len, 1, LIST_SLOTS)
        krow = tl.maximum(blk, 0).to(tl.int64) * BLOCK + koff
        k_ok = krow < n
        if EVEN:  # every row of a listed block exists
            kt = tl.load(K + base + krow[None, :] * HEAD_DIM + dims[:, None])
            v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :])
        else:
            kt = tl.load(K + base + krow[None, :] * HEAD_DIM + dims[:, None], mask=k_ok[None, :], other=0.0)
            v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PREC)
        if not EVEN:
            s = tl.where(k_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, qk_scale, tl.where(blk >= 0, 0.0, float("-inf")), m_i, l_i, acc, v, PREC)
        if EXCLUDE:
            b = tl.load(PHI_K + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
            num, den_excluded = excluded_fwd_step(a, b, v, blk >= 0, num, den_excluded, PREC)
    acc, lse = finish_softmax(m_i, l_i, acc)
    tl.store(O_S + tile_offsets, acc.to(O_S.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh * n + rows, lse, mask=row_ok)
    if EXCLUDE:
        neg_base = NEG + bh * stride_nb + tile.to(tl.int64) * stride_nt
        neg_ids = listed_ids(neg_base, neg_len, NEG_SLOTS, 1)
        nxt = first_scalar_id(neg_base, neg_len, NEG_SLOTS)
        for j in range(0, neg_len):  # the negligible blocks ("marginal" scope): the linear branch only
            blk, nxt = scalar_step_id(neg_ids, neg_base, nxt, j, neg_len, 1, NEG_SLOTS)
            krow = tl.maximum(blk, 0).to(tl.int64) * BLOCK + koff
            k_ok = (krow < n) & (blk >= 0)
            b = tl.load(PHI_K + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(V + base + krow[:, None] * HEAD_DIM + dims[None, :], mask=k_ok[:, None], other=0.0)
            # (an empty slot's phi(K) loads as zeros here: its weights are zero already)
            num, den_excluded = excluded_fwd_step(a, b, v, True, num, den_excluded, PREC)
    if EXCLUDE:
        remaining = den - den_excluded
        # empty linear set (or vanishing relu features): output 0, and 1/den = 0 zeroes every gradient of the row
        keep = remaining > empty_row_rel_eps * den
        inv_den = tl.where(keep, 1.0 / tl.where(keep, remaining, 1.0), 0.0)
    else:
        inv_den = 1.0 / (den + all_scope_eps)
    tl.store(O_L + tile_offsets, (num * inv_den[:, None]).to(O_L.dtype.element_ty), mask=row_ok[:, None])
    tl.store(INV_DEN + bh * n + rows, inv_den, mask=row_ok)


_fwd = autotuned(
    _sla_fwd_kernel,
    ["HEAD_DIM", "BLOCK", "FEATURE", "EXCLUDE", "EVEN", "PREC", "LIST_SLOTS", "NEG_SLOTS"],
    ONE_WARP_CONFIGS + WALK_CONFIGS,
    prune=prune_query_walk,
)


@triton.jit
def _sla_dq_kernel(
    Q,
    K,
    V,
    PHI_K,
    DO_S,
    O_S,
    LSE,
    DELTA_S,
    DO_L,
    O_L,
    INV_DEN,
    KV_TOTAL,
    Z_TOTAL,
    DELTA_L,
    DQ,
    LIST,
    NEG,
    stride_lb,
    stride_lt,
    stride_nb,
    stride_nt,
    n,
    list_len,
    neg_len,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PER_ITER: tl.constexpr,
    FEATURE: tl.constexpr,
    EXCLUDE: tl.constexpr,
    PREC: tl.constexpr,
    LIST_SLOTS: tl.constexpr,
    NEG_SLOTS: tl.constexpr,
):
    # sparse: dq_s = scale * sum_u P_tu (dO_t . v_u - Δ_t) k_u over the critical keys (block_sparse._dq_kernel)
    # linear: dphi(q_t) = (dO_t KV_total^T - delta_t Z_total - sum_{u in E(t)} (dO_t . v_u - delta_t) phi(k_u)) / den_t
    #         with delta_t = dO_t . o_t; both Δ are stored for the dk/dv
    tile = tl.program_id(0)
    bh, rows, row_ok, tile_offsets = row_tile(n, BLOCK, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM  # the head's rows, for the listed key blocks
    q = tl.load(Q + tile_offsets, mask=row_ok[:, None], other=0.0)
    do_s = tl.load(DO_S + tile_offsets, mask=row_ok[:, None], other=0.0)
    o_s = tl.load(O_S + tile_offsets, mask=row_ok[:, None], other=0.0)
    delta_s = tl.sum(o_s.to(tl.float32) * do_s.to(tl.float32), 1)
    tl.store(DELTA_S + bh * n + rows, delta_s, mask=row_ok)
    lse2 = tl.load(LSE + bh * n + rows, mask=row_ok, other=0.0) * LOG2E
    do_l = tl.load(DO_L + tile_offsets, mask=row_ok[:, None], other=0.0)
    o_l = tl.load(O_L + tile_offsets, mask=row_ok[:, None], other=0.0)
    delta_l = tl.sum(o_l.to(tl.float32) * do_l.to(tl.float32), 1)
    tl.store(DELTA_L + bh * n + rows, delta_l, mask=row_ok)
    dq_s = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # the global part, dO KV_total^T - delta Z_total, from dO's rows again a slice at a time (as the forward's)
    dphi = tl.zeros([BLOCK, HEAD_DIM], tl.float32) - delta_l[:, None] * tl.load(Z_TOTAL + bh * HEAD_DIM + dims)[None, :]
    dphi = rows_times_sums(DO_L, base + rows * HEAD_DIM, row_ok, KV_TOTAL + bh * HEAD_DIM * HEAD_DIM, 1, HEAD_DIM,
                           dphi, HEAD_DIM, CHUNK, PREC)  # fmt: skip
    koff, slot, list_base = list_walk_start(LIST, bh, tile, stride_lb, stride_lt, BLOCK, PER_ITER)
    ids = listed_ids(list_base, list_len, LIST_SLOTS, PER_ITER)
    for j in range(0, list_len, PER_ITER):  # the critical blocks: both branches
        _, krow, k_ok = walk_key_rows(ids, list_base, j, koff, slot, list_len, n, BLOCK, PER_ITER, LIST_SLOTS)
        key_offsets = base + krow[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + key_offsets, mask=k_ok[:, None], other=0.0)
        v = tl.load(V + key_offsets, mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        dq_s = gathered_dq_step(s, k, v, do_s, lse2, delta_s, k_ok[None, :] & row_ok[:, None], dq_s, True, PREC)
        if EXCLUDE:
            b = tl.load(PHI_K + key_offsets, mask=k_ok[:, None], other=0.0)
            dphi = excluded_dq_step(do_l, delta_l, b, v, k_ok, dphi, PREC)
    if EXCLUDE:  # the negligible blocks ("marginal" scope): the linear branch only
        koff, slot, neg_base = list_walk_start(NEG, bh, tile, stride_nb, stride_nt, BLOCK, PER_ITER)
        neg_ids = listed_ids(neg_base, neg_len, NEG_SLOTS, PER_ITER)
        for j in range(0, neg_len, PER_ITER):
            _, krow, k_ok = walk_key_rows(neg_ids, neg_base, j, koff, slot, neg_len, n, BLOCK, PER_ITER, NEG_SLOTS)
            key_offsets = base + krow[:, None] * HEAD_DIM + dims[None, :]
            b = tl.load(PHI_K + key_offsets, mask=k_ok[:, None], other=0.0)
            v = tl.load(V + key_offsets, mask=k_ok[:, None], other=0.0)
            dphi = excluded_dq_step(do_l, delta_l, b, v, k_ok, dphi, PREC)
    dphi = dphi * tl.load(INV_DEN + bh * n + rows, mask=row_ok, other=0.0)[:, None]
    x = q.to(tl.float32)
    dq = dq_s * sm_scale + phi_rows_backward(x, phi_rows(x, row_ok, FEATURE), dphi, FEATURE)
    tl.store(DQ + tile_offsets, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


_dq = autotuned(_sla_dq_kernel, WALK_KEYS, ONE_WARP_CONFIGS + WALK_CONFIGS, prune=prune_query_walk)


@triton.jit
def csc_column(OFFSETS, ROWS, stride_ob, stride_rb, bh, blk):
    """Key block ``blk``'s column of head ``bh`` in a CSC transpose (``blocks.csr_to_csc``): where its query block ids
    start, how many there are, and the first id, which ``block_sparse.scalar_step_id`` takes from there on, each id
    read a step ahead so that Triton pipelines the walk's loads ``num_stages`` deep."""
    start = tl.load(OFFSETS + bh * stride_ob + blk)
    col = ROWS + bh * stride_rb + start
    col_len = tl.load(OFFSETS + bh * stride_ob + blk + 1) - start
    return col, col_len, first_scalar_id(col, col_len, 0)


@triton.jit
def _sla_dkdv_kernel(
    Q,
    K,
    V,
    PHI_Q,
    PHI_K,
    DO_S,
    LSE,
    DELTA_S,
    DO_L,
    INV_DEN,
    DELTA_L,
    D_KV_TOTAL,
    D_Z_TOTAL,
    DK,
    DV,
    OFFSETS,
    ROWS,
    NEG_OFFSETS,
    NEG_ROWS,
    stride_ob,
    stride_rb,
    stride_nob,
    stride_nrb,
    n,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FEATURE: tl.constexpr,
    EXCLUDE: tl.constexpr,
    HAS_NEG: tl.constexpr,
    PREC: tl.constexpr,
    SCALED_DTYPE: tl.constexpr,
):
    # One program per key block j, key-major over the query blocks that list it (CSC of the critical lists; then,
    # "marginal" scope, of the negligible ones). Per listed query block t, both branches with one load of its rows:
    #   sparse: dk_s += dS^T q, dv += P^T dO_s (block_sparse.key_major_step)
    #   linear: the global part (start values) minus the excluded pairs (linear_attention.excluded_dkdv_step)
    #   dk = scale dk_s + phi'(k)^T dphi(k); dv of both branches in one fp32 sum, rounded once
    # Rows past n need no mask: they load as zeros (q, dO, 1/den, delta, LSE), so they add nothing to any key row.
    blk = tl.program_id(0)
    bh, krow, k_ok, key_offsets = row_tile(n, BLOCK, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM  # the head's rows, for the query blocks that list the block
    k = tl.load(K + key_offsets, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + key_offsets, mask=k_ok[:, None], other=0.0)
    b = tl.load(PHI_K + key_offsets, mask=k_ok[:, None], other=0.0)
    dphi, dv = global_dkdv_start(V, PHI_K, D_KV_TOTAL, D_Z_TOTAL, bh, krow, k_ok, n, BLOCK, HEAD_DIM, CHUNK, PREC)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    no_weight = tl.zeros([BLOCK], tl.float32)
    roff = tl.arange(0, BLOCK)
    col, col_len, nxt = csc_column(OFFSETS, ROWS, stride_ob, stride_rb, bh, blk)
    for j in range(0, col_len):  # the critical pairs: both branches
        t, nxt = scalar_step_id(0, col, nxt, j, col_len, 1, 0)
        rows = t.to(tl.int64) * BLOCK + roff
        r_ok = rows < n
        query_offsets = base + rows[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(Q + query_offsets, mask=r_ok[:, None], other=0.0)
        do_s = tl.load(DO_S + query_offsets, mask=r_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + bh * n + rows, mask=r_ok, other=0.0) * LOG2E
        delta_s = tl.load(DELTA_S + bh * n + rows, mask=r_ok, other=0.0)
        dk, dv, _ = key_major_step(
            k, v, no_weight, k_ok, q, do_s, lse2, delta_s, r_ok, dk, dv, qk_scale, False, False, PREC
        )
        if EXCLUDE:
            dphi, dv = excluded_dkdv_step(
                PHI_Q, DO_L, INV_DEN, DELTA_L, query_offsets, bh * n, rows, r_ok, b, v, dphi, dv, SCALED_DTYPE, PREC
            )
    if HAS_NEG:  # the negligible pairs ("marginal" scope): the linear branch only
        col, col_len, nxt = csc_column(NEG_OFFSETS, NEG_ROWS, stride_nob, stride_nrb, bh, blk)
        for j in range(0, col_len):
            t, nxt = scalar_step_id(0, col, nxt, j, col_len, 1, 0)
            rows = t.to(tl.int64) * BLOCK + roff
            r_ok = rows < n
            query_offsets = base + rows[:, None] * HEAD_DIM + dims[None, :]
            dphi, dv = excluded_dkdv_step(
                PHI_Q, DO_L, INV_DEN, DELTA_L, query_offsets, bh * n, rows, r_ok, b, v, dphi, dv, SCALED_DTYPE, PREC
            )
    xk = k.to(tl.float32)
    dk = dk * sm_scale + phi_rows_backward(xk, phi_rows(xk, k_ok, FEATURE), dphi, FEATURE)  # Jacobian at phi(k)
    tl.store(DK + key_offsets, dk.to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + key_offsets, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


_dkdv = autotuned(
    _sla_dkdv_kernel,
    ["HEAD_DIM", "BLOCK", "FEATURE", "EXCLUDE", "HAS_NEG", "PREC"],
    ONE_WARP_CONFIGS + WALK_CONFIGS + [triton.Config({}, num_warps=w, num_stages=1) for w in (4, 8)],
    prune=prune_query_walk,
)


def _list_args(critical: torch.Tensor, negligible: torch.Tensor) -> tuple:
    return critical, negligible, critical.stride(0), critical.stride(1), negligible.stride(0), negligible.stride(1)


class _SLATriton(torch.autograd.Function):
    """``(q, k, v, critical, negligible) -> (o_sparse, o_linear)`` in the input dtype; q, k, v ``[B, H, N, D]``, one
    dtype; ``critical`` int32 ``[BH, T, K]``; ``negligible`` int32 ``[BH, T, K_neg]`` (may be empty); ``exclude``:
    whether the linear branch leaves out the critical and negligible blocks (False: ``"all"`` scope). The heads are
    flattened inside, so that the backward flattens the outputs' gradients itself (``flatten_grad``)."""

    @staticmethod
    def forward(ctx, q, k, v, critical, negligible, block_size, feature_map_name, scale, exclude):
        b, h, n, d = q.shape
        q, k, v = [x.reshape(b * h, n, d).contiguous() for x in (q, k, v)]
        o_s, lse, o_l, inv_den, phi_q, phi_k, kv_total, z_total = _sla_forward_op(
            q, k, v, critical, negligible, block_size, feature_map_name, scale, exclude
        )
        ctx.save_for_backward(q, k, v, phi_q, phi_k, o_s, lse, o_l, inv_den, kv_total, z_total, critical, negligible)
        ctx.config = (block_size, feature_map_name, scale, exclude)
        ctx.shape = (b, h, n, d)
        return o_s.view(ctx.shape), o_l.view(ctx.shape)

    @staticmethod
    def backward(ctx, do_s, do_l):
        saved = ctx.saved_tensors
        q, k, v, phi_q, phi_k, o_s, lse, o_l, inv_den, kv_total, z_total, critical, negligible = saved
        block_size, feature_map_name, scale, exclude = ctx.config
        bh, n, d = q.shape
        t = cdiv(n, block_size)
        do_s, do_l = [flatten_grad(g.to(q.dtype)) for g in (do_s, do_l)]
        dq, delta_s, delta_l = _sla_backward_dq_op(
            q,
            k,
            v,
            phi_k,
            do_s,
            o_s,
            lse,
            do_l,
            o_l,
            inv_den,
            kv_total,
            z_total,
            critical,
            negligible,
            block_size,
            feature_map_name,
            scale,
            exclude,
        )
        d_kv_total, d_z_total = linear_global_grads(phi_q, do_l, feature_map_name, inv_den, delta_l)
        critical_csc = csr_to_csc(critical, t)
        has_neg = exclude and negligible.shape[2] > 0
        negligible_csc = csr_to_csc(negligible, t) if has_neg else critical_csc  # (unread without negligible)
        dk, dv = _sla_backward_dkdv_op(
            q,
            k,
            v,
            phi_q,
            phi_k,
            do_s,
            lse,
            delta_s,
            do_l,
            inv_den,
            delta_l,
            d_kv_total,
            d_z_total,
            *critical_csc,
            *negligible_csc,
            block_size,
            feature_map_name,
            scale,
            exclude,
            has_neg,
        )
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.view(ctx.shape), None, None, None, None, None, None


# Pipeline stages of the forward's and the dk/dv's warpgroup programs (blocks of >= 32 rows, head dims > 64) without
# autotuning. At 256^2, blocks of 64, K = 8 on the H100 (docs/kernel_notes.md v49): the dk/dv 1.34 ms at 2 stages,
# 1.50 at 1, 1.95 at 3 (and out of shared memory at head dim 128); the forward 0.60 ms at 2, 0.64 at 3.
WARPGROUP_STAGES = 2


def _block_walk_options(head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of SLA's forward and dk/dv walks, one listed block per step: the query-major
    walks' (``query_walk_options``: a 16-row or 16-key program on one warp, 3 stages), ``WARPGROUP_STAGES`` for the
    others."""
    options = query_walk_options(head_dim, block_size, dtype)
    options.pop("PER_ITER")
    if not AUTOTUNE and not one_warp_walk(block_size, head_dim):
        options["num_stages"] = WARPGROUP_STAGES
    return options


@custom_op("sla_forward")
def _sla_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    critical: torch.Tensor,
    negligible: torch.Tensor,
    block_size: int,
    feature_map_name: str,
    scale: float,
    exclude: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Both branches' forward over flattened ``[BH, N, D]`` inputs: ``(o_sparse, LSE, o_linear, 1/den, phi(q),
    phi(k), KV_total, Z_total)``, the last six for the backward."""
    bh, n, d = q.shape
    phi_k, kv_total, z_total = feature_sums(k, v, feature_map_name)
    phi_q, o_s, o_l = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(bh, n, device=q.device, dtype=torch.float32)
    inv_den = torch.empty_like(lse)
    options = _block_walk_options(d, block_size, q.dtype)
    neg_len = negligible.shape[2] if exclude else 0
    _fwd[(cdiv(n, block_size), bh)](
        q,
        k,
        v,
        phi_k,
        kv_total,
        z_total,
        phi_q,
        o_s,
        lse,
        o_l,
        inv_den,
        *_list_args(critical, negligible),
        n,
        critical.shape[2],
        neg_len,
        scale * LOG2E.value,
        EMPTY_ROW_REL_EPS,
        ALL_SCOPE_EPS,
        **options,
        CHUNK=min(16, d),
        FEATURE=feature_map_name,
        EXCLUDE=exclude,
        EVEN=n % block_size == 0,
        LIST_SLOTS=list_slots(critical.shape[2], 1),
        NEG_SLOTS=list_slots(neg_len, 1),
    )
    return o_s, lse, o_l, inv_den, phi_q, phi_k, kv_total, z_total


@_sla_forward_op.register_fake
def _(q, k, v, *args):
    bh, n, d = q.shape
    rows = q.new_empty((bh, n), dtype=torch.float32)
    sums = q.new_empty((bh, d, d), dtype=torch.float32), q.new_empty((bh, d), dtype=torch.float32)
    return (
        torch.empty_like(q),
        rows,
        torch.empty_like(q),
        torch.empty_like(rows),
        torch.empty_like(q),
        torch.empty_like(k),
        *sums,
    )


# Returns (dq, Δ of the sparse branch, Δ of the linear branch); the kernel computes both Δ on the way.
@custom_op("sla_backward_dq")
def _sla_backward_dq_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_k: torch.Tensor,
    do_s: torch.Tensor,
    o_s: torch.Tensor,
    lse: torch.Tensor,
    do_l: torch.Tensor,
    o_l: torch.Tensor,
    inv_den: torch.Tensor,
    kv_total: torch.Tensor,
    z_total: torch.Tensor,
    critical: torch.Tensor,
    negligible: torch.Tensor,
    block_size: int,
    feature_map_name: str,
    scale: float,
    exclude: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bh, n, d = q.shape
    t = cdiv(n, block_size)
    dq = torch.empty_like(q)
    delta_s, delta_l = torch.empty_like(lse), torch.empty_like(lse)
    options = query_walk_options(d, block_size, q.dtype)
    _dq[(t, bh)](
        q,
        k,
        v,
        phi_k,
        do_s,
        o_s,
        lse,
        delta_s,
        do_l,
        o_l,
        inv_den,
        kv_total,
        z_total,
        delta_l,
        dq,
        *_list_args(critical, negligible),
        n,
        critical.shape[2],
        negligible.shape[2] if exclude else 0,
        scale * LOG2E.value,
        scale,
        **options,
        CHUNK=min(16, d),
        FEATURE=feature_map_name,
        EXCLUDE=exclude,
        LIST_SLOTS=list_slots(critical.shape[2], options["PER_ITER"]),
        NEG_SLOTS=list_slots(negligible.shape[2], options["PER_ITER"]) if exclude else 0,
    )
    return dq, delta_s, delta_l


@_sla_backward_dq_op.register_fake
def _(q, k, v, phi_k, do_s, o_s, lse, *args):
    return torch.empty_like(q), torch.empty_like(lse), torch.empty_like(lse)


@custom_op("sla_backward_dkdv")
def _sla_backward_dkdv_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    do_s: torch.Tensor,
    lse: torch.Tensor,
    delta_s: torch.Tensor,
    do_l: torch.Tensor,
    inv_den: torch.Tensor,
    delta_l: torch.Tensor,
    d_kv_total: torch.Tensor,
    d_z_total: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    neg_offsets: torch.Tensor,
    neg_rows: torch.Tensor,
    block_size: int,
    feature_map_name: str,
    scale: float,
    exclude: bool,
    has_neg: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dk, dv (input dtype) of both branches, key-major over the CSC of the critical lists and (``has_neg``) of the
    negligible ones; ``exclude`` False: the linear branch's global part only (``linear_scope="all"``)."""
    bh, n, d = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    options = _block_walk_options(d, block_size, q.dtype)
    _dkdv[(cdiv(n, block_size), bh)](
        q,
        k,
        v,
        phi_q,
        phi_k,
        do_s,
        lse,
        delta_s,
        do_l,
        inv_den,
        delta_l,
        d_kv_total,
        d_z_total,
        dk,
        dv,
        offsets,
        rows,
        neg_offsets,
        neg_rows,
        offsets.stride(0),
        rows.stride(0),
        neg_offsets.stride(0),
        neg_rows.stride(0),
        n,
        scale * LOG2E.value,
        scale,
        **options,
        CHUNK=min(16, d),
        FEATURE=feature_map_name,
        EXCLUDE=exclude,
        HAS_NEG=has_neg,
        SCALED_DTYPE=tl.bfloat16 if k.dtype == torch.bfloat16 else tl.float32,
    )
    return dk, dv


@_sla_backward_dkdv_op.register_fake
def _(q, k, v, *args):
    return torch.empty_like(k), torch.empty_like(v)


def sla_triton(q, k, v, critical, negligible, block_size: int, feature_map_name: str, scale: float, exclude: bool):
    """``(o_sparse, o_linear)`` ``[B, H, N, D]`` in the input dtype: both SLA branches through the fused kernels.
    ``critical`` / ``negligible``: int ``[B, H, T, K]`` / ``[B, H, T, K_neg]`` from ``sla_select``; ``exclude``:
    False for ``linear_scope="all"`` (the linear branch over every key)."""
    b, h = q.shape[:2]
    lists = [x.to(torch.int32).reshape(b * h, x.shape[2], x.shape[3]).contiguous() for x in (critical, negligible)]
    return _SLATriton.apply(q, k, v, *lists, block_size, feature_map_name, scale, exclude)
