"""Dense PyTorch oracle of LLSA (docs/algorithms.md, "LLSA"): small N only, O(N^2) memory. Tests and diagnostics only.

    from pixdit.kernels.reference import llsa_hier_topk, llsa_dense
    idx = llsa_hier_topk(q.double(), k.double(), block_size=16, topk=[8, 8])    # [I^(1), ..., I^(L)]
    o = llsa_dense(q.double(), k.double(), v.double(), block_size=16, index=idx)

Written independently of the kernels (no shared helpers) so that a test comparing the two can fail.
"""

from __future__ import annotations

import math

import torch

__all__ = ["llsa_block_mean", "llsa_rank_topk", "llsa_hier_topk", "llsa_dense"]


def llsa_block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., n, d] -> [..., n / block_size, d], plain mean (autograd flows through)."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // block_size, block_size, x.shape[-1]).mean(dim=-2)


def llsa_rank_topk(score: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """ids of the k best scores: descending score, ties -> smaller id (lexicographic sort of (-score, id))."""
    by_id = ids.argsort(dim=-1)  # first order by id ...
    ids_sorted, score_sorted = ids.gather(-1, by_id), score.gather(-1, by_id)
    order = torch.sort(-score_sorted, dim=-1, stable=True).indices  # ... then stably by -score
    return ids_sorted.gather(-1, order[..., :k])


def llsa_hier_topk(q: torch.Tensor, k: torch.Tensor, block_size: int, topk: list[int]) -> list[torch.Tensor]:
    """Hierarchical top-k. Returns [I^(1), ..., I^(L)] (int64), I^(l): [b, h, N_l, K_l].

    K_L is clamped to N_L as in the kernels; finer K_l must be <= K_{l+1} * block_size (the caller's job).
    """
    B, L = block_size, len(topk)
    qp, kp = [q], [k]
    for _ in range(L):
        qp.append(llsa_block_mean(qp[-1], B))
        kp.append(llsa_block_mean(kp[-1], B))
    index: dict[int, torch.Tensor] = {}
    n = kp[L].shape[-2]
    score = qp[L] @ kp[L].transpose(-1, -2)
    ids = torch.arange(n, device=q.device).expand(score.shape)
    index[L] = llsa_rank_topk(score, ids, min(topk[L - 1], n))
    for lvl in range(L - 1, 0, -1):
        rows = torch.arange(qp[lvl].shape[-2], device=q.device)
        parent = index[lvl + 1][..., rows // B, :]  # [b, h, N_l, K_{l+1}]
        cand = (parent[..., :, None] * B + torch.arange(B, device=q.device)).flatten(-2)  # [b, h, N_l, K_{l+1} B]
        kc = torch.gather(
            kp[lvl][..., None, :, :].expand(*cand.shape[:-1], *kp[lvl].shape[-2:]),
            -2,
            cand[..., None].expand(*cand.shape, kp[lvl].shape[-1]),
        )
        s = (qp[lvl][..., :, None, :] * kc).sum(-1)
        index[lvl] = llsa_rank_topk(s, cand, topk[lvl - 1])
    return [index[lvl] for lvl in range(1, L + 1)]


def llsa_dense(
    q,
    k,
    v,
    block_size: int,
    index: list[torch.Tensor],
    enrich_levels: int | None = None,
    scale: float | None = None,
    reference_l1_grad: bool = False,
) -> torch.Tensor:
    """Dense LLSA output given the index tables [I^(1), ..., I^(L)]; levels 1..enrich_levels enrich.
    ``reference_l1_grad``: with L = 1, the gradient through the pooled K/V is divided by B, as in the authors' l1
    kernel; the forward value is unchanged."""
    B, L = block_size, len(index)
    pooled_grad_scale = 1.0 / B if reference_l1_grad and L == 1 else 1.0
    Le = L if enrich_levels is None else enrich_levels
    b, h, N, d = q.shape
    scale = d**-0.5 if scale is None else scale
    keys, values, biases, allowed = [], [], [], []
    kl, vl = k, v
    for lvl in range(0, L + 1):
        if lvl > 0:
            kl, vl = llsa_block_mean(kl, B), llsa_block_mean(vl, B)
            if lvl == 1 and pooled_grad_scale != 1.0:  # value unchanged, gradient scaled
                kl = kl * pooled_grad_scale + kl.detach() * (1 - pooled_grad_scale)
                vl = vl * pooled_grad_scale + vl.detach() * (1 - pooled_grad_scale)
        if lvl > Le:
            continue
        n_l = N // B**lvl
        if lvl == L:
            m = torch.ones(b, h, N, n_l, dtype=torch.bool, device=q.device)
        else:
            sel = index[lvl][..., torch.arange(N, device=q.device) // B ** (lvl + 1), :].long()  # [b, h, N, K]
            blk = torch.zeros(b, h, N, n_l // B, dtype=torch.bool, device=q.device)
            blk.scatter_(-1, sel, True)
            m = blk.repeat_interleave(B, dim=-1)
        keys.append(kl)
        values.append(vl)
        allowed.append(m)
        biases.append(torch.full((n_l,), lvl * math.log(B), dtype=q.dtype, device=q.device))
    logits = (q @ torch.cat(keys, -2).transpose(-1, -2)) * scale + torch.cat(biases)
    logits = logits.masked_fill(~torch.cat(allowed, -1), float("-inf"))
    return torch.softmax(logits, dim=-1) @ torch.cat(values, -2)
