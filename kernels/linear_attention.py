"""SLA's linear-attention branch (docs/algorithms.md, "SLA"): feature maps, exact and Triton forms.

For a query ``t`` in query block ``i``, with ``w_tu = phi(q_t) . phi(k_u)`` and ``L(i)`` the keys of its linear set:

    O_l[t] = sum_{u in L(i)} w_tu v_u / sum_{u in L(i)} w_tu

``linear_scope="all"``: ``L`` = every key, ``+1e-5`` in the denominator (the authors' current code): two global sums
``sum_u phi(k_u) v_u^T`` (D x D) and ``sum_u phi(k_u)``, ``O(N * D^2)``. Otherwise ``L(i)`` = all keys minus the
excluded blocks ``E(i)`` (critical, and in ``marginal`` scope also negligible), and a row whose denominator is 0
(empty linear set, or relu features that vanish on it) gets ``O_l = 0`` (never the authors' 0/0 = NaN).

Two forms:

* ``linear_attention_torch`` (CPU, exact): per-block ``h_j = phi(K_j)^T V_j`` summed over the kept blocks with a
  ``[T, T]`` block mask (direct sums, no cancellation; ``O(T^2 D^2)``, fine at CPU sizes).
* Triton (CUDA; CPU under ``TRITON_INTERPRET=1``): ``global sums - excluded part``; SLA's kernels
  (``sla_triton.py``) run these pieces and walk the critical lists once for both branches, in the forward, the dq
  and the dk/dv. ``linear_scope="all"`` skips the walks (no excluded part, ``+1e-5`` instead of the empty-row rule).

  * ``_feature_sums_kernel`` (``feature_sums``): forward, ``phi(k)`` (stored once, input dtype) and per chunk of
    1024 keys the partial ``sum phi(k_u) v_u^T`` (D x D) and ``sum phi(k_u)``; backward, the gradients of the two
    global sums, ``sum (phi(q_t)/den_t)^T dO_t`` and ``sum phi(q_t) (-delta_t/den_t)``. The partials are added by
    ``torch.sum`` (fixed order: deterministic, no atomics, and N / 1024 programs per head instead of one).
  * for SLA's forward walk: ``phi(q)`` (``phi_rows``: fp32 math, one rounding to the input dtype, stored for the
    backward) and the global term ``phi(q) . [KV_total | Z_total]`` (``rows_times_sums`` of the stored ``phi(q)``:
    the D x D sums in slices) as fp32 start values from which the walk subtracts ``sum_{u in E(i)} w_tu (v_u, 1)``
    (``excluded_fwd_step``: two tensor-core dots per block, like the sparse branch without exponentials); then the
    empty-row rule, ``o_linear`` in the input dtype with fp32 ``1/den`` per row (0 for an empty row); without
    exclusion, ``o_linear = num / (den + 1e-5)``.
  * for SLA's dq walk: ``delta`` and the global part of ``dphi(q)`` (``rows_times_sums`` again) as start values,
    minus ``excluded_dq_step`` per block; then ``dq`` through phi's Jacobian (``phi_rows_backward``).
  * for SLA's dk/dv kernel (key-major over the CSC transpose of the lists, ``blocks.csr_to_csc``):
    ``global_dkdv_start`` (the global terms as fp32 start values) and ``excluded_dkdv_step`` (minus the excluded
    pairs); then ``dk`` through phi's Jacobian. One writer per gradient row.

  The lists are the same ``K`` (+ negligible) blocks as the sparse branch, so the cost is ``O(N * K * block * D)``,
  the same order as the sparse branch, instead of the ``O(T * K * D^2)`` reads of materialised ``h_j`` blocks (4x
  more at block 16, D = 64) or the ``O(T^2 D^2)`` mask product. Precision: dots of input-dtype operands accumulate
  in fp32; the denominators and the subtraction are fp32; products with ``1/den`` use fp32 operands (tf32 for fp16
  inputs: ``phi(q)/den`` can leave fp16's range), or bf16 ones in the dk/dv walk for bf16 inputs. A row whose
  remaining denominator is at most ``1e-5`` of its full one is treated as empty (fp32 rounding level of the
  subtraction): ``o_linear = 0``, zero gradient.

Tests: ``tests/kernels/test_sla.py`` (exact form), ``tests/kernels/test_sla_triton.py`` (Triton form):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_sla.py tests/kernels/test_sla_triton.py
    python -m pytest tests/kernels/test_sla_triton.py -m gpu        # CUDA machine: bf16/fp16 at real sizes
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .block_sparse import (
    dot_precision,
    program_warps,
    walk_blocks_per_step,
)
from .common import AUTOTUNE, pad_to_blocks
from .ops import cdiv, custom_op

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
    if n % chunk:  # zero rows add nothing to the sums
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
    phi_q_blocks = pad_to_blocks(phi_q, block_size)  # [B, H, T, C, D]
    phi_k_blocks = pad_to_blocks(phi_k, block_size)  # padded keys are 0 after phi
    t = phi_q_blocks.shape[2]
    kv_blocks = (phi_k_blocks.transpose(-1, -2) @ pad_to_blocks(v.float(), block_size)).reshape(b, h, t, d * d)
    kept = torch.ones(b, h, t, t, dtype=torch.bool, device=q.device)
    kept.scatter_(-1, excluded_idx.long(), False)
    kept = kept.float()  # [B, H, T, T] block mask
    numerator = phi_q_blocks @ (kept @ kv_blocks).reshape(b, h, t, d, d)  # phi(q) . H_i
    denominator = phi_q_blocks @ (kept @ phi_k_blocks.sum(3))[..., None]  # phi(q) . Z_i
    out = safe_divide(numerator, denominator, denominator != 0)
    return out.reshape(b, h, t * block_size, d)[:, :, :n]


# ----------------------------------------------------------------------------------------------------------------------
# Triton: the feature map, the global terms' start values and the linear steps of SLA's walks (sla_triton.py), and a
# chunked reduction for the two global sums (forward) and their gradients (backward). Layout: q, k, v, o, dO as
# [B*H, N, D] contiguous.


@triton.jit
def phi_rows(x, row_ok, FEATURE: tl.constexpr):
    """The feature map along the last axis of an fp32 ``[rows, D]`` tile; rows with ``row_ok`` false give 0
    (the masked tail of a partial block: softmax would give 1/D there)."""
    if FEATURE == "softmax":
        e = tl.exp(x - tl.max(x, 1)[:, None])
        a = e / tl.sum(e, 1)[:, None]
    elif FEATURE == "elu":
        a = tl.where(x > 0, x + 1.0, tl.exp(x))  # elu(x) + 1 = exp(x) for x <= 0
    else:
        a = tl.maximum(x, 0.0)
    return tl.where(row_ok[:, None], a, 0.0)


@triton.jit
def rows_times_sums(
    X,
    row_start,
    row_ok,
    S,
    stride_si,
    stride_sj,
    acc,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):
    """``acc + x @ S`` in fp32 for the rows of ``X`` starting at ``row_start`` (``[rows]`` offsets, ``row_ok``)
    and a D x D fp32 matrix ``S`` (element (i, j) at ``i * stride_si + j * stride_sj``: a transposed one is read
    in place; a transposed copy read by rows measured slower, 1.67 against 1.61 ms for SLA's dq at 256^2 on an H100,
    and spilled in the dk/dv), one ``CHUNK``-column slice of the rows (and ``CHUNK``-row slice of S) at a time, so
    that a one-warp program never holds all of S (128 registers at D = 64)."""
    dims = tl.arange(0, HEAD_DIM)
    for c in tl.static_range(0, HEAD_DIM, CHUNK):
        cols = c + tl.arange(0, CHUNK)
        x = tl.load(X + row_start[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
        s_rows = tl.load(S + cols[:, None] * stride_si + dims[None, :] * stride_sj)
        acc = tl.dot(x.to(tl.float32), s_rows, acc, input_precision=PREC)
    return acc


@triton.jit
def phi_rows_backward(x, a, da, FEATURE: tl.constexpr):
    """``d/dx`` of the feature map applied to the gradient ``da``, given ``a = phi(x)`` (fp32, unrounded)."""
    if FEATURE == "softmax":
        dx = a * (da - tl.sum(da * a, 1)[:, None])
    elif FEATURE == "elu":
        dx = tl.where(x > 0, da, da * a)
    else:
        dx = tl.where(x > 0, da, 0.0)
    return dx


@triton.jit
def _feature_sums_kernel(
    X,
    Y,
    PHI,
    INV_DEN,
    DELTA,
    OUTER,
    TOTAL,
    n,
    chunk,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
    FEATURE: tl.constexpr,
    BACKWARD: tl.constexpr,
    PREC: tl.constexpr,
):
    # One partial sum per (chunk of rows, batch*head); the caller adds the partials (fixed order: deterministic).
    #   forward  (X = k, Y = v): PHI = phi(k) in the input dtype (read by the list walks),
    #                            OUTER = sum_u phi(k_u)^T v_u,  TOTAL = sum_u phi(k_u)
    #   backward (X = phi(q), Y = dO):
    #                            OUTER = sum_t (phi(q_t) / den_t)^T dO_t,  TOTAL = sum_t phi(q_t) (-delta_t / den_t)
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    base = bh * n * HEAD_DIM
    outer = tl.zeros([HEAD_DIM, HEAD_DIM], tl.float32)
    total = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(0, chunk, TILE):
        rows = c.to(tl.int64) * chunk + start + tl.arange(0, TILE)
        ok = rows < n
        y = tl.load(Y + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
        if BACKWARD:
            # phi(q) loaded transposed [D, TILE] (no tl.trans of a 32-bit dot operand); fp32 operands (tf32 for half
            # inputs): phi(q) / den can leave fp16's range
            at = tl.load(X + base + rows[None, :] * HEAD_DIM + dims[:, None], mask=ok[None, :], other=0.0)
            inv_den = tl.load(INV_DEN + bh * n + rows, mask=ok, other=0.0)
            delta = tl.load(DELTA + bh * n + rows, mask=ok, other=0.0)
            at = at.to(tl.float32)
            outer += tl.dot(at * inv_den[None, :], y.to(tl.float32), input_precision=PREC)
            total += tl.sum(at * (-delta * inv_den)[None, :], 1)
        else:
            x = tl.load(X + base + rows[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
            a = phi_rows(x.to(tl.float32), ok, FEATURE).to(x.dtype)  # one rounding, stored for the walks
            tl.store(PHI + base + rows[:, None] * HEAD_DIM + dims[None, :], a, mask=ok[:, None])
            outer += tl.dot(tl.trans(a), y, input_precision=PREC)
            total += tl.sum(a.to(tl.float32), 0)
    part = bh * tl.num_programs(0) + c
    tl.store(OUTER + part * HEAD_DIM * HEAD_DIM + dims[:, None] * HEAD_DIM + dims[None, :], outer)
    tl.store(TOTAL + part * HEAD_DIM + dims, total)


@triton.jit
def excluded_dq_step(do, delta, b, v, k_ok, acc, PREC: tl.constexpr):
    """One step of dq's excluded part: ``acc -= (dO v^T - delta) phi(k)`` over the step's keys."""
    dw = tl.dot(do, tl.trans(v), input_precision=PREC) - delta[:, None]
    # (phi(k) = 0 on missing keys already; the explicit mask also takes ptxas from 254 to 164 registers)
    dw = tl.where(k_ok[None, :], dw, 0.0)
    return tl.dot((-dw).to(b.dtype), b, acc, input_precision=PREC)


@triton.jit
def excluded_fwd_step(a, b, v, listed, num, den, PREC: tl.constexpr):
    """One step of the forward's excluded part: ``w = phi(q) phi(k)^T`` of the step's keys (zero unless ``listed``,
    the step's list slot names a block), ``num += w v``, ``den += sum w``."""
    w = tl.dot(a, tl.trans(b), input_precision=PREC)  # [rows, keys]
    w = tl.where(listed, w, 0.0)
    den += tl.sum(w, 1)
    num = tl.dot((-w).to(v.dtype), v, num, input_precision=PREC)
    return num, den


@triton.jit
def excluded_dkdv_step(
    PHI_Q,
    DO,
    INV_DEN,
    DELTA,
    query_offsets,
    row_base,
    rows,
    r_ok,
    b,
    v,
    dphi,
    dv,
    SCALED_DTYPE: tl.constexpr,
    PREC: tl.constexpr,
):
    """One step of the key-major dk/dv's excluded part over one query block (keys in M): loads the block's ``a =
    phi(q)``, ``dO`` (at ``query_offsets``), ``1/den`` and ``delta`` (rows ``rows`` from ``row_base``; all 0 on rows
    outside ``r_ok``), then ``dphi(k) -= (v dO^T - delta) / den . a`` and ``dv -= (phi(k) a^T / den) dO``. The
    ``1/den``-scaled weights can leave fp16's range: ``SCALED_DTYPE`` operands (bf16 for bf16 inputs, else fp32 with
    tf32 products)."""
    a = tl.load(PHI_Q + query_offsets, mask=r_ok[:, None], other=0.0)
    do = tl.load(DO + query_offsets, mask=r_ok[:, None], other=0.0)
    inv_den = tl.load(INV_DEN + row_base + rows, mask=r_ok, other=0.0)
    delta = tl.load(DELTA + row_base + rows, mask=r_ok, other=0.0)
    wt = tl.dot(b, tl.trans(a), input_precision=PREC) * inv_den[None, :]
    dwt = (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :]) * inv_den[None, :]
    dphi -= tl.dot(dwt.to(SCALED_DTYPE), a.to(SCALED_DTYPE), input_precision=PREC)
    dv -= tl.dot(wt.to(SCALED_DTYPE), do.to(SCALED_DTYPE), input_precision=PREC)
    return dphi, dv


@triton.jit
def global_dkdv_start(
    V,
    PHI_K,
    D_KV_TOTAL,
    D_Z_TOTAL,
    bh,
    key_rows,
    k_ok,
    n,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    PREC: tl.constexpr,
):
    """The global part of the key-major dk/dv for the ``ROWS`` key rows ``key_rows`` of head ``bh`` of ``[BH, n,
    D]`` inputs (the walk's fp32 start values): ``dphi(k) = v d_KV^T + d_Z`` and ``dv = phi(k) d_KV``, in slices
    (``rows_times_sums``)."""
    d_kv = D_KV_TOTAL + bh * HEAD_DIM * HEAD_DIM
    row_start = bh * n * HEAD_DIM + key_rows * HEAD_DIM
    d_z = tl.load(D_Z_TOTAL + bh * HEAD_DIM + tl.arange(0, HEAD_DIM))
    dphi = tl.zeros([ROWS, HEAD_DIM], tl.float32) + d_z[None, :]
    dphi = rows_times_sums(V, row_start, k_ok, d_kv, 1, HEAD_DIM, dphi, HEAD_DIM, CHUNK, PREC)  # d_KV^T
    dv = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    dv = rows_times_sums(PHI_K, row_start, k_ok, d_kv, HEAD_DIM, 1, dv, HEAD_DIM, CHUNK, PREC)
    return dphi, dv


@triton.jit
def row_tile(n, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The program's tile of ``ROWS`` rows (grid ``(tiles, batch * heads)``) of a ``[BH, n, HEAD_DIM]`` tensor:
    ``(bh, rows, row_ok, offsets)``."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = bh * n * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    return bh, rows, rows < n, offsets


SUM_CHUNK = 1024  # rows per partial of the global sums: N / 1024 programs per head instead of one
SUM_TILE = 64


def feature_sums(x, y, feature_map_name, inv_den=None, delta=None):
    """Deterministic chunked sums in fp32. Forward (x = k, y = v): ``(phi(k), sum phi(k)^T v [BH, D, D],
    sum phi(k) [BH, D])``. Backward (x = phi(q), y = dO, per-row ``1/den`` and ``delta``): the gradients of the two
    global sums, ``(None, sum (phi(q)/den)^T dO, sum phi(q) (-delta/den))``."""
    bh, n, d = x.shape
    chunk = min(SUM_CHUNK, cdiv(n, SUM_TILE) * SUM_TILE)
    chunks = cdiv(n, chunk)
    outer = torch.empty(bh, chunks, d, d, device=x.device, dtype=torch.float32)
    total = torch.empty(bh, chunks, d, device=x.device, dtype=torch.float32)
    backward = inv_den is not None
    phi = None if backward else torch.empty_like(x)
    _feature_sums_kernel[(chunks, bh)](
        x,
        y,
        x if backward else phi,
        inv_den if backward else x,
        delta if backward else x,
        outer,
        total,
        n,
        chunk,
        HEAD_DIM=d,
        TILE=SUM_TILE,
        FEATURE=feature_map_name,
        BACKWARD=backward,
        PREC=dot_precision(x.dtype),
        num_warps=walk_warps(d),
    )
    return phi, outer.sum(1), total.sum(1)


def walk_warps(head_dim: int) -> int:
    return 4 if head_dim <= 64 else 8  # D x D fp32 tiles in registers


# The list-walking kernels (SLA's forward, dq and dk/dv walks) are autotuned on the GPU
# (common.AUTOTUNE), like the block-sparse ones: a 16-row (or 16-key) program (head_dim <= 64) on one warp, one listed
# block per step, once the D x D products are start values (docs/kernel_notes.md v24, v49); other blocks on
# walk_warps(head_dim) warps.
WALK_CONFIGS = [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))]
WALK_KEYS = ["HEAD_DIM", "BLOCK", "PER_ITER", "FEATURE", "EXCLUDE", "PREC"]
ONE_WARP_CONFIGS = [triton.Config({}, num_warps=1, num_stages=s) for s in (2, 3, 4)]


def one_warp_walk(block_size: int, head_dim: int) -> bool:
    """Whether a query-major walk of ``block_size``-row programs runs on one warp (``block_sparse.program_warps``)."""
    return program_warps(block_size, False, head_dim) == 1


def prune_query_walk(configs, named_args, **kwargs):
    """The autotuner's pruning for the walks: the one-warp configurations or the others."""
    meta = {**named_args, **kwargs}
    one_warp = one_warp_walk(meta["BLOCK"], meta["HEAD_DIM"])
    return [c for c in configs if (c.num_warps == 1) == one_warp]


def query_walk_options(head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    """Constexprs and launch options of a query-major walk from start values (the forward and SLA's dq): a 16-row
    program (``one_warp_walk``) on one warp, one listed block per step, 3 stages when not autotuned (at 256^2, K =
    32: the forward walk 0.66 ms against 1.23 for 4 warps gathering 4 blocks per step; SLA's dq 1.63 against 1.97,
    3 stages 0.17 ms less than 2; docs/kernel_notes.md v24). Other blocks keep the other walks' launch."""
    one_warp = one_warp_walk(block_size, head_dim)
    if AUTOTUNE:
        launch = {}
    else:
        launch = {"num_warps": 1, "num_stages": 3} if one_warp else {"num_warps": walk_warps(head_dim)}
    per_iter = walk_blocks_per_step(block_size, block_size, head_dim)  # one block per step on one warp
    return dict(HEAD_DIM=head_dim, BLOCK=block_size, PER_ITER=per_iter, PREC=dot_precision(dtype), **launch)


@custom_op("linear_global_grads")
def linear_global_grads(
    phi_q: torch.Tensor, do: torch.Tensor, feature_map_name: str, inv_den: torch.Tensor, delta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the two global sums, ``(d KV_total [BH, D, D], d Z_total [BH, D])`` (``feature_sums``'
    backward form)."""
    _, d_kv_total, d_z_total = feature_sums(phi_q, do, feature_map_name, inv_den, delta)
    return d_kv_total, d_z_total


@linear_global_grads.register_fake
def _(phi_q, do, feature_map_name, inv_den, delta):
    bh, _, d = phi_q.shape
    return phi_q.new_empty((bh, d, d), dtype=torch.float32), phi_q.new_empty((bh, d), dtype=torch.float32)
