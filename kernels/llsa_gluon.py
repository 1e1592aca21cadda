"""LLSA's pooled passes on Hopper, the forward and the dq, written in Gluon (Triton's explicit layout / shared-memory
language).

    from pixdit.kernels import llsa_gluon
    if llsa_gluon.pooled_supported(q, block_size, cand_widths, tail_rows, full_lists):
        o, lse = llsa_gluon.pooled_forward(q, bank_k, bank_v, lists, o_init, lse_init, ...)
        dq = llsa_gluon.pooled_dq(q, bank_k, bank_v, do, o, lse, delta, lists, ...)

What they compute is exactly LLSA's pooled pass (``llsa._LLSATriton``): the 64-row query tiles continue the fine
pass's softmax (its partial output and LSE) over the pooled bank: the candidate levels' listed blocks, each level
with its weight ``l ln B``, then the coarsest level, which every query attends to (the dense tail, weight ``L ln
B``); and the backward's dq over the same keys, with Δ = rowsum(dO * O). ``block_sparse.bsa_forward`` and
``bsa_backward_dq`` do the same walks for any lists; these kernels are their twins for the case that LLSA trains and
samples with on Hopper, and the GPU tests hold them against those and the exact path.

Why second kernels for one pass. The bank's keys that a query tile attends to are the same for all the B^2 query
rows below one level-2 block: the candidates are the children of that ancestor's selection, and the coarsest level is
the same for every row. The Triton passes' programs (64 rows each; plain Triton cannot keep a tile in shared memory
across a loop over query tiles) load those 384 keys' K and V (at 256², L = 2) once per 64 rows: ~1.2 GB of L2 traffic
for 0.1 GB of queries. Here one program owns a group of B^2 query rows: it loads the group's keys into shared memory
once by TMA (the candidates block by block, the coarsest level by 64-row tiles) and walks its 64-row query tiles over
them. The products are wgmma with K and V read from shared memory and P (dS) from registers (docs/kernel_notes.md
v62). The forward's programs have two warpgroups, each walking its own 64 rows of a 128-row tile, with few enough
registers that an SM holds two programs: four warps per scheduler to hide the softmax's latency (v64); the dq walks
one 64-row tile on one warpgroup.

Restrictions (``case_supported``; every other case runs the Triton passes): an sm_90 GPU, fp16 / bf16, head_dim 64,
full candidate lists of whole 64-key steps, a coarsest level of whole 64-key steps, at most ``MAX_KEYS`` keys per
group (shared memory), at most two candidate levels (L <= 3), groups of whole 128-row tiles (B^2 a multiple of 128:
B = 16 and 32 are).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .block_sparse import LN2, LOG2E
from .ops import INTERPRET, custom_op

__all__ = ["pooled_forward", "pooled_dq", "pooled_supported", "case_supported", "MAX_KEYS"]

TILE = gl.constexpr(64)  # query rows per warpgroup (its wgmma rows) and keys per step
FORWARD_WARPS = 8  # the forward's warps: two warpgroups, a 128-row query tile
FORWARD_ROWS = FORWARD_WARPS // 4 * TILE.value  # the forward's query tile: a 64-row slice per warpgroup
# Keys (K and V rows) a group may keep in shared memory: 512 keys of d = 64 in bf16 are 128 KB, one program per SM;
# 384 (LLSA at 256², L = 2) are 96 KB, two programs per SM
MAX_KEYS = 512
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6's name; 3.8 renamed it


@gluon.constexpr_function
def _accumulator_layout(head_dim, num_warps):
    """Both kernels' wgmma accumulator layout: the warps stacked along the rows, 16 rows each (a tile of 64 rows per
    warpgroup), instructions of 16 rows x ``head_dim`` columns x 16 (the logits' 64 keys are one head_dim wide too:
    head_dim 64 only)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, head_dim, 16])


@gluon.jit
def _probabilities(s, scale, shift, m_i, SHIFTED):
    """A step's probabilities (unnormalised), new running maximum and the old sum's rescale from its raw logits
    ``s``, written as ``bsa_forward`` computes the same step, so that both give the same bits: ``SHIFTED`` (its
    weighted list walk) scales and shifts the logits first, else (its dense tail) the scale and the shift enter the
    exponent (``block_sparse.softmax_step``); a constexpr or, in a loop over steps, a runtime flag. ``m_i`` is never
    -inf here (every row starts from the fine pass's LSE), so no guard against it."""
    if SHIFTED:
        s = s * scale
        s += shift
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale + shift)
        p = gl.exp2(s * scale - (m_new - shift)[:, None])
    return p, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _step_weight(c, w1, w2, tail_bias, STEPS1: gl.constexpr, STEPS2: gl.constexpr):
    """The base-2 weight of the group's 64-key step ``c``: the first candidate level's, the second's, the tail's."""
    if c < STEPS1:
        shift = w1
    elif c < STEPS1 + STEPS2:
        shift = w2
    else:
        shift = tail_bias
    return shift


@gluon.jit
def _logits(q, k_s, c, zero):
    """S = q K^T for the group's 64-key step ``c``, issued and not waited for."""
    return warpgroup_mma(q, k_s.index(c).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, shift, shifted, dtype: gl.constexpr, p_layout: gl.constexpr):
    """A tile's step once its logits ``s`` are in: P (``dtype``, in the layout of the P V product's A operand), the
    new running maximum and sum, and the rescale of the output so far."""
    p, m_i, alpha = _probabilities(s, qk_scale, shift, m_i, shifted)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), m_i, l_i, alpha


@gluon.jit
def _walk_tile(
    q_s,
    k_s,
    v_s,
    q_next,
    start,
    weights,
    STEPS1: gl.constexpr,
    STEPS2: gl.constexpr,
    STEPS: gl.constexpr,
    mma: gl.constexpr,
    MORE: gl.constexpr,
):
    """A query tile's (``q_s``, a 64-row slice per warpgroup) online softmax over the group's ``STEPS`` 64-key steps
    in shared memory (the candidate levels' steps first, scaled then shifted; the tail's after, see
    ``_probabilities``), FlashAttention-3's order within a warpgroup: S(c + 1) is issued before O += P(c) V(c), and
    step c + 1's softmax runs while that product does. Nothing is in flight at the loop's back edge: with products in
    flight there, ptxas cannot follow their registers around the loop and serialises every wgmma; and the middle steps
    are a loop, not unrolled (unrolled, every step's shared-memory descriptors are computed up front). The keys
    are all in shared memory before the walk starts (``_wait_keys``: no wait, so no barrier, inside it). ``MORE``:
    once the last logits product has read ``q_s``, the next tile's q is copied into it (``q_next``: q's descriptor,
    the first row, the barrier) while the last P V product runs. ``start``: the running maximum, sum and output to
    continue from, ``(m, l, acc)`` (acc in the inputs' dtype); ``weights``: the logits' scale and the steps' base-2
    weights, ``(qk_scale, w1, w2, tail_bias)``. Returns the final ``(m, l, acc)``, the last product waited for."""
    m_i, l_i, acc = start
    qk_scale, w1, w2, tail_bias = weights
    LISTED: gl.constexpr = STEPS1 + STEPS2
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dtype: gl.constexpr = v_s.dtype
    ROWS: gl.constexpr = q_s.shape[0]
    zero = gl.zeros([ROWS, TILE], gl.float32, mma)
    s = warpgroup_mma_wait(0, deps=(_logits(q_s, k_s, 0, zero),))
    shift = _step_weight(0, w1, w2, tail_bias, STEPS1, STEPS2)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, shift, 0 < LISTED, dtype, p_layout)
    acc = acc.to(gl.float32)  # (the partial output's load has had the first product's time to arrive)
    for c in range(0, STEPS - 1):  # on entry step c's softmax is done, O holds steps < c
        s = _logits(q_s, k_s, c + 1, zero)
        acc = warpgroup_mma(p, v_s.index(c), acc * alpha[:, None], is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S(c + 1) in; O(c) still running, reading p
        shift = _step_weight(c + 1, w1, w2, tail_bias, STEPS1, STEPS2)
        p_next, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, shift, c + 1 < LISTED, dtype, p_layout)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        p = p_next
    if MORE:  # q no longer read (every warp's logits products are done with it): the next tile's may come in
        q_desc, next_row, q_bar = q_next
        _cta_barrier()
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [next_row, 0], q_bar, q_s)
    acc = warpgroup_mma(p, v_s.index(STEPS - 1), acc * alpha[:, None], is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    return m_i, l_i, acc


@gluon.jit
def _group_keys(
    descriptors,
    where,
    key_bars,
    BLOCK: gl.constexpr,
    LISTED: gl.constexpr,
    TAIL_ROWS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
):
    """A group's keys in shared memory, ``(k_s, v_s)`` of ``[steps, 64, d]`` (a shared-memory tile's shape must be a
    power of two), loaded by TMA, 64-key step c signalling ``key_bars.index(c)``: the ``LISTED`` bank blocks of the
    group's list (every 64-row tile of a group has the same list: the children of its level-2 ancestor's selection)
    by ``BLOCK``-row copies, then the coarsest level's rows (``tail_lo`` on) by 64-row copies. The list is read by one
    vector load before the first copy (read one by one, each entry's load waited behind the copy before it).
    ``descriptors``: the bank's K and V in ``BLOCK``-row and in 64-row tiles (``_descriptors``); ``where``: the
    lists, their batch and tile strides, the program's batch x head and group, the bank's rows per batch x head, the
    coarsest level's first row."""
    k_desc, v_desc, tail_k_desc, tail_v_desc = descriptors
    LIST, stride_lb, stride_lt, bh, group, bank_rows, tail_lo = where
    LISTED_STEPS: gl.constexpr = LISTED * BLOCK // TILE
    STEPS: gl.constexpr = LISTED_STEPS + TAIL_ROWS // TILE
    STEP_BYTES: gl.constexpr = 2 * TILE * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STEPS, TILE, HEAD_DIM], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STEPS, TILE, HEAD_DIM], v_desc.layout)
    for c in gl.static_range(STEPS):
        mbarrier.init(key_bars.index(c), count=1)
        mbarrier.expect(key_bars.index(c), STEP_BYTES)
    # the whole list in every thread's registers (a replicated layout), its entries picked out without shuffles
    ENTRIES: gl.constexpr = triton.next_power_of_2(LISTED)
    every_thread: gl.constexpr = gl.BlockedLayout([ENTRIES], [32], [gl.num_warps()], [0])
    entry = gl.arange(0, ENTRIES, layout=every_thread)
    list_base = LIST + bh.to(gl.int64) * stride_lb + (group * (GROUP_ROWS // TILE)) * stride_lt
    blocks = gl.load(list_base + entry, mask=entry < LISTED, other=0)
    bank0 = bh * bank_rows
    for j in gl.static_range(LISTED):
        row = bank0 + gl.sum(gl.where(entry == j, blocks, 0), 0) * BLOCK
        step = j * BLOCK // TILE
        k_dst = k_s.index(step).slice(j * BLOCK % TILE, BLOCK)  # (the 64-key step, the rows in it)
        v_dst = v_s.index(step).slice(j * BLOCK % TILE, BLOCK)
        tma.async_copy_global_to_shared(k_desc, [row, 0], key_bars.index(step), k_dst)
        tma.async_copy_global_to_shared(v_desc, [row, 0], key_bars.index(step), v_dst)
    for t in gl.static_range(TAIL_ROWS // TILE):  # whole 64-key steps, by 64-row copies
        row = bank0 + tail_lo + t * TILE
        bar = key_bars.index(LISTED_STEPS + t)
        tma.async_copy_global_to_shared(tail_k_desc, [row, 0], bar, k_s.index(LISTED_STEPS + t))
        tma.async_copy_global_to_shared(tail_v_desc, [row, 0], bar, v_s.index(LISTED_STEPS + t))
    return k_s, v_s


@gluon.jit
def _wait_keys(key_bars, STEPS: gl.constexpr):
    """Wait until all of the group's keys are in shared memory, before any walk. Waited for step by step inside a
    walk's loop instead, each wait would come with a CTA-wide barrier there (the compiler's barrier analysis puts one
    before every mbarrier wait), which holds a program's warpgroups in lockstep at every step (docs/kernel_notes.md
    v66)."""
    for c in gl.static_range(STEPS):
        mbarrier.wait(key_bars.index(c), 0)


@gluon.jit
def _partial(O_INIT, LSE_INIT, bh, n_q, rows, dims):
    """The fine pass's result for the query ``rows`` (``dims``: the head's columns), in the accumulator's layout: the
    state to continue the softmax from, ``(m, l, acc)`` with m its LSE in base 2, l = 1 and acc its output (the
    inputs' dtype)."""
    flat = bh.to(gl.int64) * n_q + rows
    acc = gl.load(O_INIT + flat[:, None] * dims.shape[0] + dims[None, :])
    m_i = gl.load(LSE_INIT + flat) * LOG2E
    return m_i, gl.full(rows.shape, 1.0, gl.float32, rows.type.layout), acc


@gluon.jit
def _finish(o_base, LSE, bh, n_q, rows, dims, stride_on, walked):
    """A tile's normalised output (tokens-major, from ``o_base``) and LSE stored; ``walked`` = ``(m, l, acc)``."""
    m_i, l_i, acc = walked
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    gl.store(o_base + rows[:, None].to(gl.int64) * stride_on + dims[None, :], o.to(o_base.dtype.element_ty))
    gl.store(LSE + bh.to(gl.int64) * n_q + rows, (m_i + gl.log2(l_safe)) * LN2)


@gluon.jit
def _pooled_forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    tail_k_desc,
    tail_v_desc,
    O_INIT,
    LSE_INIT,
    O,
    LSE,
    LIST,
    n_q,
    bank_rows,
    stride_lb,
    stride_lt,
    out_heads,
    stride_ob,
    stride_oh,
    stride_on,
    qk_scale,
    weight1,
    weight2,
    tail_lo,
    tail_bias,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
    CAND1: gl.constexpr,
    CAND2: gl.constexpr,
    TAIL_ROWS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One program per (group of B^2 query rows, batch x head): the group's keys loaded once (``_group_keys``), then
    its query tiles (64 rows per warpgroup) walked over them one after the other (``_walk_tile``). A tile's q is in
    shared memory (TMA; the next tile's copy is issued once the logits products have read this one's), the fine pass's
    partial output and LSE in registers."""
    group = gl.program_id(0)
    bh = gl.program_id(1)
    ROWS: gl.constexpr = TILE * (num_warps // 4)
    STEPS1: gl.constexpr = CAND1 * BLOCK // TILE
    STEPS2: gl.constexpr = CAND2 * BLOCK // TILE
    STEPS: gl.constexpr = STEPS1 + STEPS2 + TAIL_ROWS // TILE
    mma: gl.constexpr = _accumulator_layout(HEAD_DIM, num_warps)

    q_s = gl.allocate_shared_memory(q_desc.dtype, [ROWS, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    key_bars = gl.allocate_shared_memory(gl.int64, [STEPS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    # the first tile's q (its copy runs while the keys' copies are issued), then the group's keys
    row0 = group * GROUP_ROWS
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh * n_q + row0, 0], q_bar, q_s)
    where = (LIST, stride_lb, stride_lt, bh, group, bank_rows, tail_lo)  # the group's list and the bank's rows
    descriptors = (k_desc, v_desc, tail_k_desc, tail_v_desc)
    k_s, v_s = _group_keys(descriptors, where, key_bars, BLOCK, CAND1 + CAND2, TAIL_ROWS, HEAD_DIM, GROUP_ROWS)

    # the logits' scale, the candidate levels' base-2 weights (as bsa_forward's list_weight has them), the tail's
    weights = (qk_scale, weight1 * LOG2E, weight2 * LOG2E, tail_bias)
    o_base = O + (bh // out_heads).to(gl.int64) * stride_ob + (bh % out_heads) * stride_oh
    dims = gl.max_contiguous(gl.multiple_of(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma)), 2), 2)
    for tile in gl.static_range(GROUP_ROWS // ROWS):
        rows = row0 + tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        start = _partial(O_INIT, LSE_INIT, bh, n_q, rows, dims)
        if tile == 0:  # (here, so that the first tile's partial loads are in flight while the keys arrive)
            _wait_keys(key_bars, STEPS)
        mbarrier.wait(q_bar, tile & 1)
        q_next = (q_desc, bh * n_q + row0 + (tile + 1) * ROWS, q_bar)
        more = tile + 1 < GROUP_ROWS // ROWS
        walked = _walk_tile(q_s, k_s, v_s, q_next, start, weights, STEPS1, STEPS2, STEPS, mma, more)
        _finish(o_base, LSE, bh, n_q, rows, dims, stride_on, walked)
    mbarrier.invalidate(q_bar)
    for c in gl.static_range(STEPS):
        mbarrier.invalidate(key_bars.index(c))


@gluon.jit
def _dscores(s, dp, lse2, delta, qk_scale, shift, shifted, dtype: gl.constexpr, ds_layout: gl.constexpr):
    """A step's dS = P (dP - Δ) (``dtype``, in the layout of the dq product's A operand), P from the forward's LSE
    written as ``bsa_backward_dq`` computes it: its weighted list walk (``shifted``) scales and shifts the logits,
    then the exponent; its dense tail puts scale and shift in the exponent."""
    if shifted:
        s = s * qk_scale
        s += shift
        p = gl.exp2(s - lse2[:, None])
    else:
        p = gl.exp2(s * qk_scale - (lse2 - shift)[:, None])
    return gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)


@gluon.jit
def _pooled_dq_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    tail_k_desc,
    tail_v_desc,
    O,
    LSE,
    DELTA,
    DQ,
    LIST,
    n_q,
    bank_rows,
    stride_lb,
    stride_lt,
    heads,
    qk_scale,
    sm_scale,
    weight1,
    weight2,
    tail_lo,
    tail_bias,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    GROUP_ROWS: gl.constexpr,
    CAND1: gl.constexpr,
    CAND2: gl.constexpr,
    TAIL_ROWS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The pooled pass's dq (and Δ = rowsum(dO * O)), as ``bsa_backward_dq`` computes it for LLSA's pooled lists:
    per 64-key step S = q K^T, P from the forward's LSE, dP = dO V^T, dS = P (dP - Δ), dq += dS K. dO and O are
    tokens-major ``[BH / heads, N, heads, d]``; dq is fp32 ``[BH, N, d]``."""
    group = gl.program_id(0)
    bh = gl.program_id(1)
    KEYS: gl.constexpr = (CAND1 + CAND2) * BLOCK + TAIL_ROWS
    TILES: gl.constexpr = GROUP_ROWS // TILE
    STEPS1: gl.constexpr = CAND1 * BLOCK // TILE
    STEPS2: gl.constexpr = CAND2 * BLOCK // TILE
    STEPS: gl.constexpr = KEYS // TILE
    LISTED: gl.constexpr = STEPS1 + STEPS2
    mma: gl.constexpr = _accumulator_layout(HEAD_DIM, num_warps)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))

    q_s = gl.allocate_shared_memory(q_desc.dtype, [TILE, HEAD_DIM], q_desc.layout)  # one buffer each: the keys
    do_s = gl.allocate_shared_memory(do_desc.dtype, [TILE, HEAD_DIM], do_desc.layout)  # leave room for two programs
    tile_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    key_bars = gl.allocate_shared_memory(gl.int64, [STEPS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(tile_bar, count=1)
    where = (LIST, stride_lb, stride_lt, bh, group, bank_rows, tail_lo)  # the group's list and the bank's rows
    descriptors = (k_desc, v_desc, tail_k_desc, tail_v_desc)
    k_s, v_s = _group_keys(descriptors, where, key_bars, BLOCK, CAND1 + CAND2, TAIL_ROWS, HEAD_DIM, GROUP_ROWS)

    w1 = weight1 * LOG2E
    w2 = weight2 * LOG2E
    zero = gl.zeros([TILE, TILE], gl.float32, mma)
    _wait_keys(key_bars, STEPS)
    b = bh // heads
    head = bh % heads
    for tile in range(TILES):
        row0 = group * GROUP_ROWS + tile * TILE
        _cta_barrier()  # the previous tile's products have read q and dO
        mbarrier.expect(tile_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * n_q + row0, 0], tile_bar, q_s)
        tma.async_copy_global_to_shared(do_desc, [b * n_q + row0, head * HEAD_DIM], tile_bar, do_s)
        rows = row0 + gl.arange(0, TILE, layout=row_layout)
        flat = bh.to(gl.int64) * n_q + rows
        lse2 = gl.load(LSE + flat) * LOG2E
        o = gl.load(O + (b.to(gl.int64) * n_q + rows)[:, None] * (heads * HEAD_DIM) + head * HEAD_DIM + dims[None, :])
        mbarrier.wait(tile_bar, tile & 1)
        delta = gl.sum(o.to(gl.float32) * do_s.load(mma).to(gl.float32), 1)
        gl.store(DELTA + flat, delta)
        # step c's dS is computed while S(c + 1) and dP(c + 1) run; nothing is in flight at the loop's back edge (see
        # _walk_tile), and the middle steps are a loop for the same reason as there
        dq = gl.zeros([TILE, HEAD_DIM], gl.float32, mma)
        s = _logits(q_s, k_s, 0, zero)
        dp = warpgroup_mma(do_s, v_s.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        for c in range(0, STEPS - 1):
            s_next = _logits(q_s, k_s, c + 1, zero)
            dp_next = warpgroup_mma(do_s, v_s.index(c + 1).permute((1, 0)), zero, use_acc=False, is_async=True)
            shift = _step_weight(c, w1, w2, tail_bias, STEPS1, STEPS2)
            ds = _dscores(s, dp, lse2, delta, qk_scale, shift, c < LISTED, k_s.dtype, ds_layout)
            dq = warpgroup_mma(ds, k_s.index(c), dq, is_async=True)
            s, dp, dq, ds = warpgroup_mma_wait(0, deps=(s_next, dp_next, dq, ds))
        shift = _step_weight(STEPS - 1, w1, w2, tail_bias, STEPS1, STEPS2)
        ds = _dscores(s, dp, lse2, delta, qk_scale, shift, STEPS - 1 < LISTED, k_s.dtype, ds_layout)
        dq = warpgroup_mma(ds, k_s.index(STEPS - 1), dq)
        gl.store(DQ + flat[:, None] * HEAD_DIM + dims[None, :], dq * sm_scale)
    mbarrier.invalidate(tile_bar)
    for c in gl.static_range(STEPS):
        mbarrier.invalidate(key_bars.index(c))


def pooled_supported(
    q: torch.Tensor, block_size: int, cand_widths: tuple[int, ...], tail_rows: int, full_lists: bool
) -> bool:
    """Whether the Gluon kernels (``pooled_forward``, ``pooled_dq``) take this pooled pass (else ``bsa_forward`` and
    ``bsa_backward_dq`` do): q ``[BH, N, d]``,
    ``cand_widths`` the listed blocks of each candidate level, ``tail_rows`` the coarsest level's rows."""
    on_hopper = q.device.type == "cuda" and not INTERPRET and torch.cuda.get_device_capability(q.device)[0] == 9
    BH, n_q, d = q.shape
    flat = q.stride() == (n_q * d, d, 1)  # q's TMA descriptor reads it as [BH * N, d]
    return on_hopper and flat and case_supported(q.dtype, d, n_q, block_size, cand_widths, tail_rows, full_lists)


def case_supported(
    dtype: torch.dtype, head_dim: int, n_q: int, block_size: int, cand_widths, tail_rows: int, full_lists: bool
) -> bool:
    """The kernel's shape rules (the module docstring's restrictions), apart from the device and q's layout."""
    cand_rows = [width * block_size for width in cand_widths]
    return (
        dtype in (torch.float16, torch.bfloat16)
        and head_dim == 64
        and full_lists
        and 1 <= len(cand_widths) <= 2
        and all(rows % TILE.value == 0 for rows in cand_rows)
        and 0 < tail_rows
        and tail_rows % TILE.value == 0
        and sum(cand_rows) + tail_rows <= MAX_KEYS
        and n_q % (block_size * block_size) == 0
        and block_size * block_size % FORWARD_ROWS == 0  # the forward's 128-row tiles
    )


def pooled_forward(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    lists: torch.Tensor,
    o_init: torch.Tensor,
    lse_init: torch.Tensor,
    block_size: int,
    scale: float,
    cand_widths: tuple[int, ...],
    tail: tuple[int, int, float],
    out_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA's pooled pass (see the module docstring). q ``[BH, N, d]``; bank_k / bank_v ``[BH, bank rows, d]``;
    lists int32 ``[BH, N / 64, len]`` (the candidate levels' bank blocks, finest level first, ``cand_widths`` columns
    each; the same for every 64-row tile of a B^2-row group); o_init ``[BH, N, d]`` (q's dtype) and lse_init fp32
    ``[BH, N]``: the fine pass's result; tail ``(row_lo, row_hi, log_weight)``. Returns the output tokens-major
    ``[BH / out_heads, N, out_heads, d]`` in q's dtype and the LSE fp32 ``[BH, N]``."""
    widths = list(cand_widths) + [0] * (2 - len(cand_widths))
    return _pooled_forward_op(
        q, bank_k, bank_v, lists, o_init, lse_init, block_size, scale, widths, tail[0], tail[1], tail[2], out_heads
    )


@custom_op("llsa_pooled_forward")
def _pooled_forward_op(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    lists: torch.Tensor,
    o_init: torch.Tensor,
    lse_init: torch.Tensor,
    block_size: int,
    scale: float,
    cand_widths: list[int],
    tail_lo: int,
    tail_hi: int,
    tail_log_weight: float,
    out_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    BH, n_q, d = q.shape
    bank_rows = bank_k.shape[1]
    B = block_size
    q_desc, k_desc, v_desc, tail_k_desc, tail_v_desc = _descriptors(q, bank_k, bank_v, block_size, FORWARD_ROWS)
    o = q.new_empty(BH // out_heads, n_q, out_heads, d)  # tokens-major, as llsa's last pass writes it
    lse = torch.empty(BH, n_q, device=q.device, dtype=torch.float32)
    _pooled_forward_kernel[(n_q // (B * B), BH)](
        q_desc,
        k_desc,
        v_desc,
        tail_k_desc,
        tail_v_desc,
        o_init,
        lse_init,
        o,
        lse,
        lists,
        n_q,
        bank_rows,
        lists.stride(0),
        lists.stride(1),
        out_heads,
        o.stride(0),
        o.stride(2),
        o.stride(1),
        scale * LOG2E.value,
        1 * math.log(B),  # the candidate levels' log weights l ln B, as llsa passes them to bsa_forward
        2 * math.log(B),
        tail_lo,
        tail_log_weight * LOG2E.value,
        HEAD_DIM=d,
        BLOCK=B,
        GROUP_ROWS=B * B,
        CAND1=cand_widths[0],
        CAND2=cand_widths[1],
        TAIL_ROWS=tail_hi - tail_lo,
        num_warps=FORWARD_WARPS,
    )
    return o, lse


def pooled_dq(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    do: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    lists: torch.Tensor,
    block_size: int,
    scale: float,
    cand_widths: tuple[int, ...],
    tail: tuple[int, int, float],
) -> torch.Tensor:
    """The pooled pass's dq, fp32 ``[BH, N, d]``, and Δ = rowsum(dO * O) into ``delta`` (fp32 ``[BH, N]``): what
    ``bsa_backward_dq`` computes for LLSA's pooled lists (``o=`` given). q, bank_k, bank_v, lists, cand_widths and
    tail as for ``pooled_forward``; do and o tokens-major ``[BH / heads, N, heads, d]``, contiguous; lse the
    forward's."""
    widths = list(cand_widths) + [0] * (2 - len(cand_widths))
    return _pooled_dq_op(q, bank_k, bank_v, do, o, lse, delta, lists, block_size, scale, widths, *tail)


@custom_op("llsa_pooled_dq", mutates_args=("delta",))
def _pooled_dq_op(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    do: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    lists: torch.Tensor,
    block_size: int,
    scale: float,
    cand_widths: list[int],
    tail_lo: int,
    tail_hi: int,
    tail_log_weight: float,
) -> torch.Tensor:
    BH, n_q, d = q.shape
    b, heads = do.shape[0], do.shape[2]
    q_desc, k_desc, v_desc, tail_k_desc, tail_v_desc = _descriptors(q, bank_k, bank_v, block_size, TILE.value)
    layout = gl.NVMMASharedLayout.get_default_for([TILE.value, d], _gl_dtype(q.dtype))
    do_desc = TensorDescriptor(do, [b * n_q, heads * d], [heads * d, 1], [TILE.value, d], layout)
    dq = torch.empty(BH, n_q, d, device=q.device, dtype=torch.float32)
    _pooled_dq_kernel[(n_q // block_size**2, BH)](
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        tail_k_desc,
        tail_v_desc,
        o,
        lse,
        delta,
        dq,
        lists,
        n_q,
        bank_k.shape[1],
        lists.stride(0),
        lists.stride(1),
        heads,
        scale * LOG2E.value,
        scale,
        1 * math.log(block_size),
        2 * math.log(block_size),
        tail_lo,
        tail_log_weight * LOG2E.value,
        HEAD_DIM=d,
        BLOCK=block_size,
        GROUP_ROWS=block_size**2,
        CAND1=cand_widths[0],
        CAND2=cand_widths[1],
        TAIL_ROWS=tail_hi - tail_lo,
        num_warps=4,
    )
    return dq


@_pooled_dq_op.register_fake
def _(q, bank_k, bank_v, do, o, lse, delta, lists, block_size, scale, cand_widths, tail_lo, tail_hi, tail_w):
    return torch.empty_like(q, dtype=torch.float32)


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


def _descriptors(q, bank_k, bank_v, block_size, q_rows):
    """TMA descriptors: q ``[BH * N, d]`` in tiles of ``q_rows``; the bank's K and V ``[BH * rows, d]`` in blocks of
    ``block_size`` rows (the listed blocks) and in 64-row tiles (the coarsest level)."""
    BH, n_q, d = q.shape
    rows = BH * bank_k.shape[1]
    layout = gl.NVMMASharedLayout.get_default_for([TILE.value, d], _gl_dtype(q.dtype))  # 128-byte swizzle
    q_desc = TensorDescriptor(q, [BH * n_q, d], [d, 1], [q_rows, d], layout)
    listed = [TensorDescriptor(x, [rows, d], [d, 1], [block_size, d], layout) for x in (bank_k, bank_v)]
    tail = [TensorDescriptor(x, [rows, d], [d, 1], [TILE.value, d], layout) for x in (bank_k, bank_v)]
    return q_desc, *listed, *tail


@_pooled_forward_op.register_fake
def _(q, bank_k, bank_v, lists, o_init, lse_init, block_size, scale, cand_widths, tail_lo, tail_hi, tail_w, heads):
    BH, n_q, d = q.shape
    return q.new_empty(BH // heads, n_q, heads, d), q.new_empty(BH, n_q, dtype=torch.float32)
