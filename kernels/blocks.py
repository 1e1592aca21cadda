"""Shared building blocks of the sparse-attention kernels (LLSA, VSA, SLA and the dense `impl: triton` path).

Everything here is deterministic and, but for one pooling kernel, plain PyTorch that runs on CPU and CUDA:

* ``block_mean(x, block_size)``            fp32 mean over consecutive blocks of tokens (a partial last block is
                                            averaged over its real tokens); ``block_mean_adjoint`` its gradient.
* ``block_means(xs, block_size)``          the same means of several tensors by a Triton kernel, no gradient (the
                                            Triton paths' pooling: LLSA's first level, VSA's tiles, SLA's scores).
* ``topk_desc(scores, k, ids=None)``        top-k ids by descending score, ties -> smaller id, bitwise reproducible.
* ``csr_to_csc(index, num_cols)``           transpose of a per-row list of column ids (CSR) into per-column lists of
                                            row ids (CSC), rows ascending inside a column; no float atomics.

The Triton block-sparse attention that consumes these tables lives in ``block_sparse.py``.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import triton
import triton.language as tl

from .ops import INTERPRET, cdiv, custom_op, next_power_of_2, shape_constant

__all__ = [
    "block_mean",
    "block_mean_adjoint",
    "block_means",
    "topk_desc",
    "csr_to_csc",
    "exact_fp32_matmul",
    "fp32_matmul",
]


@contextmanager
def fp32_matmul(precision: str):
    """Matmuls of fp32 tensors at ``torch.set_float32_matmul_precision(precision)`` and with autocast off inside
    (the caller's settings come back after): under a training step's autocast they would otherwise run in bf16."""
    old = torch.get_float32_matmul_precision()
    if old != precision:
        torch.set_float32_matmul_precision(precision)
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            yield
    finally:
        if old != precision:
            torch.set_float32_matmul_precision(old)


def exact_fp32_matmul():
    """Selection scores are fp32 (docs/algorithms.md): TF32 and autocast off inside."""
    return fp32_matmul("highest")


def block_mean(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of ``block_size`` consecutive tokens, accumulated in fp32.

    x: ``[..., tokens, dim]`` -> ``[..., ceil(tokens / block_size), dim]`` float32. When ``tokens`` is not a multiple
    of ``block_size`` the last block is the mean over its real tokens only (SLA's tail block).
    Differentiable: the adjoint gives each token its block's ``grad / count`` in x's dtype.
    """
    return _BlockMean.apply(x, block_size)


def _block_mean_values(x: torch.Tensor, block_size: int) -> torch.Tensor:
    n, d = x.shape[-2], x.shape[-1]
    full = n // block_size
    if full * block_size == n:  # one reduction, fp32 accumulation without an fp32 copy of x
        return x.reshape(*x.shape[:-2], full, block_size, d).mean(dim=-2, dtype=torch.float32)
    out = x[..., : full * block_size, :].reshape(*x.shape[:-2], full, block_size, d).mean(dim=-2, dtype=torch.float32)
    tail = x[..., full * block_size :, :].mean(dim=-2, keepdim=True, dtype=torch.float32)
    return torch.cat([out, tail], dim=-2)


class _BlockMean(torch.autograd.Function):
    """``block_mean`` with a one-pass adjoint. Autograd's own (of ``mean(dtype=float32)``) writes an fp32 gradient
    as large as x, then casts it to x's dtype: two extra passes over a full-size tensor, ~0.2 ms per q, k or v
    at 65,536 tokens x 12 heads (VSA's coarse stage differentiates all three). Here the small ``grad / count`` is
    computed in fp32 and broadcast into x's dtype by one copy: the same values, bit for bit."""

    @staticmethod
    def forward(ctx, x, block_size):
        ctx.block_size, ctx.shape, ctx.dtype = block_size, x.shape, x.dtype
        return _block_mean_values(x, block_size)

    @staticmethod
    def backward(ctx, grad):
        return block_mean_adjoint(grad, ctx.shape, ctx.dtype, ctx.block_size), None


def block_mean_adjoint(grad: torch.Tensor, shape, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """The gradient of ``block_mean`` for an input of ``shape``: each token gets its block's ``grad / count`` (the
    block's real tokens), written once in ``dtype``. grad: ``[..., ceil(tokens / block_size), dim]``."""
    B, (n, d), lead = block_size, shape[-2:], shape[:-2]
    full = n // B
    gx = grad.new_empty(shape, dtype=dtype)
    gx[..., : full * B, :].view(*lead, full, B, d).copy_(grad[..., :full, None, :] / B)
    if full * B < n:
        gx[..., full * B :, :].copy_(grad[..., full:, :] / (n - full * B))
    return gx


@triton.jit
def _block_means_kernel(
    X0,
    X1,
    X2,
    OUT,
    stride_b,
    stride_h,
    stride_n,
    stride_d,
    heads,
    n,
    n_blocks,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # program: GROUP consecutive blocks of BLOCK tokens of one (batch, head) of input X<axis 2> (up to three inputs of
    # one layout per launch); their fp32 means over their real tokens (a partial last block: the tokens before n),
    # rows of OUT[axis 2]
    tile, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x = X0
    if which == 1:
        x = X1
    if which == 2:
        x = X2
    x += (bh // heads).to(tl.int64) * stride_b + (bh % heads).to(tl.int64) * stride_h
    OUT += which.to(tl.int64) * (tl.num_programs(1) * n_blocks * HEAD_DIM)
    blocks = tile * GROUP + tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM)
    rows = blocks[:, None, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :, None]
    ok = blocks < n_blocks
    tokens = tl.load(x + rows * stride_n + dims[None, None, :] * stride_d, mask=(rows < n), other=0.0)
    count = tl.minimum(tl.maximum(n - blocks.to(tl.int64) * BLOCK, 1), BLOCK).to(tl.float32)  # real tokens
    means = tl.sum(tokens.to(tl.float32), axis=1) / count[:, None]
    out = OUT + (bh.to(tl.int64) * n_blocks + blocks[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(out, means, mask=ok[:, None])


# (tokens, warps) of a pooling program: whole blocks of >= that many tokens, on >= that many warps (one more warp per
# 4,096 values). On an H100 at LLSA 256² (q, k, v of 2 x 6 x 65,536 x 64 bf16, 302 MB) one warp per 32 tokens took
# 0.116 ms, 64 tokens 0.118, 512 tokens on 4 warps 0.129, 128 tokens on 4 warps 0.170 (the warps split each block's
# rows, so its sum crossed them through shared memory), PyTorch's reduction over the middle dim of [..., blocks, B,
# d] 0.141 (docs/kernel_notes.md v48).
BLOCK_MEANS_PROGRAM = (32, 1)


@custom_op("block_means")
def block_means(xs: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """``block_mean`` of each of the same-shaped ``xs`` ``[b, h, N, d]`` (any strides), stacked: fp32 ``[len(xs), b,
    h, ceil(N / block_size), d]``, the same means summed in the kernel's order (the oracle tests compare them with a
    tolerance). No gradient: the pooling of the Triton paths' selections (and LLSA's bank, VSA's coarse stage)."""
    b, h, n, d = xs[0].shape
    n_blocks = cdiv(n, block_size)
    out = torch.empty(len(xs), b, h, n_blocks, d, device=xs[0].device, dtype=torch.float32)
    tokens, warps = BLOCK_MEANS_PROGRAM
    group = max(1, tokens // block_size)
    warps = max(warps, group * block_size * d // 4096)
    # inputs of one layout and dtype share a launch, up to three (an eager call is host-bound: a launch costs host time)
    layout = [(x.stride(), x.dtype) for x in xs]
    first = 0
    while first < len(xs):
        last = first + 1
        while last < min(first + 3, len(xs)) and layout[last] == layout[first]:
            last += 1
        three = (xs[first:last] * 3)[:3]  # unused pointers repeat a used one
        _block_means_kernel[(cdiv(n_blocks, group), b * h, last - first)](
            *three,
            out[first],
            *xs[first].stride(),
            h,
            n,
            n_blocks,
            BLOCK=block_size,
            GROUP=group,
            HEAD_DIM=d,
            num_warps=warps,
        )
        first = last
    return out


@block_means.register_fake
def _(xs, block_size):
    b, h, n, d = xs[0].shape
    return xs[0].new_empty((len(xs), b, h, cdiv(n, block_size), d), dtype=torch.float32)


def _descending_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is (score descending, id ascending); unique when ids are unique.

    The fp32 score is mapped to an int32 that orders like the float (flip the magnitude bits of negatives), put in
    the high 32 bits; ``2**32 - 1 - id`` in the low bits makes the smaller id win a tie. A unique key per element
    makes ``torch.topk`` exact and deterministic on every device (its own tie order is unspecified).
    """
    s = scores.float() + 0.0  # turns -0.0 into +0.0 so that the two zeros tie
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids.to(torch.int64))


def topk_desc(scores: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Ids of the ``k`` largest scores along the last dim: descending score, ties -> smaller id, deterministic.

    scores: ``[..., n]`` (compared in fp32; fp64 inputs use an exact stable sort). ids: ``[..., n]`` integer ids of
    the candidates (distinct within a row, < 2**31), default ``arange(n)``. Returns int32 ``[..., k]``.
    """
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"topk_desc: k must be in [1, {n}] (number of candidates), got {k}")
    if ids is None:
        ids = torch.arange(n, device=scores.device).expand(scores.shape)
    if scores.dtype == torch.float64:  # exact path for oracles: sort ids ascending, then a stable descending sort
        ids_sorted, perm = ids.sort(dim=-1)
        s = scores.gather(-1, perm)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
        return ids_sorted.gather(-1, order).to(torch.int32)
    keys = _descending_keys(scores, ids)
    top = torch.topk(keys, k, dim=-1, sorted=True).values
    return ((1 << 32) - 1 - (top & 0xFFFFFFFF)).to(torch.int32)


INT32_KEYS_BELOW = 2**31  # csr_to_csc sorts int32 keys when all fit (half the radix passes of int64)
# csr_to_csc by counts instead of one sort (``_csr_to_csc_by_counts``), for CUDA tensors and the interpreter: the
# same offsets and rows, bit for bit. On an H100 (docs/kernel_notes.md v58 (a)), LLSA forward + backward 1.030x at
# 256², 1.042x at 128² and 1.016x at 512², L = 3 against the radix sort; with the prefix sums in PyTorch instead of
# ``_csc_prefix_kernel`` it was 1.010x / 1.024x (v57 (f))
CSC_BY_COUNTS = True
# Most entries per program of the transpose by counts (sorted in registers; a power of two): 512 measured faster
# than 4,096 (a grid of 8 x 12 programs at 256²) and, with the PyTorch prefix sums, than 256 (v57 (f))
CSC_CHUNK = 512
# Its per-chunk column counts grow as entries x columns / chunk: above this many the sort runs instead (LLSA's fine
# lists at 256² take 3.1 M counts for 2 x 6 heads, 6.3 M for 4 x 6; SLA's at 256², K = 32, 12.6 M)
CSC_COUNTS_LIMIT = 2**23


def _csc_chunk(entries: int) -> int:
    """Entries per program of the transpose by counts: ~32 chunks of 64 to ``CSC_CHUNK`` (a grid that fills more of
    the GPU than a few long sorts). Doubled by comparisons only, so that a traced call's symbolic sizes pass."""
    chunk = 64
    while chunk < CSC_CHUNK and chunk * 32 < entries:
        chunk *= 2
    return chunk


def _csc_by_counts(index: torch.Tensor, num_cols: int) -> bool:
    """Whether ``csr_to_csc`` counts (``CSC_BY_COUNTS``): for CUDA tensors or under the interpreter, where the counts
    fit ``CSC_COUNTS_LIMIT`` and the sort keys (column, entry) fit int32."""
    if not CSC_BY_COUNTS:
        return False
    batch, rows, width = index.shape
    chunk = _csc_chunk(rows * width)
    counts = batch * cdiv(rows * width, chunk) * (num_cols + 2)
    on_device = index.is_cuda or INTERPRET
    return on_device and 0 < counts <= CSC_COUNTS_LIMIT and (num_cols + 3) * chunk < 2**31


@triton.jit
def _run_length(first_a, last_a, run_a, first_b, last_b, run_b):
    """The scan operator of ``_csc_rank_kernel`` over sorted column ids: a stretch's (first id, last id, entries in
    its last id's run); a run continues across the join where the right stretch is one run of the left's last id."""
    joined = (first_b == last_b) & (last_a == first_b)
    return first_a, last_b, tl.where(joined, run_a + run_b, run_b)


@triton.jit
def _chunk_columns(INDEX, n_entries, n_stored, CHUNK: tl.constexpr):
    """This program's ``CHUNK`` consecutive entries (row-major) of one batch row of the lists: ``(batch row, chunk,
    positions in the chunk, entries, entry mask, stored columns)``. Of the ``n_stored = num_cols + 2`` stored
    columns, column c is c + 1, an empty slot (-1) 0, and an id past the last column ``n_stored - 1``: after every
    column, where the sort puts it too (an id that is not < num_cols breaks csr_to_csc's contract, but no write of
    this transpose may then land outside its output)."""
    chunk, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    pos = tl.arange(0, CHUNK)
    entry = chunk * CHUNK + pos
    ok = entry < n_entries
    col = tl.load(INDEX + b * n_entries + entry, mask=ok, other=-1) + 1
    return b, chunk, pos, entry, ok, tl.minimum(tl.maximum(col, 0), n_stored - 1)


@triton.jit
def _csc_rank_kernel(INDEX, RANK, COUNTS, n_entries, n_chunks, n_stored, CHUNK: tl.constexpr):
    # program: one chunk of entries (_chunk_columns). Writes each entry's rank among this chunk's entries of its
    # column that come before it, and adds the chunk's count of each column (integer atomics: the same counts in any
    # order)
    b, chunk, pos, entry, ok, col = _chunk_columns(INDEX, n_entries, n_stored, CHUNK)
    col = tl.where(ok, col, n_stored)  # past the last entry: after every column
    keys = tl.sort(col * CHUNK + pos)  # by column, then by entry
    sorted_col = keys // CHUNK
    sorted_entry = chunk * CHUNK + keys % CHUNK
    ones = tl.full([CHUNK], 1, tl.int32)
    _, _, run = tl.associative_scan((sorted_col, sorted_col, ones), 0, _run_length)
    real = sorted_col < n_stored
    tl.store(RANK + b * n_entries + sorted_entry, run - 1, mask=real)
    tl.atomic_add(COUNTS + (b * n_chunks + chunk) * n_stored + sorted_col, ones, mask=real)


@triton.jit
def _csc_prefix_kernel(COUNTS, TOTALS, n_chunks, n_stored, CHUNKS: tl.constexpr, COLS: tl.constexpr):
    # program: COLS columns of one batch row, all its chunks (CHUNKS >= n_chunks) as one tile: each chunk's count of
    # a column is replaced by the column's entries in the chunks before it, and the column's total is stored
    chunks = tl.arange(0, CHUNKS)
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    b = tl.program_id(1).to(tl.int64)
    ok = (chunks < n_chunks)[:, None] & (cols < n_stored)[None, :]
    ptrs = COUNTS + (b * n_chunks + chunks[:, None]) * n_stored + cols[None, :]
    counts = tl.load(ptrs, mask=ok, other=0)
    upto = tl.cumsum(counts, 0)
    tl.store(ptrs, upto - counts, mask=ok)
    tl.store(TOTALS + b * n_stored + cols, tl.sum(counts, 0), mask=cols < n_stored)


@triton.jit
def _csc_scatter_kernel(
    INDEX,
    RANK,
    BEFORE,
    ENDS,
    ROWS,
    n_entries,
    n_chunks,
    n_stored,
    width,
    SLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # program: the same chunk of entries; each goes to its column's start (the previous stored column's end, ENDS
    # has n_stored - 1 of them) plus the column's entries in the earlier chunks (BEFORE) plus its rank in this chunk,
    # as its row (or slot, SLOTS)
    b, chunk, _, entry, ok, col = _chunk_columns(INDEX, n_entries, n_stored, CHUNK)
    rank = tl.load(RANK + b * n_entries + entry, mask=ok, other=0)
    before = tl.load(BEFORE + (b * n_chunks + chunk) * n_stored + col, mask=ok, other=0)
    start = tl.load(ENDS + b * (n_stored - 1) + col - 1, mask=ok & (col > 0), other=0)
    value = entry if SLOTS else entry // width
    tl.store(ROWS + b * n_entries + start + before + rank, value.to(tl.int32), mask=ok)


@custom_op("csr_to_csc_by_counts")
def _csr_to_csc_by_counts(index: torch.Tensor, num_cols: int, slots: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``csr_to_csc`` by counting (``CSC_BY_COUNTS``): per chunk of entries, each entry's rank within its column and
    the column counts; prefix sums of the counts over the chunks and over the columns give each column's start per
    chunk, and every entry lands at start + rank. Integers only, no order-dependent step. A list of ``n`` entries
    is cut into ``_csc_chunk(n)`` chunks. A custom op: torch.compile cannot trace Triton launches made from here
    (the interpreter's pointers, the grid arithmetic), and the backward that calls it is traced."""
    batch, rows, width = index.shape
    n = rows * width
    chunk = _csc_chunk(n)
    n_chunks, n_stored = cdiv(n, chunk), num_cols + 2  # empty slots, the columns, ids past them
    flat = index.reshape(batch, n).to(torch.int32).contiguous()
    rank = torch.empty_like(flat)
    counts = torch.zeros(batch, n_chunks, n_stored, device=index.device, dtype=torch.int32)
    warps = max(1, min(8, chunk // 512))
    _csc_rank_kernel[(n_chunks, batch)](flat, rank, counts, n, n_chunks, n_stored, CHUNK=chunk, num_warps=warps)
    totals = torch.empty(batch, n_stored, device=index.device, dtype=torch.int32)
    tile_chunks = next_power_of_2(n_chunks)
    cols = max(1, min(512, 8192 // tile_chunks))  # a tile of at most 8,192 counts per program
    _csc_prefix_kernel[(cdiv(n_stored, cols), batch)](
        counts, totals, n_chunks, n_stored, CHUNKS=tile_chunks, COLS=cols, num_warps=8
    )
    # ends[j]: the entries of stored columns <= j, i.e. where list column j starts (ends[0]: the empty slots)
    ends = torch.cumsum(totals[:, : num_cols + 1], 1, dtype=torch.int32)
    out = torch.empty_like(flat)
    _csc_scatter_kernel[(n_chunks, batch)](
        flat, rank, counts, ends, out, n, n_chunks, n_stored, width, SLOTS=slots, CHUNK=chunk, num_warps=warps
    )
    return ends, out


@_csr_to_csc_by_counts.register_fake
def _(index, num_cols, slots):
    batch, rows, width = index.shape
    offsets = index.new_empty((batch, num_cols + 1), dtype=torch.int32)
    return offsets, index.new_empty((batch, rows * width), dtype=torch.int32)


def csr_to_csc(index: torch.Tensor, num_cols: int, slots: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Transpose per-row column lists into per-column row lists, deterministically (the key-major backward walks them).

    index: int ``[batch, rows, width]`` column ids in ``[0, num_cols)``; ``-1`` marks an empty slot. Ids must be
    distinct within a row. Returns ``(offsets, rows)``: int32 ``[batch, num_cols + 1]`` and int32
    ``[batch, rows * width]``; the rows that list column ``c`` are ``rows[b, offsets[b, c]:offsets[b, c + 1]]``,
    ascending (empty slots are sorted to the front, so ``offsets[b, 0]`` = their number, not always 0). Implemented
    as one sort of the unique integer keys ``b * span + (c + 1) * rows + r`` (``span = (num_cols + 1) * rows``): a
    stable order of the (b, c, r) triples, the same on every run and device, no atomics, so the dk/dv sums that
    follow the lists are bitwise reproducible. One flat sort of int32 keys where they fit: a batched (segmented) sort
    of int64 keys costs about twice the radix passes. ``slots=True``: each entry is the slot ``r * width + s`` that
    lists the column (``index[b, r, s] = c``) instead of the row ``r``, still ascending (where a per-slot result of
    the row pass is stored: ``bsa_backward_dkdv_grouped``). ``CSC_BY_COUNTS``: the same result by counting
    (``_csr_to_csc_by_counts``) instead of the sort.
    """
    if index.dim() != 3:
        raise ValueError(f"csr_to_csc: index must be [batch, rows, width], got shape {tuple(index.shape)}")
    if _csc_by_counts(index, num_cols):
        return _csr_to_csc_by_counts(index, num_cols, slots)
    batch, rows, width = index.shape
    per_col = rows * width if slots else rows  # the entries one column can hold
    span = (num_cols + 1) * per_col
    dtype = torch.int32 if batch * span < INT32_KEYS_BELOW else torch.int64
    # The index tensors below depend only on the sizes: kept for eager calls (``shape_constant``), each one arange
    # (the step carries the batch's multiplier) where made; in an eager backward each tiny launch costs host time and
    # ~1-2 us of GPU time, and two of these transposes run per LLSA backward.
    dev = index.device

    def key_base():  # b * span + per_col + entry
        start = torch.arange(per_col, batch * span + per_col, span, device=dev, dtype=dtype).view(batch, 1, 1)
        entry = torch.arange(per_col, device=dev, dtype=dtype).view(1, rows, -1)  # r, or r * width + s
        return start + entry

    base = shape_constant(("csc key base", batch, rows, per_col, span, dtype), dev, key_base)
    # b * span + (c + 1) * per_col + entry (an empty slot: c + 1 = 0)
    keys = torch.add(base, index.to(dtype), alpha=per_col)
    keys = torch.sort(keys.flatten()).values
    # offsets[b, c]: the keys below column c's first key b * span + (c + 1) * per_col, which is (t + 1) * per_col
    # for t = b * (num_cols + 1) + c
    bounds = shape_constant(
        ("csc column bounds", per_col, batch * span, dtype),
        dev,
        lambda: torch.arange(per_col, batch * span + 1, per_col, device=dev, dtype=dtype),
    )
    total = batch * rows * width
    # int32 keys mean fewer than 2^31 entries (total < batch * span): the search's positions fit int32 as well
    ends = torch.searchsorted(keys, bounds, out_int32=dtype == torch.int32).view(batch, -1)
    first = shape_constant(
        ("csc batch firsts", total, rows * width, ends.dtype),
        dev,
        lambda: torch.arange(0, total, rows * width, device=dev, dtype=ends.dtype).view(batch, 1),
    )
    offsets = (ends - first).to(torch.int32)
    return offsets, (keys % per_col).to(torch.int32).view(batch, rows * width)
