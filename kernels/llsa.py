"""LLSA: Log-linear Sparse Attention (arXiv 2512.16615); semantics in docs/algorithms.md ("LLSA").

    from pixdit.kernels import llsa_attention, llsa_select, llsa_check, llsa_num_levels
    o = llsa_attention(q, k, v, block_size=16, topk=8)            # q, k, v: [batch, heads, tokens, head_dim]
    index = llsa_select(q, k, block_size=16, topk=8)              # [I^(1), ..., I^(L)], int32 [b, h, N_l, K_l]
    llsa_check(num_tokens=16384, block_size=16, topk=8)          # config-time validation -> effective settings

What a fine query attends to: the B tokens of each of its K_1 selected fine blocks (weight 1), at every
pooled level 1 <= l < L the K_{l+1}*B level-l tokens its level-(l+1) ancestor scored during selection (weight B^l),
and every coarsest-level token (weight B^L); one softmax over all of them. Levels above ``enrich_levels`` are left
out (the coarsest first). Pooling and selection scores are fp32; ties go to the smaller block id.

CUDA tensors run Triton (``block_sparse.py``): the fine level is one block-sparse pass over ``k``/``v`` with 16-row
query blocks; the pooled levels are a second pass over one "bank" (levels 1..L concatenated, fp32-pooled then cast
to the input dtype) with 64-row query tiles, whose lists are shared by all 64 rows (a level-l list depends only on
the level-(l+1) ancestor, and B^2 >= 64 rows share it), and the coarsest level, which every query sees, is walked
as one contiguous range after the list; the second pass continues the first pass's softmax. A selection made here
fills every list slot, so that pass walks its lists without masks, and at L = 2 (one candidate level, one weight)
adds the weight as a scalar per step (``_pooled_list_args``). The
backward is dq query-major, dk/dv key-major over the CSC transpose, then the mean-pool adjoint. CPU tensors run the
exact gather form in fp32 with autograd.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import block_sparse as bs
from .blocks import block_mean, block_means, csr_to_csc
from .common import autocast_inputs, check_means, check_qkv, use_triton
from .ops import cdiv, custom_op, shape_constant
from .topk import pooled_topk

try:
    from . import llsa_gluon
except ImportError:  # a Triton without Gluon's Hopper API: the pooled pass stays bsa_forward's
    llsa_gluon = None

__all__ = ["llsa_attention", "llsa_select", "llsa_check", "llsa_num_levels"]

COARSE_TILE = 64  # query rows per program of the pooled-level pass (<= B^2 so that one list serves it)
# The dtype of the fine pass's partial output, which the pooled pass continues from: "float32", or "input" (the
# inputs' dtype: half the bytes of the fine pass's store and of the pooled pass's load, ~0.2 GB of a 256² forward of
# 2 x 6 heads; the partial is rounded to bf16 once, as the output is). "input": LLSA's forward 4-7 % and its
# forward + backward 1-2.5 % faster at 128²-512² (docs/kernel_notes.md v46).
PARTIAL_DTYPE = "input"
# The candidate levels' weights in the pooled walks as runs of list columns (a scalar per step; ``_pooled_list_args``)
# or, False, per bank block (a load per key). The same bits either way; the runs measured 1.068x against the
# per-block form at L = 2 on the H200 (docs/kernel_notes.md v30), 1.022x (L = 2, 256²) and 1.024x (L = 3, 512²) on
# an H100 (forward + backward, v48).
LIST_WEIGHT_RUNS = True
# The pooled pass by ``llsa_gluon.pooled_forward`` (Gluon, Hopper: each group of B^2 query rows keeps its bank keys in
# shared memory) where it supports the case, else by ``bsa_forward``; the backward's pooled dq (and Δ) by
# ``llsa_gluon.pooled_dq`` likewise. Off: on an H100 the forward runs 0.91-0.95x of the Triton pass (256², 128²,
# 512²), the dq 1.04-1.07x; LLSA's forward + backward 0.98-1.00x with both on, 0.997-1.016x with the dq alone
# (docs/kernel_notes.md v64-v66). PIXDIT_KERNELS_GLUON=1 switches both on for a process, =forward or =dq one of them.
_GLUON_SWITCHES = {
    "": (False, False),
    "0": (False, False),
    "1": (True, True),
    "forward": (True, False),
    "dq": (False, True),
}
_gluon_setting = os.environ.get("PIXDIT_KERNELS_GLUON", "0")
if _gluon_setting not in _GLUON_SWITCHES:
    raise ValueError(
        f"PIXDIT_KERNELS_GLUON must be one of 0, 1, forward, dq (which of LLSA's Gluon pooled passes run), "
        f"got {_gluon_setting!r}"
    )
GLUON_POOLED_FORWARD, GLUON_POOLED_DQ = _GLUON_SWITCHES[_gluon_setting]


def _partial_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the fine pass's partial output (``PARTIAL_DTYPE``) for inputs of ``input_dtype``."""
    dtypes = {"float32": torch.float32, "input": input_dtype}
    if PARTIAL_DTYPE not in dtypes:
        raise ValueError(f'llsa.PARTIAL_DTYPE must be "float32" or "input" (the inputs\' dtype), got {PARTIAL_DTYPE!r}')
    return dtypes[PARTIAL_DTYPE]


# ------------------------------------------------------------------------------------------------- configuration
def llsa_num_levels(num_tokens: int, block_size: int = 16) -> int:
    """The paper's default ``L = floor(log_B N - 1)`` clamped to >= 1 (integer arithmetic: largest L with
    ``B^(L+1) <= N``). E.g. B=16: N=1024 -> 1, 4096 -> 2, 16384 -> 2, 65536 -> 3, 262144 -> 3."""
    _check_block_size(block_size)
    levels = 0
    while block_size ** (levels + 2) <= num_tokens:
        levels += 1
    return max(levels, 1)


def _check_block_size(block_size) -> None:
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (16, 32, 64, ...), got {block_size!r}")


def llsa_check(
    num_tokens: int,
    block_size: int = 16,
    num_levels: int | None = None,
    topk: int | Sequence[int] = 8,
    enrich_levels: int | None = None,
) -> dict:
    """Validate an LLSA setting for a sequence of ``num_tokens`` and return the effective one.

    Raises ValueError naming the parameter and the allowed values. Returns ``{"num_levels": L, "topk": [K_1..K_L],
    "enrich_levels": L_e, "level_tokens": [N_0..N_L], "tokens_per_query": T}``. ``topk`` is clamped to the number of
    candidates (documented, never an error): ``K_L <= N_L`` at the coarsest level and ``K_l <= K_{l+1} * B`` below.
    """
    _check_block_size(block_size)
    if not isinstance(num_tokens, int) or num_tokens < block_size:
        raise ValueError(f"LLSA needs at least block_size={block_size} tokens, got num_tokens={num_tokens!r}")
    L = llsa_num_levels(num_tokens, block_size) if num_levels is None else num_levels
    if not isinstance(L, int) or L < 1:
        raise ValueError(f"num_levels must be an int >= 1 (or None for the default), got {num_levels!r}")
    group = block_size**L
    if num_tokens % group:
        raise ValueError(
            f"LLSA with block_size={block_size} and num_levels={L} needs the number of tokens to be a multiple of "
            f"block_size**num_levels = {group}, got {num_tokens} tokens ({num_tokens} / {group} = "
            f"{num_tokens / group:.3g}); use fewer levels, a smaller block_size or an image whose token count is a "
            f"multiple of {group}"
        )
    if isinstance(topk, int):
        ks = [topk] * L
    else:
        ks = list(topk)
        if len(ks) != L:
            raise ValueError(
                f"topk must be an int or a list of num_levels={L} ints [K_1, ..., K_L] (finest first), got {topk!r}"
            )
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in ks):
        raise ValueError(f"topk must be >= 1 at every level (blocks kept per query block), got {topk!r}")
    Le = L if enrich_levels is None else enrich_levels
    if not isinstance(Le, int) or not 0 <= Le <= L:
        raise ValueError(f"enrich_levels must be an int in [0, num_levels={L}] (or None = all), got {enrich_levels!r}")
    sizes = [num_tokens // block_size**lvl for lvl in range(L + 1)]
    eff = list(ks)
    eff[L - 1] = min(eff[L - 1], sizes[L])
    for lvl in range(L - 1, 0, -1):  # 1-based level lvl has index lvl - 1
        eff[lvl - 1] = min(eff[lvl - 1], eff[lvl] * block_size)
    tokens = eff[0] * block_size + sum(eff[lvl] * block_size for lvl in range(1, min(Le, L - 1) + 1))
    tokens += sizes[L] if Le == L else 0
    return {"num_levels": L, "topk": eff, "enrich_levels": Le, "level_tokens": sizes, "tokens_per_query": tokens}


# ----------------------------------------------------------------------------------------------------- selection
def _pyramid(x: torch.Tensor, block_size: int, levels: int, first: torch.Tensor | None = None) -> list[torch.Tensor]:
    """PyTorch path: [x^(1), ..., x^(levels)], recursive fp32 block means; ``first``: x^(1) when the caller has it
    already. (The Triton path builds its pyramids with ``_pyramid_and_bank``.)"""
    out, cur = [], x
    for lvl in range(levels):
        cur = first if lvl == 0 and first is not None else block_mean(cur, block_size)
        out.append(cur)
    return out


@triton.jit
def _next_level_kernel(
    PREV,
    NEXT,
    BANK,
    n_next,
    bank_rows,
    prev_row0,
    next_row0,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BANK_PREV: tl.constexpr,
    BANK_NEXT: tl.constexpr,
):
    # program: one row of the next level of one (batch, head) of stacked input <axis 2>, the fp32 mean of its BLOCK
    # rows of the level below; the last two inputs' (k's and v's) rows of either level also cast into the bank's two
    # halves (BANK_PREV / BANK_NEXT)
    row, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_bh = tl.num_programs(1)
    dims = tl.arange(0, HEAD_DIM)
    prev_rows = row.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    plane = which.to(tl.int64) * n_bh + bh  # the (input, batch * head) plane of PREV and NEXT
    x = tl.load(PREV + (plane * n_next * BLOCK + prev_rows[:, None]) * HEAD_DIM + dims[None, :])
    mean = tl.sum(x, axis=0) / BLOCK
    tl.store(NEXT + (plane * n_next + row) * HEAD_DIM + dims, mean)
    if BANK_PREV or BANK_NEXT:
        half = which - (tl.num_programs(2) - 2)
        if half >= 0:
            bank = BANK + (half.to(tl.int64) * n_bh + bh) * bank_rows * HEAD_DIM
            if BANK_PREV:
                rows = prev_row0 + prev_rows[:, None]
                tl.store(bank + rows * HEAD_DIM + dims[None, :], x.to(BANK.dtype.element_ty))
            if BANK_NEXT:
                tl.store(bank + (next_row0 + row) * HEAD_DIM + dims, mean.to(BANK.dtype.element_ty))


@custom_op("llsa_next_level", mutates_args=("bank",))
def next_level(
    prev: torch.Tensor, block_size: int, bank: torch.Tensor | None, prev_row0: int, next_row0: int
) -> torch.Tensor:
    """The pyramid's next level of stacked fp32 levels ``prev`` ``[n, b, h, rows, d]`` (rows a multiple of
    ``block_size``): fp32 ``[n, b, h, rows / block_size, d]``, each row the mean of its ``block_size`` rows below
    (summed in the kernel's order). With a ``bank`` (``[2, b * h, bank rows, d]``, k's half then v's): the last two
    stacked inputs (k and v) are also cast into it, this level's rows from bank row ``prev_row0`` on and the next
    level's from ``next_row0`` (each -1: not written). One launch where the PyTorch form made a reduction and a
    cast-copy per level."""
    n, b, h, rows, d = prev.shape
    prev = prev.contiguous()
    n_next = rows // block_size
    out = prev.new_empty(n, b, h, n_next, d)
    bank_prev, bank_next = bank is not None and prev_row0 >= 0, bank is not None and next_row0 >= 0
    _next_level_kernel[(n_next, b * h, n)](
        prev,
        out,
        bank if bank is not None else out,
        n_next,
        bank.shape[2] if bank is not None else 0,
        max(prev_row0, 0),
        max(next_row0, 0),
        BLOCK=block_size,
        HEAD_DIM=d,
        BANK_PREV=bank_prev,
        BANK_NEXT=bank_next,
        num_warps=1,
    )
    return out


@next_level.register_fake
def _(prev, block_size, bank, prev_row0, next_row0):
    n, b, h, rows, d = prev.shape
    return prev.new_empty(n, b, h, rows // block_size, d)


def _pyramid_and_bank(level1: torch.Tensor, block_size: int, levels: int, bank=None, bank_offsets=()):
    """Triton path: ``[x^(1), ..., x^(levels)]`` of the stacked fp32 level-1 means ``level1`` (``[n, b, h, N / B,
    d]``), and with a ``bank`` its levels ``1 .. len(bank_offsets)`` written from rows ``bank_offsets`` on (the last two
    stacked inputs are k and v): one ``next_level`` launch per level above the first."""
    pyramid, n_bank = [level1], len(bank_offsets) if bank is not None else 0
    for lvl in range(1, levels):  # level lvl + 1 from level lvl
        last = lvl + 1 == levels
        prev_row0 = bank_offsets[lvl - 1] if lvl <= n_bank else -1
        next_row0 = bank_offsets[lvl] if last and lvl + 1 <= n_bank else -1
        pyramid.append(next_level(pyramid[-1], block_size, bank, prev_row0, next_row0))
    if levels == 1 and n_bank:  # nothing to pool: the first level's copy
        bank[:, :, : level1.shape[3]].copy_(level1[-2:].flatten(1, 2))
    return pyramid


def _select_from_pooled(qp, kp, block_size: int, ks: list[int], impl: str) -> list[torch.Tensor]:
    """Hierarchical top-k on fp32 pyramids qp/kp = [x^(1)..x^(L)]; returns [I^(1)..I^(L)] int32.
    Coarsest level: every key is a candidate; level l < L: the B children of each of the parent's K_{l+1} picks,
    shared by the B sibling rows (``pooled_topk`` with ``parents``)."""
    L = len(ks)
    index = [pooled_topk(qp[L - 1], kp[L - 1], ks[L - 1], impl=impl)]
    for lvl in range(L - 1, 0, -1):
        index.insert(
            0, pooled_topk(qp[lvl - 1], kp[lvl - 1], ks[lvl - 1], parents=index[0], child_block=block_size, impl=impl)
        )
    return index


def llsa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    block_size: int = 16,
    topk: int | Sequence[int] = 8,
    num_levels: int | None = None,
    impl: str = "auto",
) -> list[torch.Tensor]:
    """Hierarchical top-k selection: ``[I^(1), ..., I^(L)]``, ``I^(l)`` int32 ``[b, h, N_l, K_l]``.

    Row r of I^(l) lists, in descending score order (ties -> smaller id), the level-l key tokens (= level-(l-1)
    blocks) that level-l query token r keeps. Pooling and scores in fp32, deterministic, no gradient. ``topk`` is
    clamped as in ``llsa_check``. ``impl``: "auto" (fused Triton top-k on CUDA), "triton", "torch".
    """
    cfg = llsa_check(q.shape[-2], block_size, num_levels, topk)
    if not use_triton(q, impl):
        return _select(q, k, block_size, cfg, impl)
    with torch.no_grad():  # the pyramids as llsa_attention builds them
        pyramid = _pyramid_and_bank(block_means([q.detach(), k.detach()], block_size), block_size, cfg["num_levels"])
        qp, kp = ([level[i] for level in pyramid] for i in (0, 1))
        return _select_from_pooled(qp, kp, block_size, cfg["topk"], impl)


def _select(q, k, block_size: int, cfg: dict, impl: str, means: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``llsa_select``'s PyTorch path for a checked ``cfg``; ``means``: the level-1 means of q and k (then v)
    stacked, if known."""
    L = cfg["num_levels"]
    with torch.no_grad():
        qp = _pyramid(q.detach(), block_size, L, None if means is None else means[0])
        kp = _pyramid(k.detach(), block_size, L, None if means is None else means[1])
        return _select_from_pooled(qp, kp, block_size, cfg["topk"], impl)


# ---------------------------------------------------------------------------------------- exact PyTorch (CPU) path
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient multiplied by ``factor`` (``reference_l1_grad``)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _llsa_torch(q, k, v, index, block_size, enrich_levels, scale, reference_l1_grad):
    """Gather form: per fine query block, gather its fine / candidate keys; the coarsest level (shared
    by all queries) is a plain matmul. fp32 math, autograd to q, k, v; memory O(N * tokens_per_query)."""
    B, L = block_size, len(index)
    b, h, N, d = q.shape
    nq = N // B
    qb = q.float().view(b, h, nq, B, d)
    kl, vl = k.float(), v.float()
    logits, values = [], []
    for lvl in range(0, min(enrich_levels, L) + 1):
        if lvl > 0:
            kl, vl = block_mean(kl, B), block_mean(vl, B)
            if reference_l1_grad and L == 1:
                kl, vl = _ScaleGrad.apply(kl, 1.0 / B), _ScaleGrad.apply(vl, 1.0 / B)
        if lvl == L:  # every coarsest token (not gathered: one shared [N_L, d] matrix)
            s = qb @ kl[:, :, None].transpose(-1, -2)  # [b, h, nq, B, N_L]
            values.append(vl[:, :, None])
        else:  # the blocks listed by I^(lvl+1) for this query block's level-(lvl+1) ancestor
            sel = index[lvl][:, :, torch.arange(nq, device=q.device) // B**lvl].long()  # [b, h, nq, K]
            rows = (sel[..., None] * B + torch.arange(B, device=q.device)).flatten(-2)  # [b, h, nq, K*B]
            idx = rows.view(b, h, -1, 1).expand(-1, -1, -1, d)
            kg = torch.gather(kl, 2, idx).view(b, h, nq, -1, d)
            values.append(torch.gather(vl, 2, idx).view(b, h, nq, -1, d))
            s = qb @ kg.transpose(-1, -2)  # [b, h, nq, B, K*B]
        logits.append(s * scale + lvl * math.log(B))
    p = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out = 0
    for part, vals in zip(p.split([x.shape[-1] for x in logits], dim=-1), values):
        out = out + part @ vals
    return out.reshape(b, h, N, d).to(q.dtype)


# --------------------------------------------------------------------------------------------------- Triton path
def _bank_layout(N, B, L, Le):
    """Pooled bank = levels 1..min(Le, L) concatenated. Returns (offsets of each level in the bank, total rows)."""
    offsets, total = [], 0
    for lvl in range(1, min(Le, L) + 1):
        offsets.append(total)
        total += N // B**lvl
    return offsets, total


def _coarse_lists(index, N, B, L, Le, device):
    """Per 64-row query tile, the bank blocks of the pooled candidate levels (1 .. min(Le, L - 1)): int32
    [b*h, N/64 (ceil), len]. The coarsest level is not listed: every query attends to all of it (``_bank_tail``).
    Without candidate levels (L = 1) one empty slot (-1) per tile."""
    b, h = index[0].shape[:2]
    offsets, _ = _bank_layout(N, B, L, Le)
    n_tiles = cdiv(N, COARSE_TILE)
    parts = []
    for lvl in range(1, min(Le, L - 1) + 1):  # candidates: children of the level-(lvl+1) ancestor's selection
        tiles_per_ancestor = B ** (lvl + 1) // COARSE_TILE
        part, shift = index[lvl].repeat_interleave(tiles_per_ancestor, dim=2), offsets[lvl - 1] // B
        parts.append(part + shift if shift else part)  # level 1 starts the bank: no add of a zero shift
    if not parts:
        return torch.full((b * h, n_tiles, 1), -1, device=device, dtype=torch.int32)
    lists = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(torch.int32)
    return lists.reshape(b * h, n_tiles, lists.shape[-1]).contiguous()


def _bank_tail(N, B, L, Le):
    """The coarsest level's rows of the bank and their log weight, ``(row_lo, row_hi, L ln B)``, which every query
    attends to (walked as one contiguous range, not listed); None when enrich_levels leaves that level out."""
    if Le < L:
        return None
    offsets, total = _bank_layout(N, B, L, Le)
    return offsets[L - 1], total, L * math.log(B)


def _bank_log_weights(N, B, L, Le, device):
    """fp32 ``[bank blocks]``: each bank block's log multiplicity ``l ln B``; a few tiny fills, made once per shape and
    kept for eager calls (``shape_constant``; made each call where traced)."""

    def make():
        offsets, total = _bank_layout(N, B, L, Le)
        w = torch.empty(cdiv(total, B), device=device, dtype=torch.float32)
        for lvl in range(1, min(Le, L) + 1):
            lo = offsets[lvl - 1] // B
            hi = cdiv(offsets[lvl] if lvl < min(Le, L) else total, B)
            w[lo:hi] = lvl * math.log(B)
        return w

    return shape_constant(("llsa bank log weights", N, B, L, Le), torch.device(device), make)


def _tokens_major(x: torch.Tensor) -> bool:
    """Whether ``[b, h, n, d]`` x is a transposed view of a tokens-major ``[b, n, h, d]`` tensor whose head dim is
    contiguous (any row stride), the layout ``bsa_forward`` reads v in (``row_layout``)."""
    return x.stride(3) == 1 and x.stride(1) == x.shape[3] and x.stride(2) >= x.shape[1] * x.shape[3]


class _LLSATriton(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        bank_k,
        bank_v,
        fine_lists,
        coarse_lists,
        cand_widths,
        block_size,
        num_levels,
        enrich_levels,
        scale,
        reference_l1_grad,
        full_lists,
        v_in_place,
    ):
        # bank_k / bank_v: pooled levels 1..min(Le, L) concatenated ([b*h, rows, d], input dtype, no grad);
        # cand_widths: the blocks per list of each candidate level in coarse_lists' columns (finest first);
        # full_lists: no empty slot in the candidate lists (a selection made by llsa_attention itself)
        b, h, N, d = q.shape
        B, L, Le = block_size, num_levels, enrich_levels
        qf = bs.flatten_heads(q)
        # v_in_place: no backward will run, and v is tokens-major (e.g. qk_norm_rope(..., v_view=True), a view of
        # qkv), which the forward reads where it is; the backward's kernels read k and v with one layout
        kf, vf = (bs.flatten_heads(k), v.transpose(1, 2)) if v_in_place else bs.flatten_kv(k, v)
        has_coarse = Le >= 1
        # the last pass writes the output tokens-major ([b, N, h, d]): the model's projection reads it as it is
        # (llsa_attention returns it transposed, a view) and its gradient arrives in that layout, so neither the
        # forward nor the backward copies it (a transposed [b, h, N, d] output costs one copy each way)
        o, lse = bs.bsa_forward(
            qf,
            kf,
            vf,
            fine_lists,
            B,
            B,
            scale,
            out_dtype=_partial_dtype(q.dtype) if has_coarse else None,
            out_heads=0 if has_coarse else h,
        )
        logw, tail = None, _bank_tail(N, B, L, Le)
        if has_coarse:
            logw = _bank_log_weights(N, B, L, Le, q.device)
        if has_coarse and _gluon_pooled(qf, B, cand_widths, tail, full_lists, GLUON_POOLED_FORWARD):
            o, lse = llsa_gluon.pooled_forward(qf, bank_k, bank_v, coarse_lists, o, lse, B, scale, cand_widths, tail, h)
        elif has_coarse:
            o, lse = bs.bsa_forward(
                qf,
                bank_k,
                bank_v,
                coarse_lists,
                COARSE_TILE,
                B,
                scale,
                init=(o, lse),
                out_dtype=q.dtype,
                dense_tail=tail,
                out_heads=h,
                **_pooled_list_args(B, L, Le, logw, cand_widths, d, full_lists),
            )
        ctx.save_for_backward(qf, kf, vf, o, lse, fine_lists, coarse_lists, bank_k, bank_v, logw)
        ctx.cfg = (B, L, Le, scale, reference_l1_grad, q.shape, tail, cand_widths, full_lists)
        return o

    @staticmethod
    def backward(ctx, do):
        qf, kf, vf, o, lse, fine_lists, coarse_lists, bank_k, bank_v, logw = ctx.saved_tensors
        B, L, Le, scale, reference_l1_grad, shape, tail, cand_widths, full_lists = ctx.cfg
        BH, N, d = qf.shape
        dt = qf.dtype
        do = do.contiguous()  # tokens-major like o (a model's gradient already is; o is read with do's strides)
        delta = torch.empty(BH, N, device=qf.device, dtype=torch.float32)
        dq = pooled_k = pooled_v = None
        if Le >= 1:
            # pooled levels first (64-row tiles); this dq pass also computes Δ = rowsum(dO * O)
            if _gluon_pooled(qf, B, cand_widths, tail, full_lists, GLUON_POOLED_DQ):
                dq = llsa_gluon.pooled_dq(
                    qf, bank_k, bank_v, do, o, lse, delta, coarse_lists, B, scale, cand_widths, tail
                )
            else:
                weights = _pooled_list_args(B, L, Le, logw, cand_widths, d, full_lists)
                dq = bs.bsa_backward_dq(
                    qf, bank_k, bank_v, do, lse, delta, coarse_lists, COARSE_TILE, B, scale, o=o, dense_tail=tail,
                    **weights,
                )  # fmt: skip
            pooled_k, pooled_v = _pooled_bank_grads(
                qf, bank_k, bank_v, do, lse, delta, coarse_lists, cand_widths, logw, B, L, Le, scale, reference_l1_grad
            )
        # fine level (16-row query blocks over k/v): the dk/dv adds in its epilogue the mean-pool adjoint of the
        # pooled gradients, the dq the pooled dq; both write the input dtype directly. Where the dk/dv's programs
        # are one warp (keeps_ds) and Δ is known, the dk/dv keeps each listed pair's dS and the dq is dS K from it:
        # the dq then reads 2.5 KB a step instead of 4 (K and dS instead of K and V) and computes one product of
        # three (docs/kernel_notes.md v41).
        keep_ds = dq is not None and bs.keeps_ds(B, B, d)
        if not keep_ds:  # the recomputing dq (without pooled levels it computes Δ, which the dk/dv reads)
            dq = bs.bsa_backward_dq(
                qf, kf, vf, do, lse, delta, fine_lists, B, B, scale, dq=dq, o=o if dq is None else None, out_dtype=dt
            )
        ds = bs.ds_buffer(fine_lists, B, B, dt) if keep_ds else None
        dk, dv = bs.bsa_backward_dkdv(
            qf,
            kf,
            vf,
            do,
            lse,
            delta,
            csr_to_csc(fine_lists, N // B),
            B,
            B,
            scale,
            pooled_add=(pooled_k, pooled_v) if pooled_k is not None else None,
            pooled_levels=min(Le, L),
            out_dtype=dt,
            ds=ds,
            ds_lists=fine_lists if keep_ds else None,
        )
        if keep_ds:
            dq = bs.bsa_backward_ds_dq(kf, ds, fine_lists, N, B, B, scale, dq=dq, out_dtype=dt)
        return (dq.view(shape), dk.view(shape), dv.view(shape)) + (None,) * 12


def _gluon_pooled(qf, B, cand_widths, tail, full_lists: bool, switch: bool) -> bool:
    """Whether the pooled pass runs ``llsa_gluon``'s kernel: its ``switch`` (``GLUON_POOLED_FORWARD``,
    ``GLUON_POOLED_DQ``) is on and the kernel supports the case."""
    if not switch or llsa_gluon is None or tail is None:
        return False
    return llsa_gluon.pooled_supported(qf, B, cand_widths, tail[1] - tail[0], full_lists)


def _pooled_list_args(B, L, Le, logw, cand_widths, head_dim, full_lists: bool) -> dict:
    """The weights and fullness of the pooled pass's lists for ``bsa_forward`` / ``bsa_backward_dq``. Each candidate
    level's blocks fill one run of the lists' columns (``cand_widths``, finest first) and share its weight
    ``l ln B``, passed as ``(columns, weight)`` runs (a scalar per step in the kernels, not a load per key: the values
    of ``logw``, bit for bit) where every run but the last ends at a whole step of the walk (K = 8 at L = 3), else as
    ``logw`` per bank block. ``full_lists``: no empty slot, so the walk needs no masks; without candidate levels the
    lists are one empty slot each."""
    per_step = bs.walk_blocks_per_step(COARSE_TILE, B, head_dim)
    runs = [(width, lvl * math.log(B)) for lvl, width in enumerate(cand_widths, start=1)]
    whole_steps = all(width % per_step == 0 for width, _ in runs[:-1])
    if LIST_WEIGHT_RUNS and 1 <= len(runs) <= bs.MAX_LIST_RUNS and whole_steps:
        return {"list_log_weight": runs if len(runs) > 1 else runs[0][1], "full_lists": full_lists}
    return {"log_weights": logw, "full_lists": full_lists and len(runs) >= 1}


def _pooled_bank_grads(
    qf, bank_k, bank_v, do, lse, delta, coarse_lists, cand_widths, logw, B, L, Le, scale, reference_l1_grad
):
    """dK/dV of the pooled bank (the candidate levels by query group, the coarsest key-major): fp32 ``[BH, bank
    rows, d]`` for k and v, levels 1..min(Le, L) finest first. The fine pass pushes them down the pyramid in its
    epilogue (``bsa_backward_dkdv``'s ``pooled_levels``), ``G^(l) = dK^(l) + up(G^(l+1)) / B``, and adds
    ``G^(1)[i // B] / B`` to key i."""
    BH, N, d = qf.shape
    offsets, total = _bank_layout(N, B, L, Le)
    n_bank_blocks = cdiv(total, B)
    n_tiles = coarse_lists.shape[1]
    dbank = torch.empty(2, BH, total, d, device=qf.device, dtype=torch.float32)  # dK, dV: one pyramid pass for both
    top_lo = offsets[L - 1] // B if Le >= L else n_bank_blocks
    col = 0
    for lvl in range(1, min(Le, L - 1) + 1):  # candidate levels: the B^(lvl+1) queries of an ancestor share a list
        group_rows = B ** (lvl + 1)
        width = cand_widths[lvl - 1]
        # the tile lists repeat each ancestor's list over its tiles: one row per ancestor is its group's list
        group_lists = coarse_lists[:, :: group_rows // COARSE_TILE, col : col + width]
        col += width
        lo = offsets[lvl - 1] // B
        bs.bsa_backward_dkdv_grouped(
            qf,
            bank_k,
            bank_v,
            do,
            lse,
            delta,
            group_lists,
            group_rows,
            B,
            scale,
            logw,
            blk_range=(lo, lo + N // B ** (lvl + 1)),
            dk=dbank[0],
            dv=dbank[1],
        )
    if top_lo < n_bank_blocks:  # coarsest level: every tile lists every block -> one shared list,
        group = max(1, 64 // B)  # groups of 64 keys per program, long list split over programs
        n_groups = cdiv(n_bank_blocks - top_lo, group)
        bs.bsa_backward_dkdv(
            qf,
            bank_k,
            bank_v,
            do,
            lse,
            delta,
            bs.shared_csc(n_tiles, qf.device),
            COARSE_TILE,
            B,
            scale,
            logw,
            blk_range=(top_lo, n_bank_blocks),
            group=group,
            n_split=bs.split_count(BH * n_groups, n_tiles),
            dk=dbank[0],
            dv=dbank[1],
            shared_list=True,
        )
    if reference_l1_grad and L == 1:  # the authors' l1 kernel: pooled-path gradient B times too small
        dbank = dbank / B
    gk, gv = dbank.unbind(0)
    return gk, gv


# ------------------------------------------------------------------------------------------------------ public API
def llsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int = 16,
    topk: int | Sequence[int] = 8,
    num_levels: int | None = None,
    enrich_levels: int | None = None,
    scale: float | None = None,
    *,
    index: Sequence[torch.Tensor] | None = None,
    means: torch.Tensor | None = None,
    reference_l1_grad: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """Log-linear sparse attention, differentiable in q, k, v.

    Args:
        q, k, v: ``[batch, heads, tokens, head_dim]``, tokens in locality (Z-) order; tokens must be a multiple of
            ``block_size ** num_levels``. Triton path: fp16/bf16/fp32 and head_dim in {16, 32, 64, 128}.
        block_size: B, tokens per block and pooling factor per level; a power of two >= 16.
        topk: K (same at every level) or ``[K_1, ..., K_L]`` (finest first); clamped to the candidates
            (``K_L <= N_L``, ``K_l <= K_{l+1} * B``), must be >= 1.
        num_levels: L >= 1; None -> ``llsa_num_levels(tokens, block_size)`` (the paper's floor(log_B N - 1)).
        enrich_levels: pooled levels 1..L_e that enter the softmax (None -> L; 0 -> fine tokens only).
        scale: logit scale, None -> 1/sqrt(head_dim).
        index: precomputed ``llsa_select`` tables (tests, diagnostics); None -> selected from q, k.
        means: the fp32 block means of q, k and v stacked, ``[3, batch, heads, tokens / block_size, head_dim]``
            without gradient, when the caller has them (``qk_norm_rope(..., pool_block=block_size)`` computes them
            while writing q, k, v); the first level of the selection's and the pooled bank's pyramids. None ->
            computed here. Means that are not those of q, k, v give a wrong selection and bank.
        reference_l1_grad: reproduce the authors' l1 kernel's gradient through the pooled K/V, which is B times too
            small (docs/algorithms.md, "LLSA"); only affects L = 1. Off = the true gradient.
        impl: "auto" (Triton on CUDA, PyTorch on CPU), "triton" (also under TRITON_INTERPRET=1), "torch".
    Returns:
        ``[batch, heads, tokens, head_dim]`` in the input dtype (under CUDA autocast, fp32 inputs run and return
        the autocast dtype, like SDPA). The Triton path returns it as a view of a tokens-major ``[batch, tokens,
        heads, head_dim]`` tensor, so ``o.transpose(1, 2).reshape(batch, tokens, -1)`` copies nothing.
    """
    triton_path = use_triton(q, impl)
    if triton_path:
        q, k, v = autocast_inputs(q, k, v)
    check_qkv(q, k, v, name="llsa_attention", scale=scale)
    b, h, N, d = q.shape
    cfg = llsa_check(N, block_size, num_levels, topk, enrich_levels)
    L, Le = cfg["num_levels"], cfg["enrich_levels"]
    scale = d**-0.5 if scale is None else float(scale)
    if index is not None:
        index = [t.to(device=q.device, dtype=torch.int32) for t in index]
        if len(index) != L:
            raise ValueError(f"llsa_attention: index must hold num_levels={L} tables, got {len(index)}")
    if means is not None:
        means = check_means(means, q, block_size, "llsa_attention")
    if not triton_path:
        if index is None:
            index = _select(q, k, block_size, cfg, "torch", means)
        return _llsa_torch(q, k, v, index, block_size, Le, scale, reference_l1_grad)
    B, n_bank = block_size, min(Le, L)
    full_lists = index is None  # a selection made here fills every slot; one given by the caller may hold -1
    # What this call pools, a contiguous run of (q, k, v): q to select, k to select or bank, v to bank. Their
    # pyramids are built stacked, one launch per level that also writes the bank's k and v rows (an eager call is
    # host-bound: every launch saved is host time saved).
    pooled = [name for name, wanted in zip("qkv", (index is None, index is None or Le >= 1, Le >= 1)) if wanted]
    with torch.no_grad():
        bank = offsets = None
        if Le >= 1:  # k's bank, then v's: levels 1..n_bank concatenated
            offsets, total = _bank_layout(N, B, L, Le)
            bank = torch.empty(2, b * h, total, d, device=q.device, dtype=q.dtype)
        if pooled:  # levels 1..L to select (q, k), 1..n_bank to bank (k, v); [len(pooled), b, h, N / B^l, d] fp32
            first = "qkv".index(pooled[0])
            xs = [x.detach() for x, name in zip((q, k, v), "qkv") if name in pooled]
            level1 = means[first : first + len(pooled)] if means is not None else block_means(xs, B)
            at = {name: i for i, name in enumerate(pooled)}
            pyramid = _pyramid_and_bank(level1, B, L if index is None else n_bank, bank, offsets or ())
        if index is None:
            qp, kp = ([level[at[name]] for level in pyramid] for name in "qk")
            index = _select_from_pooled(qp, kp, B, cfg["topk"], impl="triton")
        bank_k = bank_v = coarse_lists = None
        if Le >= 1:
            bank_k, bank_v = bank.unbind(0)
            coarse_lists = _coarse_lists(index, N, B, L, Le, q.device)
    fine_lists = index[0].reshape(b * h, N // B, index[0].shape[-1])
    cand_widths = tuple(index[lvl].shape[-1] for lvl in range(1, min(Le, L - 1) + 1))
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    v_in_place = not needs_grad and _tokens_major(v)
    o = _LLSATriton.apply(
        q,
        k,
        v,
        bank_k,
        bank_v,
        fine_lists,
        coarse_lists,
        cand_widths,
        B,
        L,
        Le,
        scale,
        reference_l1_grad,
        full_lists,
        v_in_place,
    )
    return o.transpose(1, 2)  # [b, N, h, d] in memory
