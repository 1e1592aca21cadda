"""Block-sparse FlashAttention in Triton (forward + backward), the one attention kernel behind LLSA, VSA, SLA and
the dense `attention=full impl=triton` path.

    from pixdit.kernels import block_sparse_attention, flash_attention
    o = block_sparse_attention(q, k, v, block_lists, query_block=64, key_block=64)     # [b, h, Nq, d]
    o, lse = block_sparse_attention(q, k, v, block_lists, query_block=64, key_block=64, return_lse=True)
    o = flash_attention(q, k, v)                                                      # dense, same kernel

Model. Queries are cut into tiles of ``query_block`` rows, keys ("the bank") into blocks of ``key_block`` rows. Query
tile ``t`` attends to the key blocks listed in ``block_lists[b, h, t, :]`` (int32 ids, ``-1`` = empty slot; ids
distinct within a row), one softmax over all their keys; key rows ``>= Nk`` (a partial last block) are masked. An
optional ``block_log_weights[key block]`` (fp32) is added to every logit of that block: LLSA's ``W_l = B^l``
multiplicity (docs/algorithms.md, "LLSA") is ``log_weight = l * ln(B)``.

Kernels (all fp32 accumulation, no float atomics, bitwise deterministic):
* ``_fwd_kernel``   query-major: one program per (query tile, batch*head); online softmax over its list; writes O and
                    the natural-log LSE (weights included). Can start from a previous partial result (O, LSE) of the
                    same queries over other keys, which is how LLSA chains its fine and its pooled key banks, and
                    can end with a dense tail: key rows every query attends to, walked contiguously after the list
                    (LLSA's coarsest level). ``_dq_kernel`` takes the same tail.
* ``_dq_kernel``    query-major over the same lists (optionally adds into an existing fp32 dq).
* ``_dkdv_kernel``  key-major: one program per (group of key blocks sharing one list, batch*head, split) over the CSC
                    transpose of the lists (``blocks.csr_to_csc``); long lists are split in a fixed way and the
                    partial sums are added in a fixed order, so every gradient row has one writer. One-warp
                    programs of one key block can also keep each listed pair's dS (``ds_buffer``) for the next.
* ``_ds_dq_kernel`` query-major: dq = scale * sum of dS K over the list, from the kept dS (``bsa_backward_ds_dq``;
                    LLSA's fine level): nothing recomputed, no q, dO, V, LSE or Delta read.
The forward's and the dq's contiguous walks (listed blocks of >= 64 keys, the dense tail) load K and V by TMA on
Hopper, the key-major dk/dv its query tiles' q and dO (``tma_descriptors``), and 128-row forward programs over blocks
of >= 128 keys step 128 keys at a time (``forward_step_keys``).
Per step the query-major passes (forward, dq) gather ``max(1, 64 // key_block)`` listed key blocks and the key-major
backward ``max(1, 64 // query_block)`` query tiles, so small blocks still feed the tensor cores 64-wide dots; a
one-warp program (16 query rows, or 16 keys) instead walks one listed block per step, which holds far fewer
registers (``walk_blocks_per_step``).

CPU tensors (and ``impl="torch"``) run ``block_sparse_attention_torch``, an exact gather-form PyTorch version.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .blocks import block_mean_adjoint, csr_to_csc
from .common import AUTOTUNE, INTERPRET, autocast_inputs, autotuned, check_qkv, use_triton
from .ops import cdiv, custom_op, next_power_of_2, shape_constant

__all__ = ["block_sparse_attention", "block_sparse_attention_torch", "flash_attention"]

# log2(e) and ln(2): the kernels' online softmax runs in base 2 (exp2, log2). Constexprs, because a kernel reads a
# module global only as one; host code takes their .value.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
TAIL_STEP = tl.constexpr(64)  # keys per step of a dense tail (see bsa_forward)


# ----------------------------------------------------------------------------------------------------------- kernels


@triton.jit
def list_walk_start(LIST, bh, tile, stride_lb, stride_lt, KEY_BLOCK: tl.constexpr, PER_ITER: tl.constexpr):
    """Where query tile ``tile``'s list of key blocks starts, and the per-key offsets (``koff``) and list slots
    (``slot``) of one step that gathers ``PER_ITER`` listed blocks of ``KEY_BLOCK`` rows."""
    koff = tl.arange(0, KEY_BLOCK * PER_ITER)
    return koff, koff // KEY_BLOCK, LIST + bh * stride_lb + tile.to(tl.int64) * stride_lt


@triton.jit
def head_offset(bh, heads, stride_b, stride_h):
    """Offset of the flattened batch * head index ``bh`` in a tensor with separate batch and head strides (a
    tokens-major ``[b, n, heads, d]`` output); ``heads = 1`` is a plain ``[BH, n, d]`` tensor (``row_layout``)."""
    return (bh // heads) * stride_b + (bh % heads) * stride_h


@triton.jit
def listed_key_rows(list_base, j, koff, slot, list_len, n_k, KEY_BLOCK: tl.constexpr):
    """The key rows listed at slots ``j .. j + PER_ITER - 1`` and which of them exist (``-1`` = empty slot; rows
    ``>= n_k`` = the masked tail of a partial last block). Also returns the block ids (for per-block weights)."""
    blk = tl.load(list_base + j + slot, mask=(j + slot) < list_len, other=-1)
    krow = blk.to(tl.int64) * KEY_BLOCK + (koff % KEY_BLOCK)
    return blk, krow, (blk >= 0) & (krow < n_k)


@triton.jit
def listed_ids(list_base, list_len, LIST_SLOTS: tl.constexpr, PER_ITER: tl.constexpr):
    """A query tile's whole list, loaded before its walk as ``[LIST_SLOTS // PER_ITER, PER_ITER]`` ids, one row per
    step (-1 past the list's end). Triton pipelines a walk whose addresses come from registers deeper than one whose
    ids are loaded inside the loop (two K/V buffers then, whatever ``num_stages`` says; docs/kernel_notes.md v15).
    ``LIST_SLOTS = 0``: not loaded here (long lists are read step by step)."""
    if LIST_SLOTS > 0:
        slots = tl.arange(0, LIST_SLOTS // PER_ITER)[:, None] * PER_ITER + tl.arange(0, PER_ITER)[None, :]
        return tl.load(list_base + slots, mask=slots < list_len, other=-1)
    else:
        return tl.full([1, PER_ITER], -1, tl.int32)


@triton.jit
def step_ids(ids, step):
    """Row ``step`` of ``listed_ids``: the ``PER_ITER`` block ids of one step (a masked sum: no load)."""
    steps = tl.arange(0, ids.shape[0])
    return tl.sum(tl.where(steps[:, None] == step, ids, 0), 0)


@triton.jit
def step_key_rows(ids, step, koff, n_k, KEY_BLOCK: tl.constexpr, PER_ITER: tl.constexpr):
    """``listed_key_rows`` of step ``step`` from the ids in registers (``listed_ids``)."""
    row = step_ids(ids, step)
    blk = tl.reshape(tl.broadcast_to(row[:, None], [PER_ITER, KEY_BLOCK]), [PER_ITER * KEY_BLOCK])
    krow = blk.to(tl.int64) * KEY_BLOCK + (koff % KEY_BLOCK)
    return blk, krow, (blk >= 0) & (krow < n_k)


@triton.jit
def full_list_rows(blk, koff, KEY_BLOCK: tl.constexpr):
    """A gathered step's block ids, key rows and (all true) existence when the caller promised full lists
    (``FULL_LIST``: no masks): an id < 0, which only a broken promise leaves (e.g. a selection over NaN scores), reads
    as block 0, so that no load leaves k and v; the result is then wrong, as its inputs were, but nothing faults."""
    blk = tl.maximum(blk, 0)
    return blk, blk.to(tl.int64) * KEY_BLOCK + (koff % KEY_BLOCK), blk >= 0


@triton.jit
def walk_key_rows(
    ids,
    list_base,
    j,
    koff,
    slot,
    list_len,
    n_k,
    KEY_BLOCK: tl.constexpr,
    PER_ITER: tl.constexpr,
    LIST_SLOTS: tl.constexpr,
):
    """The key rows of the step at list slot ``j`` (``listed_key_rows``), from the ids in registers when the walk
    loaded them (``LIST_SLOTS > 0``, ``listed_ids``), else loaded now."""
    if LIST_SLOTS > 0:
        return step_key_rows(ids, j // PER_ITER, koff, n_k, KEY_BLOCK, PER_ITER)
    else:
        return listed_key_rows(list_base, j, koff, slot, list_len, n_k, KEY_BLOCK)


@triton.jit
def first_scalar_id(list_base, list_len, LIST_SLOTS: tl.constexpr):
    """The id that a scalar-id walk (one block per step) reading its list from memory carries into its first step
    (``scalar_step_id``); unused when the list is in registers."""
    nxt = -1
    if LIST_SLOTS == 0:
        nxt = tl.load(list_base, mask=list_len > 0, other=-1)
    return nxt


@triton.jit
def scalar_step_id(ids, list_base, nxt, j, list_len, N_SUB: tl.constexpr, LIST_SLOTS: tl.constexpr):
    """``(block id, carried id)`` of step ``j`` of a scalar-id walk over blocks of ``N_SUB`` steps: from the ids in
    registers (``listed_ids``), or from memory, each loaded one step ahead. Then a step's addresses come from a value
    of the previous iteration, which Triton pipelines num_stages deep; an id loaded and used in one iteration keeps
    two K/V buffers whatever num_stages says (docs/kernel_notes.md v15, v36)."""
    if LIST_SLOTS > 0:
        blk = tl.sum(step_ids(ids, j // N_SUB))
    else:
        blk = nxt
        nxt = tl.load(list_base + tl.minimum((j + 1) // N_SUB, list_len - 1))
    return blk, nxt


@triton.jit
def rows_load(ptrs, row_ok, WHOLE: tl.constexpr):
    """A load of a tile's rows, masked by ``row_ok`` (broadcastable) unless ``WHOLE`` (every row exists)."""
    if WHOLE:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=row_ok, other=0.0)


@triton.jit
def list_weight(slot, runs, LIST_RUNS: tl.constexpr):
    """The natural-log weight of the listed block at list slot ``slot`` (a step's first slot) for a list weighted by
    runs of columns (``list_runs``): ``runs = (w0, end0, w1, end1, w2)``, slots [0, end0) weigh w0, [end0, end1) w1,
    the rest w2, of which the first ``LIST_RUNS`` are used (1: one weight for the whole list). Two scalar selects per
    step, no load: LLSA's candidate levels each weigh ``l ln B`` and fill one run of columns each."""
    w0, end0, w1, end1, w2 = runs
    w = w0
    if LIST_RUNS >= 2:
        w = tl.where(slot >= end0, w1, w)
    if LIST_RUNS >= 3:
        w = tl.where(slot >= end1, w2, w)
    return w


@triton.jit
def softmax_step(s, scale, shift, m_i, l_i, acc, v, PREC: tl.constexpr):
    """One online-softmax update with a tile of raw logits ``s`` (-inf = masked) whose base-2 logits are
    ``s * scale + shift``; ``shift`` is one number for the whole step (a block's or a level's log weight, -inf for an
    empty list slot). Scale and shift enter each logit's exponent as one FMA, ``exp2(s * scale - (m - shift))``, and
    the row maximum as ``max(s) * scale + shift``: one operation per logit fewer than scaling and shifting the tile
    first, in the part of the loop that runs on the CUDA cores between the two products (docs/kernel_notes.md v36)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale + shift)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without a key so far: exp2(-inf) = 0, not NaN
    p = tl.math.exp2(s * scale - (m_use - shift)[:, None])  # shift = -inf: m_use - shift = +inf, so p = 0
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def finish_softmax(m_i, l_i, acc):
    """The normalised output and natural-log LSE of an online softmax (base-2 ``m_i``); a row without a key gets
    output 0 and LSE -inf."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None], (m_i + tl.math.log2(l_safe)) * LN2


@triton.jit
def contiguous_fwd_step(
    q,
    kv,
    row0,
    bias,
    row_end,
    qk_scale,
    m_i,
    l_i,
    acc,
    KEY_ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """One forward step over the ``KEY_ROWS`` contiguous key rows from ``row0`` on, with one scalar (base-2)
    ``bias``: a scalar-id block of the list or a step of the dense tail. Rows ``>= row_end`` are masked unless
    ``EVEN`` (every row exists). ``kv = (k_base, v_base, stride_kn, stride_vn, k_desc, v_desc, k_drow, v_drow,
    v_col)`` says where K and V are: by pointers, or for ``TMA`` (``EVEN`` steps only) by tensor-memory-accelerator
    copies through the 2-D descriptors of ``tma_descriptors``, K at descriptor rows ``k_drow + row0`` from column 0,
    V at rows ``v_drow + row0`` from column ``v_col``."""
    k_base, v_base, stride_kn, stride_vn, k_desc, v_desc, k_drow, v_drow, v_col = kv
    if TMA:
        s = tl.dot(q, tl.trans(k_desc.load([(k_drow + row0).to(tl.int32), 0])), input_precision=PREC)
        v = v_desc.load([(v_drow + row0).to(tl.int32), v_col])
    else:
        dims = tl.arange(0, q.shape[1])
        krow = row0 + tl.arange(0, KEY_ROWS)
        kt_ptrs = k_base + krow[None, :] * stride_kn + dims[:, None]
        v_ptrs = v_base + krow[:, None] * stride_vn + dims[None, :]
        if EVEN:
            s = tl.dot(q, tl.load(kt_ptrs), input_precision=PREC)
            v = tl.load(v_ptrs)
        else:
            k_ok = krow < row_end
            s = tl.dot(q, tl.load(kt_ptrs, mask=k_ok[None, :], other=0.0), input_precision=PREC)
            s = tl.where(k_ok[None, :], s, float("-inf"))
            v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
    return softmax_step(s, qk_scale, bias, m_i, l_i, acc, v, PREC)


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    LIST,
    LOGW,
    O_INIT,
    LSE_INIT,
    K_DESC,
    V_DESC,
    stride_qb,
    stride_qn,
    stride_kb,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    v_heads,
    stride_ob,
    stride_oh,
    stride_on,
    out_heads,
    stride_lb,
    stride_lt,
    n_q,
    n_k,
    list_len,
    qk_scale,
    tail_lo,
    tail_hi,
    tail_bias,
    list_bias,
    run_end0,
    run_bias1,
    run_end1,
    run_bias2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    PER_ITER: tl.constexpr,
    HAS_LOGW: tl.constexpr,
    HAS_INIT: tl.constexpr,
    PREC: tl.constexpr,
    EVEN_K: tl.constexpr,
    N_SUB: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    EVEN_TAIL: tl.constexpr,
    LIST_SLOTS: tl.constexpr,
    LIST_RUNS: tl.constexpr,
    FULL_LIST: tl.constexpr,
    DESC_ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh * stride_qb + rows[:, None] * stride_qn + dims[None, :], mask=row_ok[:, None], other=0.0)
    if HAS_INIT:  # continue a partial softmax: m = previous LSE, l = 1, acc = previous (normalized) output
        m_i = tl.load(LSE_INIT + bh * n_q + rows, mask=row_ok, other=0.0) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.load(
            O_INIT + bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0
        ).to(tl.float32)  # (fp32, or the inputs' dtype: llsa.PARTIAL_DTYPE)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    koff, slot, list_base = list_walk_start(LIST, bh, tile, stride_lb, stride_lt, KEY_BLOCK, PER_ITER)
    ids = listed_ids(list_base, list_len, LIST_SLOTS, PER_ITER)
    runs = (list_bias, run_end0, run_bias1, run_end1, run_bias2)
    k_base = K + bh * stride_kb
    v_base = V + head_offset(bh, v_heads, stride_vb, stride_vh)  # v may be tokens-major, e.g. a view of qkv
    # DESC_ROWS > 0: K_DESC / V_DESC are 2-D descriptors of DESC_ROWS-row tiles (tma_descriptors): k as [BH * n_k,
    # d], v as [BH / v_heads * n_k, v_heads * d]; the contiguous walks whose steps are whole tiles of that size load
    # by TMA
    v_col = ((bh % v_heads) * HEAD_DIM).to(tl.int32)
    kv = (k_base, v_base, stride_kn, stride_vn, K_DESC, V_DESC, bh * n_k, (bh // v_heads) * n_k, v_col)
    if PER_ITER == 1:  # one block per step (blocks of >= 64 keys, or a one-warp program): a scalar id per step, so
        # contiguous (vectorised, pipelined) rows, and an empty slot (-1) is a scalar -inf bias, not a per-element
        # mask; a block of > 64 keys is walked in N_SUB tiles of KEY_BLOCK // N_SUB rows
        STEP_ROWS: tl.constexpr = KEY_BLOCK // N_SUB
        LIST_TMA: tl.constexpr = DESC_ROWS == STEP_ROWS and EVEN_K
        nxt = first_scalar_id(list_base, list_len, LIST_SLOTS)
        for j in range(0, list_len * N_SUB):
            blk, nxt = scalar_step_id(ids, list_base, nxt, j, list_len, N_SUB, LIST_SLOTS)
            row0 = tl.maximum(blk, 0).to(tl.int64) * KEY_BLOCK + (j % N_SUB) * STEP_ROWS
            bias = tl.where(blk >= 0, 0.0, float("-inf"))
            if HAS_LOGW:
                bias += tl.load(LOGW + tl.maximum(blk, 0)) * LOG2E
            if LIST_RUNS > 0:
                bias += list_weight(j // N_SUB, runs, LIST_RUNS) * LOG2E
            # EVEN_K: Nk is a multiple of KEY_BLOCK, so no row of a listed block is out of range
            m_i, l_i, acc = contiguous_fwd_step(
                q, kv, row0, bias, n_k, qk_scale, m_i, l_i, acc, STEP_ROWS, EVEN_K, PREC, LIST_TMA
            )
    else:  # PER_ITER small blocks gathered per step (>= 64 keys per dot)
        for j in range(0, list_len, PER_ITER):
            blk, krow, k_ok = walk_key_rows(
                ids, list_base, j, koff, slot, list_len, n_k, KEY_BLOCK, PER_ITER, LIST_SLOTS
            )
            if FULL_LIST:  # every slot holds a block and every row exists: no masks
                blk, krow, k_ok = full_list_rows(blk, koff, KEY_BLOCK)
                kt = tl.load(k_base + krow[None, :] * stride_kn + dims[:, None])
                v = tl.load(v_base + krow[:, None] * stride_vn + dims[None, :])
            else:
                kt = tl.load(k_base + krow[None, :] * stride_kn + dims[:, None], mask=k_ok[None, :], other=0.0)
                v = tl.load(v_base + krow[:, None] * stride_vn + dims[None, :], mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, kt, input_precision=PREC)
            if LIST_RUNS > 0 or HAS_LOGW:  # weighted walks scale and shift the tile first, as before v36, so one
                # weight per step (LIST_RUNS, a scalar) stays bit for bit the same weight per block (HAS_LOGW)
                s = s * qk_scale
                if LIST_RUNS > 0:
                    s += list_weight(j, runs, LIST_RUNS) * LOG2E
                if HAS_LOGW:
                    w = tl.load(LOGW + blk, mask=k_ok, other=0.0)
                    s += w[None, :] * LOG2E
                scale = 1.0
            else:
                scale = qk_scale
            if not FULL_LIST:
                s = tl.where(k_ok[None, :], s, float("-inf"))
            m_i, l_i, acc = softmax_step(s, scale, 0.0, m_i, l_i, acc, v, PREC)
    if HAS_TAIL:  # then key rows [tail_lo, tail_hi), the same for every query: contiguous steps, one scalar weight
        TAIL_TMA: tl.constexpr = DESC_ROWS == TAIL_STEP and EVEN_TAIL
        for t0 in range(tail_lo, tail_hi, TAIL_STEP):  # EVEN_TAIL: the range is whole steps, no mask at all
            tail_row = tl.cast(t0, tl.int64)
            m_i, l_i, acc = contiguous_fwd_step(
                q, kv, tail_row, tail_bias, tail_hi, qk_scale, m_i, l_i, acc, TAIL_STEP, EVEN_TAIL, PREC, TAIL_TMA
            )
    acc, lse = finish_softmax(m_i, l_i, acc)
    o_offs = head_offset(bh, out_heads, stride_ob, stride_oh) + rows[:, None] * stride_on + dims[None, :]
    tl.store(O + o_offs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh * n_q + rows, lse, mask=row_ok)


@triton.jit
def contiguous_dq_step(
    q,
    do,
    kv,
    row0,
    bias,
    row_end,
    qk_scale,
    lse2,
    delta,
    dq,
    KEY_ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """One dq step over the ``KEY_ROWS`` contiguous key rows from ``row0`` on, with one scalar (base-2) ``bias``, K
    and V where ``kv`` says (both as contiguous_fwd_step). The scale and the bias enter the exponent as one FMA per
    logit (``dq_step``). Padded query rows load q = dO = 0 (and Δ = 0), so their ds is 0: no row mask needed."""
    k_base, v_base, stride_kn, stride_vn, k_desc, v_desc, k_drow, v_drow, v_col = kv
    if TMA:
        k = k_desc.load([(k_drow + row0).to(tl.int32), 0])
        v = v_desc.load([(v_drow + row0).to(tl.int32), v_col])
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    else:
        krow = row0 + tl.arange(0, KEY_ROWS)
        dims = tl.arange(0, q.shape[1])[None, :]
        # the dq's k and v share strides: then the two offsets are one tensor (the SASS of the form before the tuple)
        k_offs, v_offs = krow[:, None] * stride_kn + dims, krow[:, None] * stride_vn + dims
        if EVEN:
            k = tl.load(k_base + k_offs)
            v = tl.load(v_base + v_offs)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
        else:
            k_ok = krow < row_end
            k = tl.load(k_base + k_offs, mask=k_ok[:, None], other=0.0)
            v = tl.load(v_base + v_offs, mask=k_ok[:, None], other=0.0)
            s = tl.where(k_ok[None, :], tl.dot(q, tl.trans(k), input_precision=PREC), float("-inf"))
    return dq_step(s, k, v, do, qk_scale, bias, lse2, delta, dq, PREC)


@triton.jit
def dq_step(s, k, v, do, qk_scale, bias, lse2, delta, dq, PREC: tl.constexpr):
    """One dq step from the raw logits ``s = q k^T`` of key rows ``k``, ``v`` with one scalar base-2 ``bias``; the
    scale and the bias enter the exponent as one FMA per logit, ``exp2(s * scale - (lse - bias))``."""
    p = tl.math.exp2(s * qk_scale - (lse2 - bias)[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def gathered_dq_step(s, k, v, do, lse2, delta, ok, dq, MASK: tl.constexpr, PREC: tl.constexpr):
    """One dq step over gathered key rows ``k``, ``v`` with their base-2 logits ``s`` (bias included); ``ok`` masks
    missing keys and padded query rows. Without ``MASK`` (full lists: every key exists) no mask is applied: padded
    query rows load dO = 0 and Δ = 0, so their ds is 0 anyway."""
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PREC)


@triton.jit
def gathered_dq_step_t(st, k, v, do, lse2, delta, ok_t, dqt, PREC: tl.constexpr):
    """gathered_dq_step transposed, for warpgroup programs of < 64 rows (see the note below): ``st`` = the base-2 logits
    [keys, rows], ``ok_t`` its mask, ``dqt`` = dq^T [d, rows]."""
    pt = tl.where(ok_t, tl.math.exp2(st - lse2[None, :]), 0.0)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - delta[None, :])
    return dqt + tl.dot(tl.trans(k), dst.to(k.dtype), input_precision=PREC)


# Programs of fewer than 64 rows. A program of 16 rows (the query blocks and key blocks of LLSA, VSA and SLA with
# B = 16) and a head dim of up to 64 runs on one warp (``program_warps``): the warp owns whole rows, so the forward's
# softmax reductions and every dot's operands stay in its registers, and each dot is mma.sync's 16-row shape. With 4
# warps the rows' logits were split over the warps and exchanged through shared memory; one warp measured the fine
# forward 1.4x and LLSA's forward + backward 1.07x faster at 256², VSA 1.10x (docs/kernel_notes.md v21). Programs of
# 32 or 48 rows (B = 32) run the forward on one warp per 16 rows too (1.05x). The others keep a warpgroup: the
# backward of 32 or 48 rows (on 2 warps in the plain form it measured 0.95x, v21) and every program of a head dim of
# 128 (on one warp its tiles spill registers: 100-330 B in the compile report). Their backward computes its
# products transposed, with the rows it walks (64 gathered keys, or a 64-row query step) in the M dimension of
# Hopper's wgmma (>= 64 rows) and its own rows in N: S^T = K Q^T, dQ^T += K^T dS^T in dq; S = Q K^T, dV^T += dO^T P,
# dK^T += Q^T dS in dk/dv; the same products and fp32 sums as the plain form, bit for bit (v17).
@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    O,
    LSE,
    DELTA,
    DQ_IN,
    DQ,
    LIST,
    LOGW,
    ADD_Q,
    K_DESC,
    V_DESC,
    stride_qb,
    stride_qn,
    stride_kb,
    stride_kn,
    stride_db,
    stride_dh,
    stride_dn,
    do_heads,
    stride_lb,
    stride_lt,
    n_q,
    n_k,
    list_len,
    qk_scale,
    sm_scale,
    tail_lo,
    tail_hi,
    tail_bias,
    list_bias,
    run_end0,
    run_bias1,
    run_end1,
    run_bias2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    PER_ITER: tl.constexpr,
    HAS_LOGW: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    HAS_ADD: tl.constexpr,
    COMPUTE_DELTA: tl.constexpr,
    PREC: tl.constexpr,
    EVEN_K: tl.constexpr,
    N_SUB: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    EVEN_TAIL: tl.constexpr,
    LIST_SLOTS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    LIST_RUNS: tl.constexpr,
    FULL_LIST: tl.constexpr,
    DESC_ROWS: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + bh * stride_qb + rows[:, None] * stride_qn + dims[None, :], mask=row_ok[:, None], other=0.0)
    do_offs = head_offset(bh, do_heads, stride_db, stride_dh) + rows[:, None] * stride_dn + dims[None, :]
    do = tl.load(DO + do_offs, mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + bh * n_q + rows, mask=row_ok, other=0.0) * LOG2E
    if COMPUTE_DELTA:  # Δ_i = <dO_i, O_i> (O has dO's layout); written for the later passes
        o = tl.load(O + do_offs, mask=row_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + bh * n_q + rows, delta, mask=row_ok)
    else:
        delta = tl.load(DELTA + bh * n_q + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dqt = tl.zeros([HEAD_DIM, BLOCK_M], tl.float32)  # dq transposed, for warpgroup blocks of < 64 rows
    koff, slot, list_base = list_walk_start(LIST, bh, tile, stride_lb, stride_lt, KEY_BLOCK, PER_ITER)
    ids = listed_ids(list_base, list_len, LIST_SLOTS, PER_ITER)
    runs = (list_bias, run_end0, run_bias1, run_end1, run_bias2)
    k_base = K + bh * stride_kb
    v_base = V + bh * stride_kb
    # K_DESC / V_DESC: [BH * n_k, d] descriptors of DESC_ROWS-row tiles (tma_descriptors); k and v share strides
    kv = (k_base, v_base, stride_kn, stride_kn, K_DESC, V_DESC, bh * n_k, bh * n_k, 0)
    if PER_ITER == 1:  # blocks of >= 64 keys: scalar ids, contiguous rows, tiles of 64 keys (see _fwd_kernel)
        STEP_ROWS: tl.constexpr = KEY_BLOCK // N_SUB
        LIST_TMA: tl.constexpr = DESC_ROWS == STEP_ROWS and EVEN_K
        nxt = first_scalar_id(list_base, list_len, LIST_SLOTS)
        for j in range(0, list_len * N_SUB):
            blk, nxt = scalar_step_id(ids, list_base, nxt, j, list_len, N_SUB, LIST_SLOTS)
            row0 = tl.maximum(blk, 0).to(tl.int64) * KEY_BLOCK + (j % N_SUB) * STEP_ROWS
            bias = tl.where(blk >= 0, 0.0, float("-inf"))
            if HAS_LOGW:
                bias += tl.load(LOGW + tl.maximum(blk, 0)) * LOG2E
            if LIST_RUNS > 0:
                bias += list_weight(j // N_SUB, runs, LIST_RUNS) * LOG2E
            dq = contiguous_dq_step(
                q, do, kv, row0, bias, n_k, qk_scale, lse2, delta, dq, STEP_ROWS, EVEN_K, PREC, LIST_TMA
            )
    else:
        for j in range(0, list_len, PER_ITER):
            blk, krow, k_ok = walk_key_rows(
                ids, list_base, j, koff, slot, list_len, n_k, KEY_BLOCK, PER_ITER, LIST_SLOTS
            )
            if FULL_LIST:  # every slot holds a block and every row exists (see _fwd_kernel)
                blk, krow, k_ok = full_list_rows(blk, koff, KEY_BLOCK)
                k = tl.load(k_base + krow[:, None] * stride_kn + dims[None, :])
                v = tl.load(v_base + krow[:, None] * stride_kn + dims[None, :])
            else:
                k = tl.load(k_base + krow[:, None] * stride_kn + dims[None, :], mask=k_ok[:, None], other=0.0)
                v = tl.load(v_base + krow[:, None] * stride_kn + dims[None, :], mask=k_ok[:, None], other=0.0)
            if TRANSPOSED:  # rows in N: see the note above _dq_kernel
                st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
                if LIST_RUNS > 0:
                    st += list_weight(j, runs, LIST_RUNS) * LOG2E
                if HAS_LOGW:
                    w = tl.load(LOGW + blk, mask=k_ok, other=0.0)
                    st += w[:, None] * LOG2E
                dqt = gathered_dq_step_t(st, k, v, do, lse2, delta, k_ok[:, None] & row_ok[None, :], dqt, PREC)
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
                if LIST_RUNS > 0:
                    s += list_weight(j, runs, LIST_RUNS) * LOG2E
                if HAS_LOGW:
                    w = tl.load(LOGW + blk, mask=k_ok, other=0.0)
                    s += w[None, :] * LOG2E
                ok = k_ok[None, :] & row_ok[:, None]
                dq = gathered_dq_step(s, k, v, do, lse2, delta, ok, dq, not FULL_LIST, PREC)
        if TRANSPOSED:
            dq = tl.trans(dqt)
    if HAS_TAIL:  # key rows [tail_lo, tail_hi) of every query (see _fwd_kernel)
        TAIL_TMA: tl.constexpr = DESC_ROWS == TAIL_STEP and EVEN_TAIL
        for t0 in range(tail_lo, tail_hi, TAIL_STEP):
            tail_row = tl.cast(t0, tl.int64)
            dq = contiguous_dq_step(
                q, do, kv, tail_row, tail_bias, tail_hi, qk_scale, lse2, delta, dq, TAIL_STEP, EVEN_TAIL, PREC, TAIL_TMA
            )
    dq = dq * sm_scale
    dq_offs = bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    if ACCUMULATE:  # add an earlier pass's fp32 dq (other keys of the same queries)
        dq += tl.load(DQ_IN + dq_offs, mask=row_ok[:, None], other=0.0)
    if HAS_ADD:  # mean-pool adjoint: + (gradient of this tile's pooled token) / (the tile's real rows)
        a = tl.load(ADD_Q + (bh * tl.num_programs(0) + tile) * HEAD_DIM + dims)
        dq += a[None, :] / tl.minimum(n_q - tile * BLOCK_M, BLOCK_M).to(tl.float32)
    tl.store(DQ + dq_offs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def query_rows(Q, do_base, LSE, DELTA, bh, rows, r_ok, dims, stride_qb, stride_qn, stride_dn, n_q, MASK: tl.constexpr):
    """The query-side operands of a key-major backward step for query rows ``rows``: q, dO, the base-2 log-sum-exp
    and Delta. ``MASK``: rows outside ``r_ok`` read as zeros (without it every row must exist)."""
    q = rows_load(Q + bh * stride_qb + rows[:, None] * stride_qn + dims[None, :], r_ok[:, None], not MASK)
    do = rows_load(do_base + rows[:, None] * stride_dn + dims[None, :], r_ok[:, None], not MASK)
    lse2, delta = query_stats(LSE, DELTA, bh, rows, r_ok, n_q, MASK)
    return q, do, lse2, delta


@triton.jit
def query_stats(LSE, DELTA, bh, rows, r_ok, n_q, MASK: tl.constexpr):
    """The base-2 log-sum-exp and Delta of query rows ``rows`` (``MASK``: rows outside ``r_ok`` read as zeros)."""
    lse2 = rows_load(LSE + bh * n_q + rows, r_ok, not MASK) * LOG2E
    return lse2, rows_load(DELTA + bh * n_q + rows, r_ok, not MASK)


@triton.jit
def key_major_step(
    k, v, w, k_ok, q, do, lse2, delta, r_ok, dk, dv, qk_scale, HAS_LOGW: tl.constexpr, MASK: tl.constexpr, PREC
):
    """One step of a key-major backward, keys in M: dK, dV of the program's key rows ``k``, ``v`` (base-2 log weights
    ``w``) over one step of query rows, and this step's dS^T ([keys, query rows], fp32). ``MASK``: zero the
    probabilities outside ``k_ok`` x ``r_ok``."""
    st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
    if HAS_LOGW:
        st += w[:, None]
    pt = tl.math.exp2(st - lse2[None, :])
    if MASK:
        pt = tl.where(k_ok[:, None] & r_ok[None, :], pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    return dk, dv, dst


@triton.jit
def _pooled_pyramid_grad(ADD, kblk, n_blocks, dims, FACTOR: tl.constexpr, LEVELS: tl.constexpr):
    """The gradient of the pooled token above key blocks ``kblk`` (``[rows, 1]`` block ids), pushed down a pyramid of
    ``LEVELS`` levels stored at ``ADD`` finest first (level l's ``n_blocks / FACTOR^(l-1)`` rows of ``len(dims)``
    after the levels before it): ``G^(LEVELS) = g^(LEVELS)``, ``G^(l) = g^(l) + G^(l+1)[parent] / FACTOR``, in fp32
    and in that order (as LLSA's PyTorch form summed it: the same bits). One level: the rows ``kblk`` as they are."""
    width = dims.shape[0]
    ok = kblk < n_blocks
    start, div = 0, 1
    for _ in tl.static_range(LEVELS - 1):  # where the coarsest level starts, and how many key blocks a row pools
        start += n_blocks // div
        div *= FACTOR
    g = tl.load(ADD + (start + kblk // div) * width + dims[None, :], mask=ok, other=0.0)
    for _ in tl.static_range(LEVELS - 1):  # then each finer level, down to the key blocks' own
        div //= FACTOR
        start -= n_blocks // div
        g = tl.load(ADD + (start + kblk // div) * width + dims[None, :], mask=ok, other=0.0) + g / FACTOR
    return g


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    OFFSETS,
    ROWS,
    LOGW,
    ADD_K,
    ADD_V,
    Q_DESC,
    DO_DESC,
    DS,
    DS_LIST,
    stride_qb,
    stride_qn,
    stride_kb,
    stride_kn,
    stride_db,
    stride_dh,
    stride_dn,
    do_heads,
    stride_ob,
    stride_rb,
    stride_sb,
    stride_st,
    ds_width,
    n_q,
    n_k,
    blk_lo,
    csc_lo,
    csc_step,
    out_row0,
    out_rows,
    add_rows,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    QUERY_BLOCK: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    PER_ITER: tl.constexpr,
    N_SPLIT: tl.constexpr,
    HAS_LOGW: tl.constexpr,
    HAS_ADD: tl.constexpr,
    ADD_LEVELS: tl.constexpr,
    PREC: tl.constexpr,
    EVEN_Q: tl.constexpr,
    N_SUB: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    DESC_ROWS: tl.constexpr,
    DS_SLOTS: tl.constexpr,
):
    # program: GROUP consecutive key blocks starting at blk_lo + GROUP * pid0 (they must share one CSC list)
    # DS_SLOTS > 0 (the power of two >= ds_width): dS is kept for ds_dq (one-warp programs of one key block, whose
    # steps are one query block each); DS_LIST = the query blocks' lists of ds_width slots, where the kernel finds
    # the slot of each (query block, key block) pair
    tl.static_assert(DS_SLOTS == 0 or (PER_ITER == 1 and N_SUB == 1 and GROUP == 1 and not TRANSPOSED))
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    KEY_ROWS: tl.constexpr = KEY_BLOCK * GROUP
    QROWS: tl.constexpr = QUERY_BLOCK * PER_ITER // N_SUB  # query rows per step (a tile > 64 rows: N_SUB steps)
    # query rows masked unless whole tiles of an even N (then every row exists; key rows >= Nk are never stored)
    MASK_ROWS: tl.constexpr = PER_ITER > 1 or not EVEN_Q
    first_blk = blk_lo + g * GROUP
    krow = first_blk.to(tl.int64) * KEY_BLOCK + tl.arange(0, KEY_ROWS)
    k_ok = krow < n_k
    dims = tl.arange(0, HEAD_DIM)
    k_offs = bh * stride_kb + krow[:, None] * stride_kn + dims[None, :]
    k = tl.load(K + k_offs, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + k_offs, mask=k_ok[:, None], other=0.0)
    w = tl.zeros([KEY_ROWS], tl.float32)
    if HAS_LOGW:
        w = tl.load(LOGW + krow // KEY_BLOCK, mask=k_ok, other=0.0) * LOG2E
    csc_idx = csc_lo + g * csc_step  # = first_blk for a per-block CSC; csc_step 0: one list shared by all
    start = tl.load(OFFSETS + bh * stride_ob + csc_idx)
    end = tl.load(OFFSETS + bh * stride_ob + csc_idx + 1)
    chunk = tl.cdiv(end - start, N_SPLIT)
    s0 = start + split * chunk
    s1 = tl.minimum(s0 + chunk, end)
    dk = tl.zeros([KEY_ROWS, HEAD_DIM], tl.float32)
    dv = tl.zeros([KEY_ROWS, HEAD_DIM], tl.float32)
    dkt = tl.zeros([HEAD_DIM, KEY_ROWS], tl.float32)  # dk, dv transposed, for warpgroup groups of < 64 keys
    dvt = tl.zeros([HEAD_DIM, KEY_ROWS], tl.float32)
    roff = tl.arange(0, QROWS)
    slot = roff // QUERY_BLOCK
    rows_base = ROWS + bh * stride_rb
    do_base = DO + head_offset(bh, do_heads, stride_db, stride_dh)
    if PER_ITER == 1:  # query tiles of >= 64 rows: scalar tile ids, each read a step ahead (as the forward's list)
        nxt = first_scalar_id(rows_base + s0, s1 - s0, 0)
    # DESC_ROWS = QROWS: Q_DESC / DO_DESC are descriptors of q as [BH * n_q, d] and dO as [BH / do_heads * n_q,
    # do_heads * d] (tma_descriptors), and steps of whole tiles take q and dO by TMA
    QUERY_TMA: tl.constexpr = PER_ITER == 1 and DESC_ROWS == QROWS and not MASK_ROWS
    do_col = ((bh % do_heads) * HEAD_DIM).to(tl.int32)
    for j in range(s0 * N_SUB, s1 * N_SUB, PER_ITER):
        if PER_ITER == 1:  # contiguous rows, steps of 64
            t, nxt = scalar_step_id(0, rows_base, nxt, j, s1, N_SUB, 0)
            row0 = t.to(tl.int64) * QUERY_BLOCK + (j % N_SUB) * QROWS
            rows = row0 + roff
        else:
            e_ok = (j + slot) < s1
            t = tl.load(rows_base + j + slot, mask=e_ok, other=0)
            rows = t.to(tl.int64) * QUERY_BLOCK + (roff % QUERY_BLOCK)
        r_ok = rows < n_q
        if PER_ITER > 1:
            r_ok = r_ok & e_ok
        if QUERY_TMA:
            q = Q_DESC.load([(bh * n_q + row0).to(tl.int32), 0])
            do = DO_DESC.load([((bh // do_heads) * n_q + row0).to(tl.int32), do_col])
            lse2, delta = query_stats(LSE, DELTA, bh, rows, r_ok, n_q, False)
        else:
            q, do, lse2, delta = query_rows(
                Q, do_base, LSE, DELTA, bh, rows, r_ok, dims, stride_qb, stride_qn, stride_dn, n_q, MASK_ROWS
            )
        if TRANSPOSED:  # keys in N: see the note above _dq_kernel
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            if HAS_LOGW:
                s += w[None, :]
            p = tl.math.exp2(s - lse2[:, None])
            if MASK_ROWS:
                p = tl.where(r_ok[:, None] & k_ok[None, :], p, 0.0)
            dvt += tl.dot(tl.trans(do), p.to(do.dtype), input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dkt += tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=PREC)
        else:
            dk, dv, dst = key_major_step(
                k, v, w, k_ok, q, do, lse2, delta, r_ok, dk, dv, qk_scale, HAS_LOGW, MASK_ROWS, PREC
            )
            if DS_SLOTS > 0:  # keep dS for the dq (ds_dq): at the slot of query block t's list that names this block
                slots = tl.arange(0, DS_SLOTS)
                listed = tl.load(DS_LIST + bh * stride_sb + t * stride_st + slots, mask=slots < ds_width, other=-1)
                at = tl.sum(tl.where(listed == first_blk, slots, 0))
                ds_tile = DS + ((bh * tl.cdiv(n_q, QUERY_BLOCK) + t) * ds_width + at) * (KEY_BLOCK * QUERY_BLOCK)
                # [keys, query rows] as computed; rows past n_q hold zeros (their probabilities are masked)
                ds_offs = tl.arange(0, KEY_ROWS)[:, None] * QUERY_BLOCK + roff[None, :]
                tl.store(ds_tile + ds_offs, dst.to(DS.dtype.element_ty))
    if TRANSPOSED:
        dk = tl.trans(dkt)
        dv = tl.trans(dvt)
    dk = dk * sm_scale
    if HAS_ADD:  # mean-pool adjoint: + (gradient of the pooled token that contains this key) / (its block's real keys)
        # the program's keys are one block (GROUP 1): one row per level, added to every key (a [keys, d] tile of
        # equal rows took more registers than the rest of the program)
        tl.static_assert(GROUP == 1)
        kblk = tl.zeros([1, 1], tl.int32) + first_blk
        count = tl.maximum(tl.minimum(n_k - kblk * KEY_BLOCK, KEY_BLOCK), 1).to(tl.float32)
        base = bh * add_rows * HEAD_DIM
        n_blocks = tl.cdiv(n_k, KEY_BLOCK)
        dk += _pooled_pyramid_grad(ADD_K + base, kblk, n_blocks, dims, KEY_BLOCK, ADD_LEVELS) / count
        dv += _pooled_pyramid_grad(ADD_V + base, kblk, n_blocks, dims, KEY_BLOCK, ADD_LEVELS) / count
    # target [N_SPLIT, BH, out_rows, d]: rows [out_row0, out_row0 + out_rows) of dk/dv of this split
    out = ((split * tl.num_programs(1) + bh) * out_rows + (krow[:, None] - out_row0)) * HEAD_DIM + dims[None, :]
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _ds_dq_kernel(
    K,
    DS,
    LIST,
    DQ_IN,
    DQ,
    stride_kb,
    stride_kn,
    stride_lb,
    stride_lt,
    n_q,
    n_k,
    list_len,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    QUERY_BLOCK: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PREC: tl.constexpr,
):
    # dq of one query block from the dS that the key-major dk/dv kept (``DS_SLOTS``): dq = scale * sum over its list
    # of dS K, one listed block per step. Nothing is recomputed: no q, dO, V, LSE or Delta, no exponentials.
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tile.to(tl.int64) * QUERY_BLOCK + tl.arange(0, QUERY_BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, KEY_BLOCK)
    list_base = LIST + bh * stride_lb + tile * stride_lt
    ds_base = DS + (bh * tl.num_programs(0) + tile) * list_len * (KEY_BLOCK * QUERY_BLOCK)
    ds_offs = keys[:, None] * QUERY_BLOCK + tl.arange(0, QUERY_BLOCK)[None, :]
    dq = tl.zeros([QUERY_BLOCK, HEAD_DIM], tl.float32)
    for j in range(0, list_len):
        blk = tl.load(list_base + j)
        krow = blk.to(tl.int64) * KEY_BLOCK + keys
        # an empty slot (-1) has no dS (never written) and keys past n_k none that counts: both read as zeros
        k_ok = (blk >= 0) & (krow < n_k)
        k = tl.load(K + bh * stride_kb + krow[:, None] * stride_kn + dims[None, :], mask=k_ok[:, None], other=0.0)
        dst = tl.load(ds_base + j * (KEY_BLOCK * QUERY_BLOCK) + ds_offs, mask=k_ok[:, None], other=0.0)
        dq += tl.dot(tl.trans(dst), k, input_precision=PREC)
    dq = dq * sm_scale
    row_ok = rows < n_q
    dq_offs = bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + dims[None, :]
    if ACCUMULATE:  # an earlier pass's fp32 dq (other keys of the same queries)
        dq += tl.load(DQ_IN + dq_offs, mask=row_ok[:, None], other=0.0)
    tl.store(DQ + dq_offs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _grouped_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    LIST,
    LOGW,
    PK,
    PV,
    stride_qb,
    stride_qn,
    stride_kb,
    stride_kn,
    stride_db,
    stride_dh,
    stride_dn,
    do_heads,
    stride_lb,
    stride_lg,
    n_q,
    n_k,
    list_len,
    group_rows,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_LOGW: tl.constexpr,
    EVEN_Q: tl.constexpr,
    PREC: tl.constexpr,
):
    # program: list slots [SLOTS * pid0, + SLOTS) of query group pid1 (rows [pid1 * group_rows, + group_rows), which
    # all share that list): the partial dK, dV of those slots' key rows over the group's queries
    chunk = tl.program_id(0)
    grp = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    KEY_ROWS: tl.constexpr = KEY_BLOCK * SLOTS
    QROWS: tl.constexpr = 64
    r = tl.arange(0, KEY_ROWS)
    slot = chunk * SLOTS + r // KEY_BLOCK
    s_ok = slot < list_len
    blk = tl.load(LIST + bh * stride_lb + grp.to(tl.int64) * stride_lg + slot, mask=s_ok, other=-1)
    krow = tl.maximum(blk, 0).to(tl.int64) * KEY_BLOCK + r % KEY_BLOCK
    k_ok = (blk >= 0) & (krow < n_k)  # rows of an empty slot are computed from zeros and never summed
    dims = tl.arange(0, HEAD_DIM)
    k_offs = bh * stride_kb + krow[:, None] * stride_kn + dims[None, :]
    k = tl.load(K + k_offs, mask=k_ok[:, None], other=0.0)
    v = tl.load(V + k_offs, mask=k_ok[:, None], other=0.0)
    w = tl.zeros([KEY_ROWS], tl.float32)
    if HAS_LOGW:
        w = tl.load(LOGW + tl.maximum(blk, 0), mask=k_ok, other=0.0) * LOG2E
    dk = tl.zeros([KEY_ROWS, HEAD_DIM], tl.float32)
    dv = tl.zeros([KEY_ROWS, HEAD_DIM], tl.float32)
    do_base = DO + head_offset(bh, do_heads, stride_db, stride_dh)
    row0 = grp.to(tl.int64) * group_rows
    roff = tl.arange(0, QROWS)
    for r0 in range(row0, tl.minimum(row0 + group_rows, n_q), QROWS):
        rows = r0 + roff
        r_ok = rows < n_q
        q, do, lse2, delta = query_rows(
            Q, do_base, LSE, DELTA, bh, rows, r_ok, dims, stride_qb, stride_qn, stride_dn, n_q, not EVEN_Q
        )
        dk, dv, _ = key_major_step(
            k, v, w, k_ok, q, do, lse2, delta, r_ok, dk, dv, qk_scale, HAS_LOGW, not EVEN_Q, PREC
        )
    dk = dk * sm_scale
    # partials [BH, groups, list_len * KEY_BLOCK, d]: row slot * KEY_BLOCK + t holds key t of that slot's block
    out = (bh * tl.num_programs(1) + grp) * list_len * KEY_BLOCK + slot[:, None] * KEY_BLOCK + (r % KEY_BLOCK)[:, None]
    out = out * HEAD_DIM + dims[None, :]
    tl.store(PK + out, dk, mask=s_ok[:, None])
    tl.store(PV + out, dv, mask=s_ok[:, None])


# Warps of a slot-sum program (``_sum_slots_kernel``: a key block's listing slots' partial tiles added in a fixed
# order). One warp held 128 registers at d = 64 (16 programs per SM: a wave and a half at LLSA 256²); 4 warps hold
# fewer per thread and keep more loads in flight: on the H200 at LLSA 256² 0.084 -> 0.067 ms, 512² L = 3 0.140 ->
# 0.120, the same sums (docs/kernel_notes.md v57).
SUM_SLOTS_WARPS = 4


@triton.jit
def _sum_slots_kernel(
    PK,
    PV,
    OFFSETS,
    ENTRIES,
    DK,
    DV,
    stride_ob,
    stride_eb,
    stride_gb,
    stride_gn,
    n_entries,
    blk_lo,
    n_k,
    HEAD_DIM: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
):
    # program: key block blk_lo + pid0; adds the partials of the slots that list it (CSC with slot entries,
    # ascending: a fixed order) and writes its rows of DK, DV
    blk = blk_lo + tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t = tl.arange(0, KEY_BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    tile = t[:, None] * HEAD_DIM + dims[None, :]
    start = tl.load(OFFSETS + bh * stride_ob + blk)
    end = tl.load(OFFSETS + bh * stride_ob + blk + 1)
    dk = tl.zeros([KEY_BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([KEY_BLOCK, HEAD_DIM], tl.float32)
    for e in range(start, end):
        entry = tl.load(ENTRIES + bh * stride_eb + e).to(tl.int64)
        base = (bh * n_entries + entry) * KEY_BLOCK * HEAD_DIM
        dk += tl.load(PK + base + tile)
        dv += tl.load(PV + base + tile)
    krow = blk.to(tl.int64) * KEY_BLOCK + t
    out = bh * stride_gb + krow[:, None] * stride_gn + dims[None, :]
    tl.store(DK + out, dk, mask=(krow < n_k)[:, None])
    tl.store(DV + out, dv, mask=(krow < n_k)[:, None])


# The three kernels are autotuned on the GPU (common.AUTOTUNE); otherwise launched with 2 stages and
# ``program_warps`` warps. 4 stages deepen only a walk whose addresses do not come from a load inside the loop: a
# dense tail or a list in registers (listed_ids).
_WARPGROUP_PROGRAMS = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4), (2, 2))  # (warps, stages) to try
_SMALL_PROGRAMS = ((1, 2), (1, 3), (1, 4), (2, 2), (2, 3))  # at most program_warps(rows) warps
# ptxas's register budget (``maxnreg``) of the 64-row programs on 4 warps at head dim <= 64 with 16-bit inputs. Left
# alone, ptxas gives the forward 150 registers, the dq 142 and the key-major dk/dv 183 (Triton 3.6), so 3, 3 and 2
# programs share an SM. Capped, the forward and dq hold 128 without spills (4 per SM) and the dk/dv 168 with 16 B
# spilled (3 per SM): on the H200 LLSA's pooled forward 1.11x, pooled dq 1.08x, coarsest dk/dv 1.12x at 256² (1.48x
# at 512²) and VSA's 64-key dk/dv 1.21x faster (docs/kernel_notes.md v28). The dk/dv by query group (210 registers)
# takes the dk/dv's cap too: at 168 it spills 72 B, and still measured 1.11x faster at LLSA 256² and 1.12x at 512²
# (v29). The one-warp dk/dv of 16 keys that keeps dS for the dq holds 165 registers (12 programs per SM); capped at
# 128 (16 per SM, as the plain one; 8 B spilled) it ran 1.09x faster on the H100 at LLSA 256², the whole forward +
# backward 1.014x (v55 (c)). The one-warp forward of 16 rows holds 96 without a cap (21 programs per SM), 80 capped
# and still without spills (25 per SM; 72 spills): its walk gathers every step's keys, so more programs in flight
# hide more of that latency (v56). The 64-row forward (LLSA's pooled pass, 124 registers at the cap of 128) holds 96
# without spills since v30's leaner walk: 5 programs per SM instead of 4 (41 KB of shared memory each), its launch
# 0.273 -> 0.259 ms at LLSA 256² on an H100 (at v29, with 32 B spilled, it was neutral; v57). The autotuner also
# times the capped configuration against the others.
_REGISTER_CAPS = {
    ("forward", 16): 80,
    ("forward", 64): 96,
    ("dq", 64): 128,
    ("dkdv", 64): 168,
    ("dkdv", 16): 128,
}  # (kind, rows) -> maxnreg


def register_cap(kind: str, rows: int, head_dim: int, dtype: torch.dtype) -> int | None:
    """``maxnreg`` of a ``kind`` ("forward", "dq" or "dkdv": key-major or by query group) program of ``rows`` rows
    (see ``_REGISTER_CAPS``)."""
    if head_dim > 64 or dtype not in (torch.float16, torch.bfloat16):
        return None
    return _REGISTER_CAPS.get((kind, rows))


def program_warps(rows: int, backward: bool, head_dim: int) -> int:
    """Warps of a program of ``rows`` query or key rows (see the note above _dq_kernel): one for 16 rows, one per 16
    rows for the forward of 32 or 48 (a power of two), a warpgroup for the transposed backward of those and for any
    program of < 64 rows with a head dim above 64, 4 for tiles of 64 rows (wgmma) and 8 for tiles of 128 (whose fp32
    logit and accumulator tiles would not fit 4 warps)."""
    if rows >= 64:
        return 8 if rows >= 128 else 4
    if head_dim > 64:
        return 4
    if rows <= 16:
        return 1
    return 4 if backward else 1 << ((rows // 16).bit_length() - 1)


def transposed_backward(rows: int, head_dim: int) -> bool:
    """Whether the dq of ``rows``-row query blocks or the dk/dv of ``rows``-key groups computes its products
    transposed (``TRANSPOSED``, the note above _dq_kernel): a program of < 64 rows that ``program_warps`` gives a
    warpgroup."""
    return rows < 64 and program_warps(rows, True, head_dim) >= 4


# The autotuner's configurations: the warps and stages of _WARPGROUP_PROGRAMS and _SMALL_PROGRAMS, and each register
# cap on its program's warps (``_configs_for`` prunes them to the launch's program).
_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in dict.fromkeys(_WARPGROUP_PROGRAMS + _SMALL_PROGRAMS)
] + [
    triton.Config({}, num_warps=warps, num_stages=2, maxnreg=cap)
    for warps, cap in sorted(
        {(program_warps(rows, kind != "forward", 64), cap) for (kind, rows), cap in _REGISTER_CAPS.items()}
    )
]


# Each autotuned kernel's program: the kind that ``register_cap`` knows, and the query or key rows that size it, from
# the launch arguments.
PROGRAMS = {
    _fwd_kernel: ("forward", lambda meta: meta["BLOCK_M"]),
    _dq_kernel: ("dq", lambda meta: meta["BLOCK_M"]),
    _dkdv_kernel: ("dkdv", lambda meta: meta["KEY_BLOCK"] * meta["GROUP"]),
    _grouped_dkdv_kernel: ("dkdv", lambda meta: meta["KEY_BLOCK"] * meta["SLOTS"]),
    _ds_dq_kernel: ("dq", lambda meta: meta["QUERY_BLOCK"]),
}


def program_shape(kind: str, rows: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int | None]:
    """(``program_warps``, ``register_cap``) of a ``kind`` program of ``rows`` rows with ``dtype`` inputs."""
    return program_warps(rows, kind != "forward", head_dim), register_cap(kind, rows, head_dim, dtype)


def launched_program(kernel, meta: dict, dtype: torch.dtype) -> tuple[int, int | None]:
    """``program_shape`` of a launch of ``kernel`` (a key of ``PROGRAMS``) with the arguments ``meta``."""
    kind, rows_of = PROGRAMS[kernel]
    return program_shape(kind, rows_of(meta), meta["HEAD_DIM"], dtype)


def _configs_for(kernel):
    """The autotuner's pruning (Triton's ``early_config_prune``) of ``kernel``: the configurations worth timing for
    its program (``launched_program``), small ones with at most ``program_warps`` warps, and the register-capped one
    where ``register_cap`` gives the program a cap."""

    def prune(configs, named_args, **kwargs):
        meta = {**named_args, **kwargs}
        warps, cap = launched_program(kernel, meta, meta["Q" if "Q" in meta else "K"].dtype)
        small = warps < 4
        allowed = _SMALL_PROGRAMS if small else _WARPGROUP_PROGRAMS
        return [
            c
            for c in configs
            if (c.maxnreg is None and (c.num_warps, c.num_stages) in allowed and (not small or c.num_warps <= warps))
            or (c.maxnreg is not None and c.maxnreg == cap and c.num_warps == warps)
        ]

    return prune


_TUNED_KEYS = ["HEAD_DIM", "PER_ITER", "PREC"]


_fwd = autotuned(
    _fwd_kernel,
    _TUNED_KEYS
    + ["BLOCK_M", "KEY_BLOCK", "HAS_INIT", "HAS_LOGW", "EVEN_K", "HAS_TAIL", "LIST_SLOTS", "LIST_RUNS", "FULL_LIST"]
    + ["DESC_ROWS"],
    _CONFIGS,
    prune=_configs_for(_fwd_kernel),
)
_dq = autotuned(
    _dq_kernel,
    _TUNED_KEYS
    + ["BLOCK_M", "KEY_BLOCK", "ACCUMULATE", "HAS_ADD", "COMPUTE_DELTA", "EVEN_K", "HAS_TAIL", "LIST_SLOTS"]
    + ["LIST_RUNS", "FULL_LIST", "DESC_ROWS"],
    _CONFIGS,
    prune=_configs_for(_dq_kernel),
)
_dkdv = autotuned(
    _dkdv_kernel,
    _TUNED_KEYS + ["QUERY_BLOCK", "KEY_BLOCK", "GROUP", "N_SPLIT", "HAS_ADD", "EVEN_Q", "DESC_ROWS", "DS_SLOTS"],
    _CONFIGS,
    prune=_configs_for(_dkdv_kernel),
)
_ds_dq = autotuned(
    _ds_dq_kernel,
    ["HEAD_DIM", "QUERY_BLOCK", "KEY_BLOCK", "ACCUMULATE", "PREC"],
    _CONFIGS,
    prune=_configs_for(_ds_dq_kernel),
)
_grouped_dkdv = autotuned(
    _grouped_dkdv_kernel,
    ["HEAD_DIM", "KEY_BLOCK", "SLOTS", "HAS_LOGW", "EVEN_Q", "PREC"],
    _CONFIGS,
    prune=_configs_for(_grouped_dkdv_kernel),
)


def _launch(kind: str, rows: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Launch options of a ``kind`` program of ``rows`` query or key rows with ``dtype`` inputs (none when
    autotuned): its ``program_shape``, as the autotuner's pruning gives it (``_configs_for``), and 2 stages, 3 for
    the 128-row forward and dq programs (their contiguous walks load by TMA with ids read a step ahead, note below)."""
    if AUTOTUNE:
        return {}
    warps, cap = program_shape(kind, rows, head_dim, dtype)
    stages = 3 if rows >= 128 and kind in ("forward", "dq") else 2
    return {"num_warps": warps, "num_stages": stages} | ({"maxnreg": cap} if cap else {})


# The forward's 128-row programs (block_sparse_attention over blocks of 128, the dense flash_attention) walk with
# their K and V loaded by TMA and more stages (tma_descriptors): over blocks of >= 128 keys in steps of 128 keys on
# 4 warps (a [128, 128] fp32 logit tile in 128 registers per thread, no spills at head dim 64), else in steps of 64
# on 8 warps; 3 stages either way. On the H200 (blocks of 128, 2 x 6 x 65,536 x 64 bf16): K = 64 blocks 3.92 ms
# against 4.33 in steps of 64 on 8 warps and 2 stages, Flex 4.20; K = 16 1.05 ms (1.07, Flex 1.11); the dense walk
# 30.9 ms at 3 stages against 32.2 at 2 (docs/kernel_notes.md v36). The dq's 128-row programs (steps of 64 keys on
# 8 warps) load the same way at 3 stages: forward + backward 1.04x (K = 16), 1.06x (K = 64), dense 1.02x (v37).
def forward_step_keys(rows: int, key_block: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys per step of a forward program of ``rows`` query rows walking listed blocks of ``key_block`` keys one
    at a time (``PER_ITER = 1``): 128 for 128-row programs over blocks of >= 128 keys with 16-bit inputs and a head
    dim of <= 64, else at most 64 (``N_SUB = key_block // this``)."""
    wide = rows >= 128 and key_block >= 128 and head_dim <= 64 and dtype in (torch.float16, torch.bfloat16)
    return 128 if wide else min(key_block, 64)


def forward_warps(rows: int, key_block: int, head_dim: int, dtype: torch.dtype) -> int:
    """Warps of a forward program without autotuning: ``program_warps``, but 4 for steps of 128 keys."""
    wide = forward_step_keys(rows, key_block, head_dim, dtype) == 128
    return 4 if wide else program_warps(rows, False, head_dim)


def _forward_launch(rows: int, key_block: int, head_dim: int, dtype: torch.dtype) -> dict:
    """``_launch`` of a forward program with its ``forward_warps``."""
    if AUTOTUNE:
        return {}
    return _launch("forward", rows, head_dim, dtype) | {"num_warps": forward_warps(rows, key_block, head_dim, dtype)}


# ---------------------------------------------------------------------------------------------------------- launchers
def flatten_grad(x: torch.Tensor) -> torch.Tensor:
    """``flatten_heads(x.contiguous())`` for a backward's incoming gradient that several kernel ops read, through
    ``as_strided`` instead of a reshape. Under torch.compile such a gradient is an unrealized copy (Dynamo makes every
    autograd.Function's incoming gradients contiguous; a model's transposed attention output makes them need one),
    and Inductor gave each op that needs exact strides its own copy of a reshaped view of it: five of LLSA's dO,
    314 us of each 256^2 layer's backward (docs/kernel_notes.md v25). Inductor lowers ``as_strided`` by realizing its
    input, so the ops share one buffer."""
    x = x.contiguous()
    n, d = x.shape[-2:]
    return x.as_strided((x.numel() // max(1, n * d), n, d), (n * d, d, 1))  # at x's own storage offset


def row_layout(x: torch.Tensor) -> tuple[int, int, int, int]:
    """``(batch stride, head stride, row stride, heads)`` of a per-row tensor that the kernels read or write as
    [BH, n, d] (``head_offset``): a plain [BH, n, d] tensor (heads 1), or a tokens-major [b, n, heads, d] one with any
    row stride: the layout of an attention output that a model's projection reads without a transpose copy, of its
    gradient, and of a v that is a view of the fused qkv projection's output (the forward reads it uncopied)."""
    if x.dim() == 3:
        return x.stride(0), 0, x.stride(1), 1
    return x.stride(0), x.stride(2), x.stride(1), x.shape[2]


# The forward's and the dq's contiguous walks (scalar-id blocks of >= 64 keys, the dense tail) take K and V by TMA,
# Hopper's tensor memory accelerator, instead of pointer loads, and the key-major dk/dv its query tiles' q and dO: the
# copies need no address registers and Triton buffers them as deep as num_stages says. On the H200 (2 x 6 x 65,536 x
# 64 bf16) blocks of 128 keys ran 7-16% faster in the forward's launch, the dense walk 2.5% (docs/kernel_notes.md
# v36); the dk/dv by TMA took the dense backward 1.04x faster, blocks of 64 1.05x (v37). Needs compute capability >= 9
# (or the interpreter); PIXDIT_KERNELS_TMA=0 keeps pointer loads everywhere.
TMA_LOADS = os.environ.get("PIXDIT_KERNELS_TMA", "1") not in ("", "0")
# Narrower steps (the one-warp programs over 16-key blocks) keep pointer loads (cp.async): by TMA, 16-row steps made
# LLSA's fine forward 1.09x slower and its key-major dk/dv 1.6x (spills at its register cap), VSA's forward 1.6x
# (H100, docs/kernel_notes.md v56).
TMA_MIN_ROWS = 64


@functools.cache
def _tma_capable(device_type: str, index: int | None) -> bool:
    if device_type != "cuda":
        return INTERPRET
    return torch.cuda.get_device_capability(index)[0] >= 9


def _tma_rows(x: torch.Tensor, heads: int, n: int) -> int | None:
    """The row stride of ``x`` seen as a 2-D ``[x.numel() / (heads * d) rows, heads * d]`` matrix whose rows are
    key rows: a ``[BH, n, d]`` tensor (heads 1) or a tokens-major ``[b, n, heads, d]`` one whose heads sit side by
    side; None when x is not such a matrix or breaks TMA's rules (16-byte aligned base and row stride, int32 rows)."""
    d = x.shape[-1]
    b_stride, h_stride, n_stride, _ = row_layout(x)
    rows = x.numel() // (heads * d)
    ok = (
        x.stride(-1) == 1
        and (heads == 1 or h_stride == d)
        and b_stride == n * n_stride
        and (n_stride * x.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0
        and rows < 2**31
    )
    return n_stride if ok else None


def tma_walk_rows(per_iter: int, list_len: int, list_step: int, tail_hi: int) -> int:
    """Rows per step of a query-major launch's contiguous walk that may load by TMA (``tma_descriptors`` decides):
    the scalar-id list walk (``per_iter == 1``) in steps of ``list_step`` rows, else the dense tail in steps of
    ``TAIL_STEP``, else none (0)."""
    if per_iter == 1 and list_len > 0:
        return list_step
    return TAIL_STEP.value if tail_hi > 0 else 0


def tma_step_rows(rows: int) -> int:
    """``rows`` where a contiguous walk in steps of ``rows`` rows may load by TMA (TMA on and steps of at least
    ``TMA_MIN_ROWS``), else 0: the rule ``tma_descriptors`` applies before it looks at the device and the layouts."""
    return rows if TMA_LOADS and rows >= TMA_MIN_ROWS else 0


def tma_descriptors(k: torch.Tensor, v: torch.Tensor, rows: int):
    """``(K_DESC, V_DESC, DESC_ROWS)`` of a launch whose contiguous walk steps over ``rows`` key rows (the key-major
    dk/dv passes q and dO for k and v, and steps over query rows): 2-D TMA descriptors of ``rows``-row tiles, k as
    ``[BH * n_k, d]`` and v as ``[BH / heads * n_k, heads * d]`` (``row_layout``), or ``(k, v, 0)`` (pointer loads)
    where TMA is off, unsupported or the layouts do not allow it."""
    n, d = k.shape[1], k.shape[2]
    if not tma_step_rows(rows) or not _tma_capable(k.device.type, k.device.index):
        return k, v, 0
    heads = row_layout(v)[3]
    k_stride, v_stride = _tma_rows(k, 1, n), _tma_rows(v, heads, n)
    if k_stride is None or v_stride is None:
        return k, v, 0
    k_desc = TensorDescriptor(k, [k.numel() // d, d], [k_stride, 1], [rows, d])
    v_desc = TensorDescriptor(v, [v.numel() // (heads * d), heads * d], [v_stride, 1], [rows, d])
    return k_desc, v_desc, rows


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """[b, h, n, d] -> [b*h, n, d] with unit stride on d (a view when possible)."""
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def flatten_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v flattened with one shared layout (the kernels use one set of strides for both)."""
    kf, vf = flatten_heads(k), flatten_heads(v)
    if kf.stride() != vf.stride():
        kf, vf = kf.contiguous(), vf.contiguous()
    return kf, vf


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the kernels' dots: exact fp32 for fp32 inputs, tf32 for the fp32 operands of half
    inputs (their own dots run on the tensor cores whatever this says)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _bstride(x: torch.Tensor) -> int:
    """Stride of the batch*head dim; 0 when one table is shared by all heads ([1, ...])."""
    return x.stride(0) if x.shape[0] > 1 else 0


def blocks_per_step(block: int) -> int:
    """Blocks gathered per step: small blocks are gathered until a step has 64 rows."""
    return max(1, 64 // block)


def walk_blocks_per_step(program_rows: int, walked_block: int, head_dim: int) -> int:
    """Listed blocks of ``walked_block`` rows that a program of ``program_rows`` rows walks per step: the key blocks
    of a query-major pass (forward, dq), the query blocks of the key-major dk/dv. ``blocks_per_step`` (64-row dots),
    except in a one-warp program (16 rows, ``program_warps``), which walks one block per step along the scalar-id
    path and so holds far fewer registers: more programs share an SM (docs/kernel_notes.md; Triton 3.6, blocks of
    16). The fine forward 80 instead of 168 registers, 1.10x (v22); the fine dk/dv 144 instead of 255 with spills,
    1.18x at LLSA 256², 1.04x for VSA; the fine dq 98 instead of 167, 1.05x and 1.06x (v28)."""
    if program_warps(program_rows, True, head_dim) == 1:
        return 1
    return blocks_per_step(walked_block)


# Lists up to this many ids are loaded into registers before the walk (``listed_ids``); longer ones step by step,
# where a register copy would cost more (a masked sum over it per step) than the deeper pipelining saves.
LIST_IN_REGISTERS = 128


def list_slots(list_len: int, per_iter: int, limit: int = LIST_IN_REGISTERS) -> int:
    """``LIST_SLOTS`` of a walk over ``list_len`` ids: the power of two >= it (and >= ``per_iter``) when the list is
    loaded before the walk, 0 when it is read step by step (empty or longer than ``limit``). Power-of-two buckets:
    one compilation serves every length up to the bucket."""
    if list_len == 0 or list_len > limit:
        return 0
    return max(per_iter, next_power_of_2(list_len))


def forward_ids_in_registers(rows: int, key_block: int, head_dim: int, dtype: torch.dtype) -> int:
    """The longest list a forward program of ``rows`` query rows keeps in registers (``list_slots``' limit). Each step
    takes its id from them by a masked sum over the whole list, which on an 8-warp program (``forward_warps``) is a
    reduction across the warps: with pointer loads, at 64 ids that program ran 1.46x slower than one loading each id a
    step ahead (blocks of 128, 2 stages), at 8-32 ids 3-5% faster (docs/kernel_notes.md v36)."""
    narrow = forward_warps(rows, key_block, head_dim, dtype) < 8
    return LIST_IN_REGISTERS if narrow else min(32, LIST_IN_REGISTERS)


def _n_sub(block: int, step: int = 64) -> int:
    """Steps per block of a walk in steps of at most ``step`` rows (the backward's: 64; the forward's:
    ``forward_step_keys``): a larger block is walked in tiles of ``step``."""
    return max(1, block // step)


def _tail_tuple(dense_tail) -> tuple[int, int, float]:
    """``dense_tail = (row_lo, row_hi, log_weight)`` or None as the ops' three arguments (no tail: ``row_hi = 0``)."""
    if dense_tail is None:
        return 0, 0, 0.0
    lo, hi, log_weight = dense_tail
    return int(lo), int(hi), float(log_weight)


def _tail_args(tail_lo: int, tail_hi: int, tail_log_weight: float, n_k: int) -> dict:
    """Kernel arguments of a dense tail (``_tail_tuple``): key rows every query attends to after its listed blocks,
    with one log weight, walked in contiguous steps of TAIL_STEP rows."""
    if tail_hi == 0:
        return {"tail_lo": 0, "tail_hi": 0, "tail_bias": 0.0, "HAS_TAIL": False, "EVEN_TAIL": True}
    assert 0 <= tail_lo < tail_hi <= n_k, (tail_lo, tail_hi, n_k)
    return {
        "tail_lo": tail_lo,
        "tail_hi": tail_hi,
        "tail_bias": tail_log_weight * LOG2E.value,
        "HAS_TAIL": True,
        "EVEN_TAIL": (tail_hi - tail_lo) % TAIL_STEP.value == 0,
    }


# Runs of list columns with one weight each (list_weight): LLSA's candidate levels at L <= 4. The kernels take exactly
# this many (list_bias, run_bias1, run_bias2 and their ends): not a knob; it changes with their arguments only.
MAX_LIST_RUNS = 3


def list_runs(list_log_weight) -> tuple[list[float] | None, list[int] | None]:
    """``list_log_weight`` as the ops' two arguments, (weights, columns): one weight for every listed block (a
    number: ``([w], None)``), or ``(columns, log weight)`` runs of list columns in order (LLSA's candidate levels)."""
    if list_log_weight is None:
        return None, None
    if isinstance(list_log_weight, (int, float)):
        return [float(list_log_weight)], None
    runs = [(int(c), float(w)) for c, w in list_log_weight]
    if not 1 <= len(runs) <= MAX_LIST_RUNS or min(c for c, _ in runs) < 1:
        raise ValueError(
            f"list_log_weight must be a number or 1 to {MAX_LIST_RUNS} (columns >= 1, log weight) runs, got "
            f"{list_log_weight!r}; for more runs pass the weights per block (log_weights)"
        )
    return [w for _, w in runs], [c for c, _ in runs]


def _list_args(log_weights, weights, columns, full_lists, lists, n_k, key_block, per_iter) -> dict:
    """Kernel arguments of the listed blocks' weights: per block (``log_weights``, a load per key), by runs of columns
    (``weights`` / ``columns`` of ``list_runs``: a scalar per step, ``list_weight``), or none; and ``FULL_LIST`` (no
    masks) where the caller promises lists without empty slots and the walk's steps are whole: every one of the
    ``n_k`` key rows' blocks has all its rows, and the list length is a multiple of the ``per_iter`` blocks per step,
    so no step reads past the list. A step has one weight, so runs must end at whole steps."""
    assert log_weights is None or weights is None, "give log_weights or list_log_weight, not both"
    width = lists.shape[2]
    ends = list(itertools.accumulate(columns or [width]))
    if weights is not None and (ends[-1] != width or any(e % per_iter for e in ends[:-1])):
        raise ValueError(
            f"list_log_weight: runs of {columns} columns must cover the list's {width} columns and end at multiples "
            f"of the {per_iter} blocks a step walks (one weight per step); give the weights per block (log_weights)"
        )
    whole_steps = n_k % key_block == 0 and width % per_iter == 0
    w = (weights or []) + [0.0] * MAX_LIST_RUNS
    ends = ends + [width] * MAX_LIST_RUNS
    return {
        "list_bias": w[0],
        "run_end0": ends[0],
        "run_bias1": w[1],
        "run_end1": ends[1],
        "run_bias2": w[2],
        "HAS_LOGW": log_weights is not None,
        "LIST_RUNS": len(weights or []),
        "FULL_LIST": bool(full_lists) and whole_steps,
    }


def bsa_forward(
    q,
    k,
    v,
    lists,
    query_block,
    key_block,
    scale,
    log_weights=None,
    init=None,
    out_dtype=None,
    dense_tail=None,
    out_heads=0,
    list_log_weight=None,
    full_lists=False,
):
    """One query-major pass. q: [BH, Nq, d]; k: [BH, Nk, d]; v: like k, or tokens-major [BH / H, Nk, H, d] with any
    row stride (``row_layout``); lists: int32 [BH or 1, n_tiles, len] (stride 0 on dim 0 allowed); init: optional
    (o [BH, Nq, d] fp32 or q's dtype, lse fp32 [BH, Nq]) to continue; dense_tail: optional (row_lo, row_hi,
    log_weight), key rows every query also attends to (LLSA's coarsest level; the lists must not name them).
    Returns (o, lse); o is [BH, Nq, d], or with ``out_heads = H`` tokens-major [BH / H, Nq, H, d].
    ``list_log_weight``: one log weight of every listed block, or ``(columns, log weight)`` runs of list columns in
    order (at most ``MAX_LIST_RUNS``, each but the last ending at a whole step of ``walk_blocks_per_step`` blocks),
    instead of ``log_weights`` per block (a scalar per step, not a load per key); ``full_lists``: the caller's
    promise that no slot is empty (-1), so that the walk needs no masks when every key block is whole."""
    o_init, lse_init = init if init is not None else (None, None)
    return _bsa_forward_op(
        q,
        k,
        v,
        lists,
        log_weights,
        o_init,
        lse_init,
        query_block,
        key_block,
        scale,
        out_dtype or q.dtype,
        out_heads,
        *_tail_tuple(dense_tail),
        *list_runs(list_log_weight),
        full_lists,
    )


@custom_op("bsa_forward")
def _bsa_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lists: torch.Tensor,
    log_weights: torch.Tensor | None,
    o_init: torch.Tensor | None,
    lse_init: torch.Tensor | None,
    query_block: int,
    key_block: int,
    scale: float,
    out_dtype: torch.dtype,
    out_heads: int,
    tail_lo: int,
    tail_hi: int,
    tail_log_weight: float,
    list_log_weight: list[float] | None,
    list_run_columns: list[int] | None,
    full_lists: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    BH, n_q, d = q.shape
    n_k = k.shape[1]
    n_tiles = cdiv(n_q, query_block)
    assert lists.shape[1] == n_tiles, (lists.shape, n_tiles)
    o = q.new_empty(_out_shape(q, out_heads), dtype=out_dtype)
    lse = torch.empty(BH, n_q, device=q.device, dtype=torch.float32)
    per_iter = walk_blocks_per_step(query_block, key_block, d)
    weights = _list_args(log_weights, list_log_weight, list_run_columns, full_lists, lists, n_k, key_block, per_iter)
    walked = key_block if lists.shape[2] > 0 else TAIL_STEP.value  # a dense walk (no list) steps by TAIL_STEP
    step_keys = forward_step_keys(query_block, walked, d, q.dtype)
    k_desc, v_desc, desc_rows = tma_descriptors(k, v, tma_walk_rows(per_iter, lists.shape[2], step_keys, tail_hi))
    _fwd[(n_tiles, BH)](
        q,
        k,
        v,
        o,
        lse,
        lists,
        log_weights if log_weights is not None else lse,
        o_init if o_init is not None else o,
        lse_init if lse_init is not None else lse,
        k_desc,
        v_desc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *row_layout(v),
        *row_layout(o),
        _bstride(lists),
        lists.stride(1),
        n_q,
        n_k,
        lists.shape[2],
        scale * LOG2E.value,
        **weights,
        HEAD_DIM=d,
        BLOCK_M=query_block,
        KEY_BLOCK=key_block,
        PER_ITER=per_iter,
        HAS_INIT=o_init is not None,
        **_tail_args(tail_lo, tail_hi, tail_log_weight, n_k),
        PREC=dot_precision(q.dtype),
        EVEN_K=n_k % key_block == 0,
        N_SUB=_n_sub(key_block, step_keys),
        LIST_SLOTS=list_slots(lists.shape[2], per_iter, forward_ids_in_registers(query_block, walked, d, q.dtype)),
        DESC_ROWS=desc_rows,
        **_forward_launch(query_block, walked, d, q.dtype),
    )
    return o, lse


@_bsa_forward_op.register_fake
def _(q, k, v, lists, log_weights, o_init, lse_init, query_block, key_block, scale, out_dtype, out_heads, *tail):
    return q.new_empty(_out_shape(q, out_heads), dtype=out_dtype), q.new_empty(q.shape[:2], dtype=torch.float32)


def _out_shape(q: torch.Tensor, out_heads: int) -> tuple[int, ...]:
    """The forward's output shape: q's [BH, Nq, d], or tokens-major [BH / H, Nq, H, d] for ``out_heads = H``."""
    BH, n_q, d = q.shape
    if not out_heads:
        return (BH, n_q, d)
    assert BH % out_heads == 0, (BH, out_heads)
    return (BH // out_heads, n_q, out_heads, d)


def bsa_backward_dq(
    q,
    k,
    v,
    do,
    lse,
    delta,
    lists,
    query_block,
    key_block,
    scale,
    log_weights=None,
    dq=None,
    o=None,
    out_dtype=torch.float32,
    dense_tail=None,
    pooled_add=None,
    list_log_weight=None,
    full_lists=False,
):
    """dq ([BH, Nq, d], ``out_dtype``) of one query-major pass, plus ``dq`` (fp32, an earlier pass) when given.
    ``do``: [BH, Nq, d] or tokens-major [BH / H, Nq, H, d] (``row_layout``). With ``o`` (same layout as ``do``)
    it also computes Δ = rowsum(dO * O) into ``delta`` (fp32 [BH, Nq]).
    ``dense_tail``, ``list_log_weight`` and ``full_lists`` as in ``bsa_forward``. ``pooled_add`` (fp32 [BH,
    ceil(Nq / query_block), d]): adds each query tile's ``g[tile] / (its real rows)`` to its rows (the mean-pool
    adjoint of a pooled copy of q, fused)."""
    return _bsa_backward_dq_op(
        q,
        k,
        v,
        do,
        lse,
        delta,
        lists,
        log_weights,
        dq,
        o,
        pooled_add,
        query_block,
        key_block,
        scale,
        out_dtype,
        *_tail_tuple(dense_tail),
        *list_runs(list_log_weight),
        full_lists,
    )


# ``delta`` is written when ``o`` is given (Δ computed on the way) and only read otherwise; declared mutated either way.
@custom_op("bsa_backward_dq", mutates_args=("delta",))
def _bsa_backward_dq_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    lists: torch.Tensor,
    log_weights: torch.Tensor | None,
    dq: torch.Tensor | None,
    o: torch.Tensor | None,
    pooled_add: torch.Tensor | None,
    query_block: int,
    key_block: int,
    scale: float,
    out_dtype: torch.dtype,
    tail_lo: int,
    tail_hi: int,
    tail_log_weight: float,
    list_log_weight: list[float] | None,
    list_run_columns: list[int] | None,
    full_lists: bool,
) -> torch.Tensor:
    BH, n_q, d = q.shape
    n_tiles = cdiv(n_q, query_block)
    if o is not None:  # read with do's strides (those of a size-1 dim are never used)
        assert o.shape == do.shape and all(a == b or n == 1 for a, b, n in zip(o.stride(), do.stride(), do.shape))
    accumulate = dq is not None
    dq_in = dq
    dq = torch.empty(BH, n_q, d, device=q.device, dtype=out_dtype)
    per_iter = walk_blocks_per_step(query_block, key_block, d)
    n_k = k.shape[1]
    weights = _list_args(log_weights, list_log_weight, list_run_columns, full_lists, lists, n_k, key_block, per_iter)
    n_sub = _n_sub(key_block)  # the dq walks listed blocks in steps of at most 64 keys
    step_keys = key_block // n_sub
    k_desc, v_desc, desc_rows = tma_descriptors(k, v, tma_walk_rows(per_iter, lists.shape[2], step_keys, tail_hi))
    _dq[(n_tiles, BH)](
        q,
        k,
        v,
        do,
        o if o is not None else do,
        lse,
        delta,
        dq_in if accumulate else dq,
        dq,
        lists,
        log_weights if log_weights is not None else lse,
        pooled_add if pooled_add is not None else lse,
        k_desc,
        v_desc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *row_layout(do),
        _bstride(lists),
        lists.stride(1),
        q.shape[1],
        k.shape[1],
        lists.shape[2],
        scale * LOG2E.value,
        scale,
        **weights,
        HEAD_DIM=d,
        BLOCK_M=query_block,
        KEY_BLOCK=key_block,
        PER_ITER=per_iter,
        ACCUMULATE=accumulate,
        HAS_ADD=pooled_add is not None,
        **_tail_args(tail_lo, tail_hi, tail_log_weight, k.shape[1]),
        COMPUTE_DELTA=o is not None,
        PREC=dot_precision(q.dtype),
        EVEN_K=k.shape[1] % key_block == 0,
        N_SUB=n_sub,
        LIST_SLOTS=list_slots(lists.shape[2], per_iter),
        TRANSPOSED=transposed_backward(query_block, d),
        DESC_ROWS=desc_rows,
        **_launch("dq", query_block, d, q.dtype),
    )
    return dq


@_bsa_backward_dq_op.register_fake
def _(q, k, v, do, lse, delta, lists, log_weights, dq, o, pooled_add, query_block, key_block, scale, out_dtype, *tail):
    return q.new_empty(q.shape, dtype=out_dtype)


def bsa_backward_dkdv(
    q,
    k,
    v,
    do,
    lse,
    delta,
    csc,
    query_block,
    key_block,
    scale,
    log_weights=None,
    blk_range=None,
    group=1,
    n_split=1,
    dk=None,
    dv=None,
    shared_list=False,
    pooled_add=None,
    pooled_levels=1,
    out_dtype=torch.float32,
    ds=None,
    ds_lists=None,
):
    """dk, dv (fp32 [BH, Nk, d]) of the key blocks ``blk_range = (lo, hi)`` (default: all), key-major over the CSC
    lists ``csc = (offsets [BH or 1, n_blocks + 1], rows [BH or 1, nnz])``; ``do`` as in ``bsa_backward_dq``. ``group`` consecutive blocks per program
    (only valid when they share one list, e.g. a global level); ``n_split`` programs per group split its list and
    their partial sums are added in a fixed order. Writes into ``dk``/``dv`` (rows outside the range untouched).
    ``shared_list=True``: every key block has the same list ``rows[offsets[0]:offsets[1]]`` (dense / global level),
    so ``offsets`` is just ``[[0, n]]``. ``pooled_add = (gk, gv)`` (fp32 [BH, ceil(Nk / key_block), d], n_split 1
    and group 1 only): adds ``g[row // key_block] / key_block`` to every row (LLSA's mean-pool adjoint, fused).
    ``pooled_levels`` > 1: gk and gv hold that many levels of a pyramid over the key blocks, finest first (level l
    pools ``key_block`` rows of level l - 1; LLSA's bank gradients), and ``g`` is the coarsest level's gradient pushed
    down them: ``G^(l) = g^(l) + G^(l+1)[parent] / key_block``, computed in the epilogue.
    ``ds`` (``ds_buffer(ds_lists, ...)``) with ``ds_lists`` (the query blocks' lists that ``csc`` transposes, ``[BH,
    n_query_blocks, width]``): also keeps every listed pair's dS there, for ``bsa_backward_ds_dq`` (one-warp programs
    only: ``keeps_ds``)."""
    n_blocks = cdiv(k.shape[1], key_block)
    if ds is not None and not keeps_ds(query_block, key_block, q.shape[-1], group):
        raise ValueError(
            f"bsa_backward_dkdv: ds is kept only by one-warp programs of one key block over query blocks of <= 64 "
            f"rows (keeps_ds); got query_block={query_block}, key_block={key_block}, head_dim={q.shape[-1]}, "
            f"group={group}"
        )
    lo, hi = blk_range if blk_range is not None else (0, n_blocks)
    if dk is None:  # every row of the range is written (zeros for blocks nobody attends)
        alloc = torch.empty if (lo, hi) == (0, n_blocks) else torch.zeros
        dk = alloc(k.shape, device=q.device, dtype=out_dtype)
        dv = alloc(k.shape, device=q.device, dtype=out_dtype)
    assert pooled_add is None or (n_split == 1 and group == 1)
    if hi > lo:
        gk, gv = pooled_add if pooled_add is not None else (None, None)
        _bsa_backward_dkdv_op(
            q,
            k,
            v,
            do,
            lse,
            delta,
            *csc,
            dk,
            dv,
            log_weights,
            gk,
            gv,
            pooled_levels,
            query_block,
            key_block,
            scale,
            lo,
            hi,
            group,
            n_split,
            shared_list,
            ds,
            ds_lists,
        )
    return dk, dv


def keeps_ds(query_block: int, key_block: int, head_dim: int, group: int = 1) -> bool:
    """Whether the key-major dk/dv can keep dS for ``bsa_backward_ds_dq``: programs of one key block on one warp
    (``program_warps``), whose steps are one whole query block (``walk_blocks_per_step`` 1, blocks of <= 64 rows)."""
    return (
        group == 1
        and program_warps(key_block, True, head_dim) == 1
        and walk_blocks_per_step(key_block, query_block, head_dim) == 1
        and _n_sub(query_block) == 1
    )


def ds_buffer(lists: torch.Tensor, query_block: int, key_block: int, dtype: torch.dtype) -> torch.Tensor:
    """Where the dk/dv keeps dS: one ``[key_block, query_block]`` tile (dS^T) per slot of ``lists`` ([BH,
    n_query_blocks, width]), in the inputs' dtype (the dk/dv's product rounds dS to it: the dq reads those bits).
    Slots that are empty (-1) are never written nor read."""
    bh, n_blocks, width = lists.shape
    return torch.empty(bh, n_blocks * width, key_block, query_block, device=lists.device, dtype=dtype)


@custom_op("bsa_backward_dkdv", mutates_args=("dk", "dv", "ds"))
def _bsa_backward_dkdv_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    log_weights: torch.Tensor | None,
    pooled_k: torch.Tensor | None,
    pooled_v: torch.Tensor | None,
    pooled_levels: int,
    query_block: int,
    key_block: int,
    scale: float,
    lo: int,
    hi: int,
    group: int,
    n_split: int,
    shared_list: bool,
    ds: torch.Tensor | None,
    ds_lists: torch.Tensor | None,
) -> None:
    BH, n_q, d = q.shape
    n_k = k.shape[1]
    n_groups = cdiv(hi - lo, group)
    per_iter = walk_blocks_per_step(key_block * group, query_block, d)
    r0, r1 = lo * key_block, min(n_k, hi * key_block)
    if n_split > 1:  # every split writes all rows of the range (zeros when its part of the list is empty)
        tgt_k = torch.empty(n_split, BH, r1 - r0, d, device=q.device, dtype=torch.float32)
        tgt_v = torch.empty_like(tgt_k)
        out_row0, out_rows = r0, r1 - r0
    else:
        tgt_k, tgt_v = dk, dv
        out_row0, out_rows = 0, n_k
    # q and dO by TMA where a step is whole tiles' rows (query tiles of >= 64 rows, every tile whole)
    n_sub = _n_sub(query_block)
    step_rows = query_block // n_sub if per_iter == 1 and n_q % query_block == 0 else 0
    q_desc, do_desc, desc_rows = tma_descriptors(q, do, step_rows)
    _dkdv[(n_groups, BH, n_split)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        tgt_k,
        tgt_v,
        offsets,
        rows,
        log_weights if log_weights is not None else lse,
        pooled_k if pooled_k is not None else lse,
        pooled_v if pooled_v is not None else lse,
        q_desc,
        do_desc,
        ds if ds is not None else lse,  # not read without DS_SLOTS
        ds_lists if ds_lists is not None else offsets,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *row_layout(do),
        _bstride(offsets),
        _bstride(rows),
        ds_lists.stride(0) if ds_lists is not None else 0,
        ds_lists.stride(1) if ds_lists is not None else 0,
        ds_lists.shape[-1] if ds_lists is not None else 0,
        n_q,
        n_k,
        lo,
        0 if shared_list else lo,
        0 if shared_list else group,
        out_row0,
        out_rows,
        pooled_k.shape[1] if pooled_k is not None else 0,
        scale * LOG2E.value,
        scale,
        HEAD_DIM=d,
        QUERY_BLOCK=query_block,
        KEY_BLOCK=key_block,
        GROUP=group,
        PER_ITER=per_iter,
        N_SPLIT=n_split,
        HAS_LOGW=log_weights is not None,
        HAS_ADD=pooled_k is not None,
        ADD_LEVELS=pooled_levels if pooled_k is not None else 1,
        PREC=dot_precision(q.dtype),
        EVEN_Q=n_q % query_block == 0,
        N_SUB=n_sub,
        TRANSPOSED=transposed_backward(key_block * group, d),
        DESC_ROWS=desc_rows,
        DS_SLOTS=next_power_of_2(ds_lists.shape[-1]) if ds is not None else 0,
        **_launch("dkdv", key_block * group, d, q.dtype),
    )
    if n_split > 1:
        dk[:, r0:r1] = tgt_k.sum(0)
        dv[:, r0:r1] = tgt_v.sum(0)


@_bsa_backward_dkdv_op.register_fake
def _(*args):
    return None


def bsa_backward_ds_dq(k, ds, lists, n_q, query_block, key_block, scale, dq=None, out_dtype=torch.float32):
    """dq ([BH, n_q, d], ``out_dtype``) of the query blocks' ``lists`` ([BH, n_query_blocks, width]) from the dS that
    ``bsa_backward_dkdv(..., ds=ds, ds_lists=lists)`` kept, plus ``dq`` (fp32, an earlier pass) when given: the
    same sum as ``bsa_backward_dq`` over those lists (dS K, scaled), with nothing recomputed. Requires the dk/dv
    first (it writes ``ds``)."""
    out = torch.empty(k.shape[0], n_q, k.shape[2], device=k.device, dtype=out_dtype)
    _bsa_backward_ds_dq_op(k, ds, lists, dq, out, query_block, key_block, scale)
    return out


@custom_op("bsa_backward_ds_dq", mutates_args=("out",))
def _bsa_backward_ds_dq_op(
    k: torch.Tensor,
    ds: torch.Tensor,
    lists: torch.Tensor,
    dq: torch.Tensor | None,
    out: torch.Tensor,
    query_block: int,
    key_block: int,
    scale: float,
) -> None:
    BH, n_k, d = k.shape
    _ds_dq[(lists.shape[1], BH)](
        k,
        ds,
        lists,
        dq if dq is not None else out,  # not read without ACCUMULATE
        out,
        k.stride(0),
        k.stride(1),
        lists.stride(0),
        lists.stride(1),
        out.shape[1],
        n_k,
        lists.shape[2],
        scale,
        HEAD_DIM=d,
        QUERY_BLOCK=query_block,
        KEY_BLOCK=key_block,
        ACCUMULATE=dq is not None,
        PREC=dot_precision(k.dtype),
        **_launch("dq", query_block, d, k.dtype),
    )


@_bsa_backward_ds_dq_op.register_fake
def _(*args):
    return None


def bsa_backward_dkdv_grouped(
    q,
    k,
    v,
    do,
    lse,
    delta,
    group_lists,
    group_rows,
    key_block,
    scale,
    log_weights=None,
    blk_range=None,
    dk=None,
    dv=None,
):
    """dk, dv (fp32 [BH, Nk, d]) of the key blocks ``blk_range = (lo, hi)`` when queries come in groups that share
    one list: ``group_lists`` int32 [BH, n_groups, width] names the key blocks that all ``group_rows`` consecutive
    query rows of group g attend to (LLSA's candidate levels: the 256 queries of a level-2 ancestor share its picks'
    children). Query-group-major where ``bsa_backward_dkdv`` is key-major: a program takes 64 listed key rows of one
    group and sums their dK, dV over the group's rows, loading each query row once per 64 keys instead of once per
    key block; a second kernel adds each key block's per-group partials in a fixed order (the CSC of the slots that
    list it), so every row has one writer and the sums are bitwise reproducible. ``do`` as in ``bsa_backward_dq``.
    Writes rows ``[lo * key_block, hi * key_block)`` of ``dk`` / ``dv`` (zeros for blocks no group lists)."""
    n_blocks = cdiv(k.shape[1], key_block)
    lo, hi = blk_range if blk_range is not None else (0, n_blocks)
    if dk is None:
        dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
        dv = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    if hi > lo:
        group_lists = group_lists.contiguous()
        offsets, entries = csr_to_csc(group_lists, hi, slots=True)
        _bsa_backward_dkdv_grouped_op(
            q,
            k,
            v,
            do,
            lse,
            delta,
            group_lists,
            offsets,
            entries,
            dk,
            dv,
            log_weights,
            group_rows,
            key_block,
            scale,
            lo,
        )
    return dk, dv


@custom_op("bsa_backward_dkdv_grouped", mutates_args=("dk", "dv"))
def _bsa_backward_dkdv_grouped_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    group_lists: torch.Tensor,
    offsets: torch.Tensor,
    entries: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    log_weights: torch.Tensor | None,
    group_rows: int,
    key_block: int,
    scale: float,
    lo: int,
) -> None:
    BH, n_q, d = q.shape
    n_k = k.shape[1]
    _, n_groups, width = group_lists.shape
    hi = offsets.shape[1] - 1
    assert n_groups * group_rows >= n_q and group_rows % 64 == 0, (n_groups, group_rows, n_q)
    slots = blocks_per_step(key_block)  # listed blocks per program: 64 key rows (one block if larger)
    partial_k = torch.empty(BH, n_groups, width * key_block, d, device=q.device, dtype=torch.float32)
    partial_v = torch.empty_like(partial_k)
    _grouped_dkdv[(cdiv(width, slots), n_groups, BH)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        group_lists,
        log_weights if log_weights is not None else lse,
        partial_k,
        partial_v,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *row_layout(do),
        group_lists.stride(0),
        group_lists.stride(1),
        n_q,
        n_k,
        width,
        group_rows,
        scale * LOG2E.value,
        scale,
        HEAD_DIM=d,
        KEY_BLOCK=key_block,
        SLOTS=slots,
        HAS_LOGW=log_weights is not None,
        EVEN_Q=n_q % group_rows == 0,
        PREC=dot_precision(q.dtype),
        **_launch("dkdv", key_block * slots, d, q.dtype),
    )
    _sum_slots_kernel[(hi - lo, BH)](  # a memory-bound sum of a few tiles per program (SUM_SLOTS_WARPS)
        partial_k,
        partial_v,
        offsets,
        entries,
        dk,
        dv,
        _bstride(offsets),
        _bstride(entries),
        dk.stride(0),
        dk.stride(1),
        n_groups * width,
        lo,
        n_k,
        HEAD_DIM=d,
        KEY_BLOCK=key_block,
        num_warps=SUM_SLOTS_WARPS,
    )


@_bsa_backward_dkdv_grouped_op.register_fake
def _(*args):
    return None


def shared_csc(n_tiles: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSC of "every query tile lists this block", for ``shared_list=True``."""

    # [[0, n_tiles]] built on the device: a tensor from a Python list is a blocking host-to-device copy (a stream
    # sync in every LLSA backward); kept for eager calls (``shape_constant``)
    def make():
        offsets = torch.arange(0, 2 * n_tiles, n_tiles, device=device, dtype=torch.int32)[None]  # [[0, n_tiles]]
        return offsets, torch.arange(n_tiles, device=device, dtype=torch.int32)[None]

    return shape_constant(("shared csc", n_tiles), torch.device(device), make)


# Programs a key-major dk/dv with long shared lists is split into (``split_count``): about one wave of the 4-warp,
# 168-register programs on a 132-SM H100 / H200 (three per SM). LLSA's coarsest-level dk/dv at 256², L = 2 (48 key
# groups) on an H100: 21 splits (1,008 programs, the former target of ~1,000: 2.55 waves) 0.252 ms, 16 (two waves)
# 0.230, 8 (one) 0.229, and the fp32 parts' sum 0.018 -> 0.009 ms; at 128² 0.102 / 0.089 / 0.082 ms
# (docs/kernel_notes.md v57).
SPLIT_PROGRAMS = 384


def split_count(n_programs: int, list_len: int) -> int:
    """Split long key-major lists so that about ``SPLIT_PROGRAMS`` programs run, at least 8 list entries each and
    at most 64 parts (deterministic: depends on shapes only, so a gradient's summation order does too)."""
    want = max(1, SPLIT_PROGRAMS // max(1, n_programs))
    return int(min(want, max(1, list_len // 8), 64))


def delta_rows(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """Δ_i = <dO_i, O_i> in fp32 ([BH, N])."""
    return (o.float() * do.float()).sum(-1)


def bsa_backward(
    qf,
    kf,
    vf,
    do,
    o,
    lse,
    lists,
    query_block,
    key_block,
    scale,
    log_weights=None,
    csc=None,
    dlse=None,
    pooled_add=None,
    out_dtype=None,
    dkdv_block=None,
    dense_tail=None,
):
    """dq, dk, dv (``out_dtype``, default the input dtype) of one block-sparse pass over flattened ``[BH, N, d]``
    tensors. ``csc``: the lists' transpose when it is shared by all key blocks (``shared_csc``), else sorted here.
    ``dlse``: the gradient of the returned LSE, if any. ``pooled_add = (gq, gk, gv)`` (fp32 ``[BH, tiles or blocks,
    d]``): the gradients of mean-pooled copies of q, k and v (pooled over the query tiles and key blocks), whose
    adjoint is added to dq, dk and dv inside the kernels' epilogues instead of as three full-size passes.
    ``dkdv_block``: with a shared ``csc`` over query tiles of this many rows (dense attention, ``dense_walk``), the
    dk/dv pass's own query tile and key block; the dq pass keeps ``query_block`` / ``key_block``. ``dense_tail``:
    as in ``bsa_forward``, for the dq pass (the dk/dv pass takes those keys' queries from ``csc``)."""
    assert dkdv_block is None or (csc is not None and pooled_add is None)
    out_dtype = out_dtype or qf.dtype
    do = do.contiguous()
    if dlse is None:  # Δ = rowsum(dO * O) is computed by the dq kernel (no fp32 copies of O and dO)
        delta, o_for_delta = torch.empty(lse.shape, device=lse.device, dtype=torch.float32), o
    else:  # d lse_i / d s_it = P_it: the same as an extra -dlse_i in Δ
        delta, o_for_delta = delta_rows(o, do) - dlse.reshape(lse.shape).float(), None
    if kf.stride() != vf.stride():
        kf, vf = kf.contiguous(), vf.contiguous()
    n_k = kf.shape[1]
    kv_query_block, kv_key_block = (dkdv_block, dkdv_block) if dkdv_block is not None else (query_block, key_block)
    n_blocks = cdiv(n_k, kv_key_block)
    shared = csc is not None
    csc = csc if shared else csr_to_csc(lists, n_blocks)
    add_q, add_k, add_v = pooled_add if pooled_add is not None else (None, None, None)
    dq = bsa_backward_dq(
        qf,
        kf,
        vf,
        do,
        lse,
        delta,
        lists,
        query_block,
        key_block,
        scale,
        log_weights,
        o=o_for_delta,
        out_dtype=out_dtype,
        pooled_add=add_q,
        dense_tail=dense_tail,
    )
    n_split = split_count(qf.shape[0] * n_blocks, cdiv(qf.shape[1], kv_query_block))
    dk, dv = bsa_backward_dkdv(
        qf,
        kf,
        vf,
        do,
        lse,
        delta,
        csc,
        kv_query_block,
        kv_key_block,
        scale,
        log_weights,
        n_split=n_split,
        shared_list=shared,
        pooled_add=(add_k, add_v) if add_k is not None and n_split == 1 else None,
        out_dtype=out_dtype if n_split == 1 else torch.float32,
    )
    if n_split > 1:  # split lists sum in fp32 first; the pooled adjoint (if any) is added to that sum
        if add_k is not None:
            dk += block_mean_adjoint(add_k, dk.shape, torch.float32, key_block)
            dv += block_mean_adjoint(add_v, dv.shape, torch.float32, key_block)
        dk, dv = dk.to(out_dtype), dv.to(out_dtype)
    return dq, dk, dv


# Dense attention through the block-sparse kernels (flash_attention, VSA's coarse stage). The query-major passes
# (forward, dq) run 128-row query tiles with no listed blocks and every key walked as one contiguous range (the dense
# tail: addresses known in advance, so the loads pipeline deeper than a list walk's: 1.09x forward, 1.06x forward +
# backward on the H200 at 65,536 tokens); the key-major dk/dv pass keeps 64 keys per program over 64-row query tiles,
# its fastest shape (62.9 ms at 64 keys per program against 80 with 128; docs/kernel_notes.md v15).
DENSE_TILE = 128
DENSE_KV_TILE = 64


def dense_walk(n_q: int, n_k: int, device) -> tuple[torch.Tensor, tuple, tuple[torch.Tensor, torch.Tensor]]:
    """``(lists, dense_tail, csc)`` of dense attention: empty lists of ``DENSE_TILE``-row query tiles (one table
    ``[1, tiles, 0]`` for all heads), all ``n_k`` keys as the dense tail (``bsa_forward`` / ``bsa_backward``'s
    ``dense_tail``), and the dk/dv pass's CSC: every ``DENSE_KV_TILE``-key block lists every ``DENSE_KV_TILE``-row
    query tile (shared, no sort; pass ``dkdv_block=DENSE_KV_TILE`` to ``bsa_backward``)."""
    lists = torch.empty(1, cdiv(n_q, DENSE_TILE), 0, device=device, dtype=torch.int32)
    return lists, (0, n_k, 0.0), shared_csc(cdiv(n_q, DENSE_KV_TILE), device)


# ------------------------------------------------------------------------------------------------------- public API
class _BlockSparseFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, lists, query_block, key_block, scale, log_weights, csc, dkdv_block, dense_tail, return_lse
    ):
        # The LSE is an output only when asked for: an unused one would get a zero gradient to subtract (under
        # torch.compile even with set_materialize_grads(False)), i.e. Δ as an extra PyTorch pass.
        ctx.set_materialize_grads(False)
        b, h, n_q, d = q.shape
        qf, (kf, vf) = flatten_heads(q), flatten_kv(k, v)
        o, lse = bsa_forward(qf, kf, vf, lists, query_block, key_block, scale, log_weights, dense_tail=dense_tail)
        ctx.save_for_backward(qf, kf, vf, lists, o, lse, log_weights)
        ctx.csc = csc
        ctx.cfg = (query_block, key_block, scale, q.shape, k.shape, dkdv_block, dense_tail)
        o = o.view(b, h, n_q, d)
        return (o, lse.view(b, h, n_q)) if return_lse else o

    @staticmethod
    def backward(ctx, do, dlse=None):
        qf, kf, vf, lf, o, lse, log_weights = ctx.saved_tensors
        query_block, key_block, scale, q_shape, k_shape, dkdv_block, dense_tail = ctx.cfg
        if do is None:  # only the LSE is used downstream
            do = torch.zeros_like(o)
        dq, dk, dv = bsa_backward(
            qf,
            kf,
            vf,
            flatten_grad(do),
            o,
            lse,
            lf,
            query_block,
            key_block,
            scale,
            log_weights,
            ctx.csc,
            dlse,
            dkdv_block=dkdv_block,
            dense_tail=dense_tail,
        )
        return dq.view(q_shape), dk.view(k_shape), dv.view(k_shape), *([None] * 10)


def block_sparse_attention_torch(
    q, k, v, block_lists, query_block, key_block, scale=None, block_log_weights=None, return_lse=False
):
    """Exact gather-form PyTorch version of ``block_sparse_attention`` (fp32 math, autograd; memory
    O(Nq * len * key_block * d))."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    n_tiles = block_lists.shape[-2]
    pad_q = n_tiles * query_block - n_q
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, pad_q)).view(b, h, n_tiles, query_block, d)
    lists = block_lists.expand(b, h, -1, -1).long()
    valid_blk = lists >= 0
    rows = (lists.clamp(min=0)[..., None] * key_block + torch.arange(key_block, device=q.device)).flatten(-2)
    ok = (valid_blk[..., None] & (rows.view(*lists.shape, key_block) < n_k)).flatten(-2)
    rows = rows.clamp(max=n_k - 1)
    idx = rows.view(b, h, -1, 1).expand(-1, -1, -1, d)
    kg = torch.gather(k.float(), 2, idx).view(b, h, n_tiles, -1, d)
    vg = torch.gather(v.float(), 2, idx).view(b, h, n_tiles, -1, d)
    s = (qf @ kg.transpose(-1, -2)) * scale  # [b, h, tiles, qb, len*kb]
    if block_log_weights is not None:
        w = block_log_weights.float()[lists.clamp(min=0)]  # [b, h, tiles, len]
        s = s + w.repeat_interleave(key_block, -1)[..., None, :]
    s = s.masked_fill(~ok[..., None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = (torch.softmax(s, -1) @ vg).reshape(b, h, -1, d)[:, :, :n_q].to(q.dtype)
    lse = lse.reshape(b, h, -1)[:, :, :n_q]
    return (o, lse) if return_lse else o


def block_sparse_attention(
    q,
    k,
    v,
    block_lists,
    *,
    query_block: int,
    key_block: int,
    scale: float | None = None,
    block_log_weights: torch.Tensor | None = None,
    return_lse: bool = False,
    impl: str = "auto",
):
    """Block-sparse softmax attention, differentiable in q, k, v (also through the returned LSE).

    Args:
        q: ``[b, h, Nq, d]``; k, v: ``[b, h, Nk, d]``; fp16/bf16/fp32 (same dtype), d in {16, 32, 64, 128}.
        block_lists: int32 ``[b, h, ceil(Nq / query_block), len]`` (or broadcastable from ``[1, 1, ...]``): key-block
            ids each query tile attends to; ``-1`` = empty slot; ids distinct within a row; every query row should
            see at least one key (an empty row gives output 0 and LSE -inf... avoid it).
        query_block: rows per query tile (multiple of 16; e.g. 16 for LLSA's fine level, 64 for VSA/SLA).
        key_block: keys per listed block (power of two >= 16); key rows >= Nk are masked (partial last block).
        scale: logit scale, default ``1 / sqrt(d)``.
        block_log_weights: optional fp32 ``[ceil(Nk / key_block)]`` added to the logits of each key block.
        return_lse: also return the natural-log log-sum-exp per query row (fp32 ``[b, h, Nq]``).
        impl: "auto" (Triton on CUDA, PyTorch on CPU), "triton" (also on CPU under TRITON_INTERPRET=1), "torch".
    Returns:
        o ``[b, h, Nq, d]`` in the input dtype (and lse).
    """
    triton_path = use_triton(q, impl)
    if triton_path:
        q, k, v = autocast_inputs(q, k, v)
    check_qkv(q, k, v, name="block_sparse_attention", self_attention=False, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if query_block % 16 or query_block <= 0:
        raise ValueError(f"block_sparse_attention: query_block must be a positive multiple of 16, got {query_block}")
    if key_block < 16 or key_block & (key_block - 1):
        raise ValueError(f"block_sparse_attention: key_block must be a power of two >= 16, got {key_block}")
    n_tiles = cdiv(q.shape[2], query_block)
    if block_lists.dim() != 4 or block_lists.shape[-2] != n_tiles:
        raise ValueError(
            f"block_sparse_attention: block_lists must be [b, h, {n_tiles}, len] for Nq={q.shape[2]} "
            f"and query_block={query_block}, got {tuple(block_lists.shape)}"
        )
    if not triton_path:
        return block_sparse_attention_torch(
            q, k, v, block_lists, query_block, key_block, scale, block_log_weights, return_lse
        )
    lists, log_weights = flat_lists(block_lists, q), _log_weights(block_log_weights)
    return _BlockSparseFn.apply(
        q, k, v, lists, query_block, key_block, scale, log_weights, None, None, None, return_lse
    )


def flat_lists(block_lists: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """int32 [b*h, tiles, len], or [1, tiles, len] (stride 0 over heads) when one table serves every head."""
    lists = block_lists.to(torch.int32)
    if lists.shape[0] == 1 and lists.shape[1] == 1:
        return lists[0]
    b, h = q.shape[:2]
    return lists.expand(b, h, -1, -1).reshape(b * h, lists.shape[-2], lists.shape[-1])


def _log_weights(w: torch.Tensor | None) -> torch.Tensor | None:
    return w.float().contiguous() if w is not None else None


def flash_attention(q, k, v, scale: float | None = None, impl: str = "auto"):
    """Dense softmax attention through the block-sparse kernels, every key walked as one range (``attention=full
    impl=triton``): our own FlashAttention, the like-for-like baseline of the sparse kernels."""
    if not use_triton(q, impl):  # the exact gather form with every key block listed
        n_tiles, n_blocks = cdiv(q.shape[2], DENSE_TILE), cdiv(k.shape[2], DENSE_TILE)
        every = torch.arange(n_blocks, device=q.device, dtype=torch.int32).expand(1, 1, n_tiles, n_blocks)
        return block_sparse_attention(
            q, k, v, every, query_block=DENSE_TILE, key_block=DENSE_TILE, scale=scale, impl=impl
        )
    q, k, v = autocast_inputs(q, k, v)
    check_qkv(q, k, v, name="flash_attention", self_attention=False, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lists, tail, csc = dense_walk(q.shape[2], k.shape[2], q.device)
    return _BlockSparseFn.apply(q, k, v, lists, DENSE_TILE, DENSE_TILE, scale, None, csc, DENSE_KV_TILE, tail, False)
