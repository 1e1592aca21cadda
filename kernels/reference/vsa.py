"""Dense PyTorch oracle of VSA (Video Sparse Attention, docs/algorithms.md) — for tests and diagnostics only.

Everything is computed in fp32 with explicit ``N x N`` token masks, so it is O(N²) in memory: keep ``N`` small
(a few thousand tokens). It shares no code with ``pixdit.kernels.vsa`` on purpose (an independent second reading of
the method). Tokens are grouped into tiles of ``block_size`` consecutive positions; a partial last tile holds the
``N mod block_size`` remaining tokens and is pooled over its real tokens only.

    from pixdit.kernels.reference import vsa_reference, vsa_reference_scores
    out = vsa_reference(q, k, v, block_size=16, topk=4, gate=g)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 math (fp64 inputs stay fp64, for gradcheck-grade comparisons)."""
    return x if x.dtype == torch.float64 else x.float()


def _tile_of_token(num_tokens: int, block_size: int, device) -> torch.Tensor:
    return torch.arange(num_tokens, device=device) // block_size


def _tile_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of ``x [B, H, N, D]`` over each tile's real tokens -> ``[B, H, T, D]`` (one-hot matmul, fp32)."""
    n = x.shape[2]
    tile = _tile_of_token(n, block_size, x.device)
    membership = F.one_hot(tile).to(x.dtype)  # [N, T]
    return (membership.t() @ x) / membership.sum(0)[:, None]


def vsa_reference_scores(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """Coarse scores ``S_c = scale * mean(q_i) . mean(k_j)`` per (batch, head) -> ``[B, H, T, T]`` fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return scale * _tile_mean(_upcast(q), block_size) @ _tile_mean(_upcast(k), block_size).transpose(-1, -2)


def vsa_reference(
    q, k, v, block_size: int, topk: int, gate=None, scale: float | None = None, tile_idx=None, gate_fine=None
):
    """VSA output ``O_fine * gate_fine + gate * O_coarse`` (a gate absent -> 1), fp32, differentiable in q, k, v and
    the gates (``gate`` = G_c, ``gate_fine`` = G_f).

    ``tile_idx [B, H, T, K]`` (optional) forces the selected key tiles, e.g. the kernel's own selection, so that
    output and gradients can be compared independently of near-ties; by default the oracle selects the ``topk``
    largest coarse scores per query tile with ties broken toward the smaller tile id (stable descending sort).
    """
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    tile = _tile_of_token(n, block_size, q.device)
    num_tiles = int(tile[-1]) + 1

    # coarse stage: dense attention between pooled tokens, broadcast back to every token of the tile
    q_pool, k_pool, v_pool = (_tile_mean(x, block_size) for x in (q, k, v))
    scores = scale * q_pool @ k_pool.transpose(-1, -2)
    out_coarse = (torch.softmax(scores, -1) @ v_pool)[:, :, tile]

    with torch.no_grad():
        if tile_idx is None:
            kk = min(max(int(topk), 1), num_tiles)
            tile_idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
        tile_selected = torch.zeros(b, h, num_tiles, num_tiles, dtype=torch.bool, device=q.device)
        tile_selected.scatter_(-1, tile_idx.long(), True)
        token_selected = tile_selected[:, :, tile][:, :, :, tile]  # [B, H, N, N]

    logits = (scale * q @ k.transpose(-1, -2)).masked_fill(~token_selected, float("-inf"))
    out_fine = torch.softmax(logits, -1) @ v
    if gate_fine is not None:
        out_fine = out_fine * _upcast(gate_fine)
    return out_fine + (out_coarse if gate is None else out_coarse * _upcast(gate))
