"""Pooled-score top-k selection in Triton, shared by LLSA's levels and by VSA's / SLA's single-level selection.

    from pixdit.kernels.topk import pooled_topk
    idx = pooled_topk(q_pooled, k_pooled, k=8)                              # candidates: every key row
    idx = pooled_topk(q_pooled, k_pooled, k=8, parents=I2, child_block=16)  # candidates: children of I2[r // 16]

Semantics = ``blocks.topk_desc`` on fp32 scores ``<q_r, k_c>`` (no scale): descending score, ties -> smaller id (-0.0
ties with +0.0), deterministic. Scores are fp32 products (FMA in the streaming and rescoring kernels,
``input_precision="ieee"``; cuBLAS with TF32 off in the PyTorch path); the two-pass path screens with TF32 scores and
decides by fp32 ones (below), so no selection depends on TF32 rounding. The one-shot kernel's candidate sets of up to
256 (LLSA's levels) take their scores from the tensor cores in three TF32 products (``tf32x3``: each fp32 operand
split into a TF32 high part and a TF32 remainder, the remainders' product dropped), within ~2^-20 of the fp32 score
relative to ``||q|| ||k||``, as close as two fp32 summation orders are to each other (below). ``k`` is a run-time
argument everywhere: a new k compiles nothing new (one one-shot variant per candidate count, four row-select and three
streaming buckets per row length).
Four paths, one result:

* ``_pooled_topk_kernel`` (small candidate sets: ``candidates <= 1024`` and a ``[d, candidates]`` tile within
  128 KiB): all scores of a 16-row tile at once, then k rounds of (row max, smallest id reaching it, remove it).
* two-pass (every key row a candidate, up to ``ROW_SELECT_MAX_CANDIDATES`` of them, ``k <= ROW_SELECT_MAX_K``):
  the fp32 scores of a chunk of rows by cuBLAS (at most 256 MiB at a time), then ``_row_topk_kernel``, one score
  row per program: a bisection over order-preserving int32 keys narrows the k-th largest score down until at most
  ``_row_cap(k)`` keys are at or above its lower bound. It starts between the smallest of k (or more) group maxima
  and the largest key, so continuous scores need ~2 steps after that first pass (~10 from the top bit); those
  candidates are compacted (by a prefix sum, or by an atomic counter on rows of more than 8,192 slots) and
  sorted (score descending, ties -> smaller id). Only when more keys
  tie at the k-th score than that does the bisection run down to that score and a search over the ids pick the
  smallest.
  On rows of >= 2,048 candidates with k <= 51 (``_screens``: VSA and SLA at 256² and up) the cuBLAS scores are
  *screened* ones (``_screened_scores``: TF32 tensor cores, ~3x faster than fp32 FFMA on the H200), each within
  e = ``_screen_error(d)`` * ||q|| * max ||k|| of its fp32 score. The row kernel picks each row's top c
  (``_screen_width``: 64 for k = 32) by screened score; ``_rescore_kernel`` certifies the row (the c-th screened
  score below the k-th minus 2e: no other key can reach the exact top k), computes the c candidates' fp32 scores
  and ranks by those. A row it cannot certify (near-ties at the cut, a zero query) gets its whole score row in fp32
  in place and the plain row kernel (``FLAGGED``). The result is the exact fp32 top k either way.
* ``_streaming_topk_kernel`` (every key row a candidate, ``k <= 64``, rows beyond the two-pass bound): scores a chunk of 128 candidates at a time and keeps each row's best k in registers (``SLOTS`` =
  16, 32 or 64 slots, the power of two >= k). Chunks come in ascending id order, so a newcomer enters only if it
  is *strictly* better than the worst kept entry (on a tie the kept, smaller id wins); each chunk costs as many
  insertion rounds as its most-improved row needs. Nothing ``[T, T]`` is written.
* PyTorch (CPU, larger ``k``, ``k`` equal to the number of candidates, or shapes the kernels do not take): chunked
  fp32 matmuls (TF32 off) + ``topk_desc_fast``; nothing to compile.

Summation order (and the one-shot kernel's TF32 split) differs between the paths, so on near-ties (differences ~1e-7
to ~1e-6 relative) they may pick different ids; each is an exact or near-exact fp32 selection. Tests:
``tests/kernels/test_topk.py``, ``tests/kernels/test_block_sparse.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import exact_fp32_matmul, fp32_matmul, topk_desc
from .ops import cdiv, custom_op, next_power_of_2

__all__ = [
    "pooled_topk",
    "topk_desc_fast",
    "MAX_CANDIDATES",
    "STREAM_MAX_K",
    "ROW_SELECT_MAX_CANDIDATES",
    "ROW_SELECT_MAX_K",
]

MAX_CANDIDATES = 1024
_MAX_CAND_X_DIM = 32768  # set when the whole [d, candidates] fp32 key tile went through shared memory (<= 128 KiB)
_ROWS = 16
_D_CHUNK = 16  # head-dim columns per step of the one-shot kernel's score product (see _one_shot_launch)
# Streaming kernel: each row keeps its best SLOTS (16, 32 or 64: the power of two >= k) scores and ids in registers;
# k > 64 takes the PyTorch path (at those k the [T, T] scores no longer dominate).
STREAM_MAX_K = 64
_STREAM_MIN_SLOTS = 16
_STREAM_ROWS = 32  # query rows per program: each loaded key chunk serves 32 rows
_STREAM_CHUNK = 128  # candidates scored per step
_TORCH_MAX_SCORES = 1 << 26  # fp32 scores alive at once in the PyTorch and two-pass paths (256 MiB)
# Two-pass path: a score row of up to this many candidates is held by one program, and up to 2 * 128 candidates
# are sorted, hence the bound on k. Where both run, it is faster than the
# streaming kernel at every k (docs/benchmarks.md, "Block selection alone").
ROW_SELECT_MAX_CANDIDATES = 16384
ROW_SELECT_MAX_K = 128
# Screened two-pass selection (module doc): measured on the H200 against exact fp32 scores, it pays on rows of
# 4,096 and 16,384 candidates with up to 64 ids rescored (VSA 256^2 K = 16 / 32, 512^2 K = 32), not on rows of
# 1,024 (VSA 128^2: the fp32 matmul is only 0.2 ms there) nor with 128 ids to rescore (K = 64: 3.5 ms against 1.9).
_SCREEN_MIN_CANDIDATES = 2048
_SCREEN_MAX_WIDTH = 64


@triton.jit(do_not_specialize=["k"])  # k only bounds a loop: one compiled kernel serves every k
def _pooled_topk_kernel(
    QP,
    KP,
    PAR,
    OUT,
    n_rows,
    n_cand,
    k,
    stride_qb,
    stride_kb,
    stride_pb,
    stride_ob,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    CAND: tl.constexpr,
    CHILD: tl.constexpr,
    N_PARENTS: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    c = tl.arange(0, CAND)
    if CHILD > 0:  # the ROWS rows lie in one parent group (ROWS divides CHILD): shared candidate set
        grp = (pid * ROWS) // CHILD
        par = tl.load(PAR + bh * stride_pb + grp * N_PARENTS + c // CHILD, mask=c < N_PARENTS * CHILD, other=-1)
        ids = par * CHILD + c % CHILD
        ok = par >= 0
    else:
        ids = c
        ok = c < n_cand
    # The scores' product D_CHUNK columns of d at a time, each step continuing the fp32 sums of the last. The whole
    # key tile at once held 254 registers at 4 warps, two programs per SM, each waiting on its loads; the chunks are
    # a pipelined loop that fits one warp. PRECISION: "tf32x3" (tensor cores) or "ieee" (FMA), see _one_shot_launch.
    dims = tl.arange(0, D_CHUNK)
    q_at = QP + bh * stride_qb + rows[:, None] * HEAD_DIM + dims[None, :]
    k_at = KP + bh * stride_kb + ids[None, :].to(tl.int64) * HEAD_DIM + dims[:, None]
    s = tl.zeros([ROWS, CAND], tl.float32)
    for d0 in range(0, HEAD_DIM, D_CHUNK):
        qc = tl.load(q_at + d0, mask=row_ok[:, None], other=0.0)
        kc = tl.load(k_at + d0, mask=ok[None, :], other=0.0)
        s = tl.dot(qc, kc, s, input_precision=PRECISION)
    s = tl.where(ok[None, :], s, float("-inf"))
    big = 2147483647
    out_base = OUT + bh * stride_ob + rows * k
    for i in range(k):
        m = tl.max(s, 1)
        sel = tl.min(tl.where(s == m[:, None], ids[None, :], big), 1)
        tl.store(out_base + i, sel, mask=row_ok)
        s = tl.where(ids[None, :] == sel[:, None], float("-inf"), s)


@triton.jit(do_not_specialize=["k"])  # k is a run-time value: one compiled kernel per SLOTS bucket
def _streaming_topk_kernel(
    QP,
    KP,
    OUT,
    n_rows,
    n_cand,
    k,
    stride_qb,
    stride_kb,
    stride_ob,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    SLOTS: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    dims = tl.arange(0, HEAD_DIM)
    qp = tl.load(QP + bh * stride_qb + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    big = 2147483647
    slot = tl.arange(0, SLOTS)
    live = (slot < k)[None, :]
    # kept entries: -inf until filled; slots beyond k hold +inf so they are never the worst; distinct ids
    kept = tl.where(live, float("-inf"), float("inf")) + tl.zeros([ROWS, SLOTS], tl.float32)
    kept_id = -1 - slot[None, :] + tl.zeros([ROWS, SLOTS], tl.int32)
    worst = tl.full([ROWS], float("-inf"), tl.float32)
    c = tl.arange(0, CHUNK)
    for c0 in range(0, n_cand, CHUNK):
        ids = c0 + c
        ok = ids < n_cand
        kt = tl.load(
            KP + bh * stride_kb + ids[None, :].to(tl.int64) * HEAD_DIM + dims[:, None], mask=ok[None, :], other=0.0
        )
        s = tl.dot(qp, kt, input_precision="ieee")
        s = tl.where(ok[None, :], s, float("-inf"))
        # newcomers have larger ids than every kept entry: only a strictly better score enters
        rounds = tl.minimum(tl.max(tl.sum((s > worst[:, None]).to(tl.int32), 1), 0), k)
        for _ in range(rounds):
            m = tl.max(s, 1)
            new_id = tl.min(tl.where(s == m[:, None], ids[None, :], big), 1)
            # the entry to evict: the lowest kept value, among equal values the largest id
            evict_id = tl.max(tl.where(kept == worst[:, None], kept_id, -big), 1)
            evict = (kept_id == evict_id[:, None]) & (m > worst)[:, None]
            kept = tl.where(evict, m[:, None], kept)
            kept_id = tl.where(evict, new_id[:, None], kept_id)
            s = tl.where(ids[None, :] == new_id[:, None], float("-inf"), s)
            worst = tl.min(kept, 1)
    # write out best first: value descending, ties -> smaller id
    kept = tl.where(live, kept, float("-inf"))
    out_base = OUT + bh * stride_ob + rows * k
    for i in range(k):
        m = tl.max(kept, 1)
        sel = tl.min(tl.where(kept == m[:, None], kept_id, big), 1)
        tl.store(out_base + i, sel, mask=row_ok)
        kept = tl.where(kept_id == sel[:, None], float("-inf"), kept)


@triton.jit
def _order_key(s):
    """int32 that orders like the fp32 score ``s`` (magnitude bits of negatives flipped; -0.0 ties with +0.0)."""
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit(do_not_specialize=["k", "stride_o"])  # k (= the output row stride): one kernel per (BLOCK, CAP)
def _row_topk_kernel(
    S,
    OUT,
    SCRATCH,
    COUNT,
    FLAGS,
    n,
    k,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    KEYS_IN_SCRATCH: tl.constexpr,
    ATOMIC_SLOTS: tl.constexpr,
    FLAGGED: tl.constexpr,
):
    """One row of precomputed fp32 scores per program: a bisection for the k-th largest score that stops once at
    most CAP keys are at or above its lower bound; those candidates' ids are compacted into a scratch row and
    sorted, and the k best are stored in order (score descending, ties -> smaller id).
    ``COUNT``: one zeroed int32 per row, the scratch row's fill counter when ``ATOMIC_SLOTS``. ``FLAGGED``: only
    the rows whose int32 in ``FLAGS`` is nonzero (the screened selection's uncertified rows)."""
    row = tl.program_id(0).to(tl.int64)
    if FLAGGED:
        if tl.load(FLAGS + row) == 0:
            return
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    s_row = S + row * stride_s
    out_row = OUT + row * stride_o
    # int32 keys, not int64: a search step is one compare, one select and one add per key; absent = INT32_MIN
    key = tl.where(valid, _order_key(tl.load(s_row + offs, mask=valid, other=0.0)), -2147483648)
    # Bisection over u = key + 2^31 (0 .. 2^32 - 1) for the k-th largest u, keeping c_lo = #(u >= lo) >= k and
    # c_hi = #(u >= hi) < k (those all winners). It starts from a bracket, not from the top bit: hi just above the
    # largest key, lo the smallest of G >= k group maxima (G distinct keys are >= it, so c_lo >= k; a group of
    # absent keys only has the absent key as its maximum, which starts lo at 0, the whole range). Continuous scores
    # leave at most CAP keys >= lo after ~2 more steps (from the top bit it took ~10: the sign, the exponent, a few
    # mantissa bits), so the search stops there; only ties at the k-th score take it down to hi = lo + 1.
    G: tl.constexpr = CAP // 2  # >= k (_row_cap)
    group_max = tl.max(tl.reshape(key, [G, BLOCK // G], can_reorder=True), 1)  # which keys share a group: any
    lo = tl.min(group_max, 0).to(tl.int64) + 2147483648
    hi = tl.max(group_max, 0).to(tl.int64) + 2147483649
    c_lo = tl.sum((valid & (key >= (lo - 2147483648).to(tl.int32))).to(tl.int32), 0)
    c_hi = tl.zeros([], tl.int32)
    while (c_lo > CAP) & (hi - lo > 1):
        mid = (lo + hi) >> 1
        c = tl.sum((key >= (mid - 2147483648).to(tl.int32)).to(tl.int32), 0)
        take = c >= k
        lo = tl.where(take, mid, lo)
        c_lo = tl.where(take, c, c_lo)
        hi = tl.where(take, hi, mid)
        c_hi = tl.where(take, c_hi, c)
    lo = (lo - 2147483648).to(tl.int32)
    # The candidates: every key >= lo. Only when more than CAP keys tie at the k-th score (the search then ended at
    # hi = lo + 1, lo that score): the keys above it and the first k - c_hi ids of the tied ones, i.e. exactly the
    # k winners, found by a search over the ids.
    last = tl.zeros([], tl.int32) + BLOCK  # ids of tied keys up to `last` (exclusive) are candidates
    if c_lo > CAP:
        tied = valid & (key == lo)
        last = tl.zeros([], tl.int32)  # the largest t with fewer than k - c_hi tied ids below t
        for i in tl.static_range(15):  # ids below 2^15 > ROW_SELECT_MAX_CANDIDATES, from the top bit down
            t = last + (1 << (14 - i))
            last = tl.where(tl.sum((tied & (offs < t)).to(tl.int32), 0) < k - c_hi, t, last)
        last += 1
    is_cand = valid & ((key > lo) | ((key == lo) & (offs < last)))
    n_cand = tl.where(c_lo > CAP, k, c_lo)
    # Compaction of the candidates' ids into slots 0 .. n_cand - 1 (their order does not matter: the sort below
    # breaks ties by id): a prefix sum, or on the longest rows (ATOMIC_SLOTS, _row_atomic_slots) a slot per
    # candidate from the row's counter. The prefix sum runs over rows of 32 keys: each row's count, an exclusive sum
    # of the counts, a sum within each row. One block-wide scan of the 4,096 keys ran in the scatter's layout of one
    # key per thread and step (Triton puts the layout change before the scan): ~160 shuffles at 4,096 slots against
    # ~60 this way (sm_90, Triton 3.6). Their keys go into the scratch too only for short rows (KEYS_IN_SCRATCH): on
    # long rows, scattering both holds two address vectors (at 4,096 slots 141 registers against 111 with Triton
    # 3.6, 216 against 80 with 3.8), so there the keys are read back from the score row (just loaded, in cache); on
    # short rows those dependent reads cost more than the registers save (_row_keys_in_scratch).
    ids_at = SCRATCH + row * (2 * CAP)
    if ATOMIC_SLOTS:
        pos = tl.atomic_add(COUNT + row + tl.zeros([BLOCK], tl.int32), 1, mask=is_cand, sem="relaxed")
        tl.store(ids_at + pos, offs, mask=is_cand)
        if KEYS_IN_SCRATCH:
            tl.store(ids_at + CAP + pos, key, mask=is_cand)
    else:
        in_rows = tl.reshape(is_cand.to(tl.int32), [BLOCK // 32, 32])
        per_row = tl.sum(in_rows, 1)
        pos = (tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(in_rows, 1) - 1
        tl.store(ids_at + pos, tl.reshape(offs, [BLOCK // 32, 32]), mask=in_rows != 0)
        if KEYS_IN_SCRATCH:
            tl.store(ids_at + CAP + pos, tl.reshape(key, [BLOCK // 32, 32]), mask=in_rows != 0)
    tl.debug_barrier()
    i = tl.arange(0, CAP)
    i_ok = i < n_cand
    ids = tl.load(ids_at + i, mask=i_ok, other=0)
    if KEYS_IN_SCRATCH:
        keys = tl.load(ids_at + CAP + i, mask=i_ok)
    else:
        keys = _order_key(tl.load(s_row + ids, mask=i_ok, other=0.0))
    # Best first: the key, then the smaller id, as one int64 per candidate (absent slots the smallest; the order of
    # blocks.topk_desc's keys), sorted by a bitonic network (CAP log^2 CAP compare-exchanges). It replaced a pairwise
    # ranking, CAP^2 compares: at 4,096 slots and CAP = 128, ~900 -> ~340 instructions (sm_90, Triton 3.6).
    order = keys.to(tl.int64) * 4294967296 + (4294967295 - ids.to(tl.int64))
    order = tl.sort(tl.where(i_ok, order, -9223372036854775807 - 1), descending=True)
    tl.store(out_row + i, (4294967295 - (order & 4294967295)).to(tl.int32), mask=i < k)


@triton.jit(do_not_specialize=["k", "c", "rows_per_slice"])  # one kernel per (CAP, HEAD_DIM)
def _rescore_kernel(
    S,
    CAND,
    OUT,
    FLAGS,
    Q,
    K,
    K_NORM_MAX,
    n,
    k,
    c,
    rows_per_slice,
    d,
    error,
    CAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The screened selection's second pass, one score row per program: ``CAND`` holds the row's top c ids by
    screened score (``S``, best first). Every exact score is within e = error * ||q|| * max ||k|| of its screened
    one, so when the c-th screened score is below the k-th minus 2e, no key outside the c can reach the exact top
    k (it scores below (k-th screened) - e, which k candidates reach): the row is certified, its c candidates are
    rescored in fp32 and the k best by exact score (ties -> smaller id) written to ``OUT``.
    Otherwise (near-ties at the cut) the row's exact fp32 scores replace the screened ones in ``S`` and ``FLAGS``
    marks it for the plain row kernel."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * n
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row * d + dims, mask=dims < d, other=0.0)
    slice_ = row // rows_per_slice
    k_rows = K + slice_ * n * d
    margin = 2.0 * error * tl.sqrt(tl.sum(q * q, 0)) * tl.load(K_NORM_MAX + slice_)
    i = tl.arange(0, CAP)
    live = i < c
    ids = tl.load(CAND + row * c + i, mask=live, other=0)
    # the k-th and the c-th screened score (two loads: the other candidates' scores are not needed; reading all c
    # to skip the key rows of those that cannot win made the kernel 1.4x slower on the H100, docs/kernel_notes.md
    # v52 (d): one more dependent load per row)
    thr = tl.load(s_row + tl.load(CAND + row * c + k - 1)) - margin  # (the k-th screened score) - 2e
    if tl.load(s_row + tl.load(CAND + row * c + c - 1)) < thr:  # certified (false for a NaN margin)
        kt = tl.load(k_rows + ids[:, None].to(tl.int64) * d + dims[None, :], mask=live[:, None] & (dims < d)[None, :])
        key = tl.where(live, _order_key(tl.sum(kt * q[None, :], 1)), -2147483648)
        # place = how many candidates come first: a higher exact score, or an equal one and a smaller id
        first = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (ids[None, :] < ids[:, None]))
        place = tl.sum((first & live[None, :]).to(tl.int32), 1)
        tl.store(OUT + row * k + place, ids, mask=live & (place < k))
    else:
        for j0 in range(0, n, 32):
            j = j0 + tl.arange(0, 32)
            kt = tl.load(
                k_rows + j[:, None].to(tl.int64) * d + dims[None, :], mask=(j < n)[:, None] & (dims < d)[None, :]
            )
            tl.store(s_row + j, tl.sum(kt * q[None, :], 1), mask=j < n)
        tl.store(FLAGS + row, 1)


def _one_shot_launch(cand: int, d: int) -> dict:
    """``D_CHUNK``, product precision and launch options of a ``_pooled_topk_kernel`` program of 16 rows and ``cand``
    candidate slots. Measured on the H200 (d = 64, docs/kernel_notes.md v25 and v33): the whole-tile FMA product at 4
    warps -> chunks of 16 columns (FMA, one warp, 4 stages) -> the same chunks on the tensor cores in three TF32
    products (one warp, 3 stages). LLSA's 128 children: 152 -> 75 us at 12 x 4,096 rows (v25), then 142 -> 93 us at
    24 x 4,096 (a training step's 4 images at 256²) and 1,031 -> 660 us at 192 x 4,096 (sampling's 32). The 256
    candidates of LLSA's coarsest level at 256² (192 x 256 rows): 158 us (FMA, two warps) -> 95 us (``tf32x3``, four
    warps). One TF32 product (no remainders) was only 1.4x faster again and picked other ids in 0.3% of the rows.
    Wider sets (512 or 1,024 candidates) keep the FMA product at 8 warps (not re-timed)."""
    chunk = {"D_CHUNK": min(_D_CHUNK, d)}
    if cand <= 128:
        return chunk | {"PRECISION": "tf32x3", "num_warps": 1, "num_stages": 3}
    if cand <= 256:
        return chunk | {"PRECISION": "tf32x3", "num_warps": 4, "num_stages": 3}
    return chunk | {"PRECISION": "ieee", "num_warps": 8}


def _row_launch(block: int) -> dict:
    """Launch options of a ``_row_topk_kernel`` program holding a score row of ``block`` slots (also the compile
    report's). Fewer warps per row mean cheaper reductions per search step; measured on the H200 at 4,096 slots: 4
    warps 1.25x faster than 8, 16 warps slower still. At 16,384 slots 8 and 16 warps measured the same, 16 spill
    less. Rows of 4,096 slots (VSA's and SLA's 16-token tiles at 256²) get at most 128 registers, four programs an
    SM: left to itself ptxas (Triton 3.6, sm_90) gives them 128-164 depending on small changes of the source
    (~152 now), capped ~110 without spills; shorter rows need fewer uncapped (56 at 1,024 slots, 96-106 at 2,048),
    which the cap would raise (ptxas fills the budget), and 8,192 would spill under it."""
    if block > 8192:
        return {"num_warps": 16}
    return {"num_warps": 4} | ({"maxnreg": 128} if block == 4096 else {})


def _row_keys_in_scratch(block: int) -> bool:
    """Whether a ``_row_topk_kernel`` program of ``block`` slots compacts its candidates' keys with their ids, or
    reads them back from the score row. Measured on the H200 (ids only vs both): 0.85x at 1,024 slots, 1.2x at
    4,096, 1.07x at 16,384."""
    return block <= 2048


def _row_atomic_slots(block: int) -> bool:
    """Whether a ``_row_topk_kernel`` program of ``block`` slots compacts its candidates through a per-row atomic
    counter instead of a block-wide prefix sum. Measured on the H200 (counter vs prefix sum, docs/kernel_notes.md
    v14): 1.30x at 16,384 slots (16 warps), but 0.69-0.96x at 1,024-4,096 slots (4 warps)."""
    return block > 8192


def _row_cap(k: int) -> int:
    """Candidates a ``_row_topk_kernel`` program sorts (its search stops at this many): twice the power of two >= k,
    at least 32. One compiled variant per value and row length, so a sweep over k compiles four (32, 64, 128,
    256)."""
    return max(32, 2 * next_power_of_2(k))


def _screen_error(d: int) -> float:
    """Bound on |screened - exact fp32 score| / (||q|| * max ||k||) for ``_screened_scores`` at head dim ``d``.

    TF32 keeps 10 of fp32's 23 mantissa bits, so rounding (or truncating) an input moves it by less than u = 2^-10
    of itself and a product by less than (2u + u^2) of itself; summed over d products that is at most
    (2u + u^2) * sum |q_l k_l| <= (2u + u^2) * ||q|| * ||k|| (Cauchy-Schwarz). The fp32 sums of both scores add less
    than d * 2^-23 of the same (tensor-core accumulators may truncate). Doubled, to spare the rounding of the norms
    and of the threshold itself. Measured on the H200 (VSA's pooled rows at 128^2 and 256^2): at most 2.0e-4, the
    bound 3.9e-3 at d = 64."""
    u = 2.0**-10
    return 2.0 * (2 * u + u * u + d * 2.0**-22)


def _rows_topk(scores: torch.Tensor, k: int, out: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
    """Launch ``_row_topk_kernel`` on contiguous fp32 ``scores [R, n]`` into int32 ``out [R, k]`` (``flags``: int32
    ``[R]``, only the rows flagged nonzero)."""
    if scores.dtype != torch.float32:  # the kernel reads the bits of fp32 scores
        raise TypeError(f"_rows_topk: scores must be float32, got {scores.dtype} (computed under autocast?)")
    R, n = scores.shape
    block = max(128, next_power_of_2(n))
    cap = _row_cap(k)
    scratch = torch.empty(R, 2 * cap, device=scores.device, dtype=torch.int32)
    atomic = _row_atomic_slots(block)
    count = torch.zeros(R, device=scores.device, dtype=torch.int32) if atomic else scratch  # (unused: no fill launch)
    _row_topk_kernel[(R,)](
        scores,
        out,
        scratch,
        count,
        scratch if flags is None else flags,
        n,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK=block,
        CAP=cap,
        KEYS_IN_SCRATCH=_row_keys_in_scratch(block),
        ATOMIC_SLOTS=atomic,
        FLAGGED=flags is not None,
        **_row_launch(block),
    )
    return out


def _screen_width(k: int) -> int:
    """How many ids per row, best screened score first, the screened selection passes on to ``_rescore_kernel``: the
    power of two >= k, doubled when that leaves fewer than k / 4 to spare (a row whose c-th screened score is still
    within the margin of the k-th takes the exact path)."""
    c = next_power_of_2(k)
    return 2 * c if 4 * c < 5 * k else c


def _screens(k: int, n: int) -> bool:
    """Whether the two-pass selection of the top ``k`` of ``n`` candidates screens its scores (where it pays)."""
    return n >= _SCREEN_MIN_CANDIDATES and _screen_width(k) <= _SCREEN_MAX_WIDTH


def _rescore_launch(c: int) -> tuple[int, int]:
    """``(CAP, num_warps)`` of a ``_rescore_kernel`` program ranking ``c`` candidates (also the compile report's)."""
    cap = max(16, next_power_of_2(c))
    return cap, 4 if cap <= 64 else 8


def _rows_topk_screened(scores: torch.Tensor, k: int, out: torch.Tensor, q: torch.Tensor, keys: torch.Tensor):
    """The exact top k of each row of screened ``scores [s * r, n]`` (``_screened_scores(q [s, r, d], keys [s, n,
    d])``, contiguous fp32) into int32 ``out [s * r, k]``: the row kernel's top c by screened score, then
    ``_rescore_kernel``, then the row kernel again on the rows it flagged (their ``scores`` rows now exact)."""
    R, n = scores.shape
    _, r, d = q.shape
    c = min(_screen_width(k), n)
    cand = _rows_topk(scores, c, torch.empty(R, c, device=scores.device, dtype=torch.int32))
    flags = torch.zeros(R, device=scores.device, dtype=torch.int32)
    cap, warps = _rescore_launch(c)
    _rescore_kernel[(R,)](
        scores,
        cand,
        out,
        flags,
        q,
        keys,
        keys.norm(dim=-1).amax(-1),  # each slice's largest key norm
        n,
        k,
        c,
        r,
        d,
        _screen_error(d),
        CAP=cap,
        HEAD_DIM=max(16, next_power_of_2(d)),
        num_warps=warps,
    )
    return _rows_topk(scores, k, out, flags=flags)


def _streaming_topk(qf, kf, k, out, rows_per_program=_STREAM_ROWS):
    """Launch ``_streaming_topk_kernel`` on contiguous fp32 ``[BH, R, d]`` / ``[BH, C, d]`` into int32 ``out``
    (``rows_per_program`` is a knob for scripts/bench_topk.py)."""
    BH, R, d = qf.shape
    _streaming_topk_kernel[(cdiv(R, rows_per_program), BH)](
        qf,
        kf,
        out,
        R,
        kf.shape[1],
        k,
        qf.stride(0),
        kf.stride(0),
        out.stride(0),
        HEAD_DIM=d,
        ROWS=rows_per_program,
        CHUNK=_STREAM_CHUNK,
        SLOTS=max(_STREAM_MIN_SLOTS, next_power_of_2(k)),
        num_warps=4,
    )
    return out


def _route(n_cand: int, d: int, k: int, child_block: int | None) -> str:
    """Which path ``pooled_topk`` runs on the GPU: "one_shot", "two_pass", "streaming" or "torch" (module doc)."""
    cand = max(16, next_power_of_2(n_cand))
    if cand <= MAX_CANDIDATES and cand * d <= _MAX_CAND_X_DIM and (child_block is None or child_block % _ROWS == 0):
        return "one_shot" if child_block is not None or k < n_cand else "torch"
    if child_block is None and k < n_cand:
        if n_cand <= ROW_SELECT_MAX_CANDIDATES and k <= ROW_SELECT_MAX_K:
            return "two_pass"
        if k <= STREAM_MAX_K:
            return "streaming"
    return "torch"  # includes k = n_cand without parents: every candidate selected, only their order is left


def pooled_topk(
    q_pooled: torch.Tensor,
    k_pooled: torch.Tensor,
    k: int,
    parents: torch.Tensor | None = None,
    child_block: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Top-k candidate key ids per pooled query row (see module doc).

    q_pooled: fp32 ``[..., R, d]``; k_pooled: fp32 ``[..., C, d]``. Without ``parents`` every key row is a
    candidate. With ``parents`` (int ``[..., R // child_block, P]``) row r's candidates are the ``child_block``
    children ``p * child_block + j`` of each ``p`` in ``parents[..., r // child_block, :]``. ``k``: 1 to the number
    of candidates. Returns int32 ``[..., R, k]``. ``impl``: "auto" (Triton on CUDA), "triton", "torch".
    """
    n_cand = k_pooled.shape[-2] if parents is None else parents.shape[-1] * child_block
    if isinstance(k, bool) or int(k) != k or not 1 <= k <= n_cand:
        raise ValueError(f"pooled_topk: k must be an int in [1, {n_cand}] (the number of candidates), got {k!r}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"pooled_topk: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return _pooled_topk_op(q_pooled, k_pooled, int(k), parents, child_block or 0, impl)


# One opaque op for every path: torch.compile traces around the selection, not into its kernels and host logic.
@custom_op("pooled_topk")
def _pooled_topk_op(
    q_pooled: torch.Tensor, k_pooled: torch.Tensor, k: int, parents: torch.Tensor | None, child_block: int, impl: str
) -> torch.Tensor:
    lead = q_pooled.shape[:-2]
    R, d = q_pooled.shape[-2:]
    n_cand = k_pooled.shape[-2] if parents is None else parents.shape[-1] * child_block
    use_triton = (impl == "triton" or (impl == "auto" and q_pooled.is_cuda)) and d >= 16
    path = _route(n_cand, d, k, child_block if parents is not None else None) if use_triton else "torch"
    if path == "torch":
        return _pooled_topk_torch(q_pooled, k_pooled, k, parents, child_block)
    if path == "two_pass":  # screened scores by cuBLAS, a chunk at a time, then the row-select kernel
        return _all_candidates_two_pass(q_pooled.float(), k_pooled.float(), k)
    qf = q_pooled.float().reshape(-1, R, d).contiguous()
    kf = k_pooled.float().reshape(-1, k_pooled.shape[-2], d).contiguous()
    BH = qf.shape[0]
    out = torch.empty(BH, R, k, device=qf.device, dtype=torch.int32)
    if path == "one_shot":
        cand = max(16, next_power_of_2(n_cand))
        par = parents.reshape(BH, -1).to(torch.int32).contiguous() if parents is not None else out
        _pooled_topk_kernel[(cdiv(R, _ROWS), BH)](
            qf,
            kf,
            par,
            out,
            R,
            n_cand,
            k,
            qf.stride(0),
            kf.stride(0),
            par.stride(0),
            out.stride(0),
            HEAD_DIM=d,
            ROWS=_ROWS,
            CAND=cand,
            CHILD=child_block or 0,
            N_PARENTS=parents.shape[-1] if parents is not None else 1,
            **_one_shot_launch(cand, d),
        )
    else:
        _streaming_topk(qf, kf, k, out)
    return out.view(*lead, R, k)


@_pooled_topk_op.register_fake
def _(q_pooled, k_pooled, k, parents, child_block, impl):
    return q_pooled.new_empty((*q_pooled.shape[:-1], k), dtype=torch.int32)


def topk_desc_fast(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Same result as ``blocks.topk_desc`` (descending score, ties toward the smaller id), cheaper on long rows.

    One ``torch.topk`` of ``k + 1`` on the fp32 scores: where the (k+1)-th value is below the k-th, the set of the k
    winners is unambiguous and only their order needs fixing (a small exact sort); rows where a tie straddles the
    threshold are redone with ``topk_desc`` (exact, 64-bit keys).
    """
    n = scores.shape[-1]
    values, ids = torch.topk(scores, min(k + 1, n), dim=-1, sorted=True)
    order = topk_desc(values[..., :k], k, ids[..., :k])  # exact order of the k winners (ids distinct)
    if k < n:
        ambiguous = values[..., k] == values[..., k - 1]  # [rows] (-0.0 == +0.0 counts as a tie)
        if ambiguous.any():
            order[ambiguous] = topk_desc(scores[ambiguous], k)
    return order


def _pooled_topk_torch(q_pooled, k_pooled, k, parents, child_block):
    """Same selection with torch ops (fp32 matmul without TF32); memory O(R * candidates) per chunk."""
    qf, kf = q_pooled.float(), k_pooled.float()
    with exact_fp32_matmul():
        if parents is None:
            return _all_candidates_torch(qf, kf, k)
        return _children_torch(qf, kf, k, parents, child_block)


def _score_chunks(qf, kf, out):
    """The ``[R, C]`` score problem of every key row a candidate, cut into chunks of at most ``_TORCH_MAX_SCORES``
    scores: yields ``(q [s, r, d], keys [s, C, d], out [s, r, k])`` views, whole (batch * head) slices when they
    fit, else rows of one slice."""
    R, d = qf.shape[-2:]
    q_rows, k_rows = qf.reshape(-1, R, d), kf.reshape(-1, kf.shape[-2], d)
    out = out.view(-1, R, out.shape[-1])
    n = k_rows.shape[1]
    slices_per_chunk = _TORCH_MAX_SCORES // (R * n)
    if slices_per_chunk >= 1:
        for i in range(0, q_rows.shape[0], slices_per_chunk):
            yield tuple(x[i : i + slices_per_chunk] for x in (q_rows, k_rows, out))
    else:  # split the rows of each slice too
        rows_per_chunk = max(1, _TORCH_MAX_SCORES // n)
        for i in range(q_rows.shape[0]):
            for r in range(0, R, rows_per_chunk):
                yield (
                    q_rows[i : i + 1, r : r + rows_per_chunk],
                    k_rows[i : i + 1],
                    out[i : i + 1, r : r + rows_per_chunk],
                )


def _all_candidates_torch(qf, kf, k, select=topk_desc_fast):
    """Every key row a candidate: each chunk's fp32 scores (``_score_chunks``), its top k by ``select(scores, k)``."""
    out = torch.empty(*qf.shape[:-1], k, dtype=torch.int32, device=qf.device)
    for q, keys, o in _score_chunks(qf, kf, out):
        o.copy_(select(q @ keys.transpose(-1, -2), k))
    return out


def _screened_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q @ keys^T`` on the tensor cores (TF32 inputs, fp32 sums): ~3x faster than fp32 FFMA on the H200, within
    ``_screen_error(d) * ||q|| * max ||k||`` of the exact scores."""
    with fp32_matmul("high"):
        return q @ keys.transpose(-1, -2)


def _all_candidates_two_pass(qf, kf, k):
    """The two-pass selection (module doc): each chunk's scores, screened (``_screened_scores``) where
    ``_screens`` says it pays, else exact fp32, then the row kernel (``_rows_topk_screened`` / ``_rows_topk``)."""
    out = torch.empty(*qf.shape[:-1], k, dtype=torch.int32, device=qf.device)
    n = kf.shape[-2]
    screens = _screens(k, n)
    for q, keys, o in _score_chunks(qf, kf, out):
        q, keys = q.contiguous(), keys.contiguous()
        if screens:
            _rows_topk_screened(_screened_scores(q, keys).view(-1, n), k, o.view(-1, k), q, keys)
        else:
            with exact_fp32_matmul():
                _rows_topk((q @ keys.transpose(-1, -2)).view(-1, n), k, o.view(-1, k))
    return out


def _children_torch(qf, kf, k, parents, child_block):
    B = child_block
    lead = parents.shape[:-2]
    groups, n_par = parents.shape[-2:]
    d = kf.shape[-1]
    cand = (parents.long()[..., None] * B + torch.arange(B, device=parents.device)).flatten(-2)  # [.., G, P*B]
    kc = torch.gather(kf.reshape(-1, kf.shape[-2], d), 1, cand.reshape(-1, groups * n_par * B, 1).expand(-1, -1, d))
    kc = kc.view(*lead, groups, n_par * B, d)
    scores = qf.view(*lead, groups, B, d) @ kc.transpose(-1, -2)  # [.., G, B, P*B]
    sel = topk_desc(scores, k, ids=cand[..., None, :].expand_as(scores))
    return sel.reshape(*lead, groups * B, k)
