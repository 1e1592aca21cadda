"""Fused pooled-score top-k in Triton: scores of pooled queries against candidate pooled keys + an exact top-k, one
launch (shared by LLSA's selection levels; VSA/SLA's single-level selection can use ``pooled_topk`` as is).

    from pixdit.kernels.topk import pooled_topk
    idx = pooled_topk(q_pooled, k_pooled, k=8)                              # candidates: every key row
    idx = pooled_topk(q_pooled, k_pooled, k=8, parents=I2, child_block=16)  # candidates: children of I2[r // 16]

Semantics = ``blocks.topk_desc`` on fp32 scores ``<q_r, k_c>`` (no scale): descending score, ties -> smaller id,
deterministic. The Triton kernel computes the scores with fp32 FMA (``input_precision="ieee"``) and picks the top
k by k rounds of (row max, smallest id reaching it, remove it); rows with more than ``MAX_CANDIDATES`` candidates
(or a ``[d, candidates]`` tile over 128 KiB) fall back to a PyTorch matmul + ``topk_desc``. Summation order differs between the two paths, so on near-ties
(differences ~1e-7 relative) they may pick different ids; both are exact fp32 selections.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import exact_fp32_matmul, topk_desc

__all__ = ["pooled_topk", "MAX_CANDIDATES"]

MAX_CANDIDATES = 1024
_MAX_CAND_X_DIM = 32768   # the [d, candidates] fp32 key tile goes through shared memory: <= 128 KiB
_ROWS = 16


@triton.jit
def _pooled_topk_kernel(QP, KP, PAR, OUT, n_rows, n_cand, stride_qb, stride_kb, stride_pb, stride_ob,
                        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, CAND: tl.constexpr, TOPK: tl.constexpr,
                        CHILD: tl.constexpr, N_PARENTS: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    dims = tl.arange(0, HEAD_DIM)
    qp = tl.load(QP + bh * stride_qb + rows[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None], other=0.0)
    c = tl.arange(0, CAND)
    if CHILD > 0:   # the ROWS rows lie in one parent group (ROWS divides CHILD): shared candidate set
        grp = (pid * ROWS) // CHILD
        par = tl.load(PAR + bh * stride_pb + grp * N_PARENTS + c // CHILD, mask=c < N_PARENTS * CHILD, other=-1)
        ids = par * CHILD + c % CHILD
        ok = par >= 0
    else:
        ids = c
        ok = c < n_cand
    kt = tl.load(KP + bh * stride_kb + ids[None, :].to(tl.int64) * HEAD_DIM + dims[:, None], mask=ok[None, :],
                 other=0.0)
    s = tl.dot(qp, kt, input_precision="ieee")
    s = tl.where(ok[None, :], s, float("-inf"))
    big = 2147483647
    out_base = OUT + bh * stride_ob + rows * TOPK
    for i in tl.static_range(TOPK):
        m = tl.max(s, 1)
        sel = tl.min(tl.where(s == m[:, None], ids[None, :], big), 1)
        tl.store(out_base + i, sel, mask=row_ok)
        s = tl.where(ids[None, :] == sel[:, None], float("-inf"), s)


def pooled_topk(q_pooled: torch.Tensor, k_pooled: torch.Tensor, k: int, parents: torch.Tensor | None = None,
                child_block: int | None = None, impl: str = "auto") -> torch.Tensor:
    """Top-k candidate key ids per pooled query row (see module doc).

    q_pooled: fp32 ``[..., R, d]``; k_pooled: fp32 ``[..., C, d]``. Without ``parents`` every key row is a
    candidate. With ``parents`` (int ``[..., R // child_block, P]``) row r's candidates are the ``child_block``
    children ``p * child_block + j`` of each ``p`` in ``parents[..., r // child_block, :]``. Returns int32
    ``[..., R, k]``. ``impl``: "auto" (Triton on CUDA), "triton", "torch".
    """
    lead = q_pooled.shape[:-2]
    R, d = q_pooled.shape[-2:]
    n_cand = k_pooled.shape[-2] if parents is None else parents.shape[-1] * child_block
    use_triton = impl == "triton" or (impl == "auto" and q_pooled.is_cuda)
    cand = max(16, triton.next_power_of_2(n_cand))
    if (not use_triton or cand > MAX_CANDIDATES or cand * d > _MAX_CAND_X_DIM or d < 16
            or (parents is not None and child_block % _ROWS)):
        return _pooled_topk_torch(q_pooled, k_pooled, k, parents, child_block)
    qf = q_pooled.float().reshape(-1, R, d).contiguous()
    kf = k_pooled.float().reshape(-1, k_pooled.shape[-2], d).contiguous()
    BH = qf.shape[0]
    out = torch.empty(BH, R, k, device=qf.device, dtype=torch.int32)
    par = parents.reshape(BH, -1).to(torch.int32).contiguous() if parents is not None else out
    _pooled_topk_kernel[(triton.cdiv(R, _ROWS), BH)](
        qf, kf, par, out, R, n_cand, qf.stride(0), kf.stride(0), par.stride(0), out.stride(0),
        HEAD_DIM=d, ROWS=_ROWS, CAND=cand, TOPK=k, CHILD=child_block or 0,
        N_PARENTS=parents.shape[-1] if parents is not None else 1, num_warps=4 if cand <= 256 else 8)
    return out.view(*lead, R, k)


def _pooled_topk_torch(q_pooled, k_pooled, k, parents, child_block):
    """Same selection with torch ops (fp32 matmul without TF32 + topk_desc); memory O(R * candidates)."""
    qf, kf = q_pooled.float(), k_pooled.float()
    with exact_fp32_matmul():
        return _pooled_topk_torch_impl(qf, kf, k, parents, child_block)


def _pooled_topk_torch_impl(qf, kf, k, parents, child_block):
    if parents is None:
        n = kf.shape[-2]
        rows_per_chunk = max(1, (1 << 26) // max(1, n * qf[..., :1, :1].numel()))
        parts = [topk_desc(qf[..., r0:r0 + rows_per_chunk, :] @ kf.transpose(-1, -2), k)
                 for r0 in range(0, qf.shape[-2], rows_per_chunk)]
        return torch.cat(parts, dim=-2)
    B = child_block
    lead = parents.shape[:-2]
    groups, n_par = parents.shape[-2:]
    d = kf.shape[-1]
    cand = (parents.long()[..., None] * B + torch.arange(B, device=parents.device)).flatten(-2)   # [.., G, P*B]
    kc = torch.gather(kf.reshape(-1, kf.shape[-2], d), 1, cand.reshape(-1, groups * n_par * B, 1).expand(-1, -1, d))
    kc = kc.view(*lead, groups, n_par * B, d)
    scores = qf.view(*lead, groups, B, d) @ kc.transpose(-1, -2)                                  # [.., G, B, P*B]
    sel = topk_desc(scores, k, ids=cand[..., None, :].expand_as(scores))
    return sel.reshape(*lead, groups * B, k)
