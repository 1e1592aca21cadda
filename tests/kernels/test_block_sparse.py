"""Shared building blocks on CPU: deterministic top-k, CSR->CSC transpose, fp32 block mean, and the Triton
block-sparse attention (TRITON_INTERPRET=1, set in conftest.py) against an fp64 dense masked softmax.

    .venv/bin/python -m pytest tests/kernels/test_block_sparse.py -q
"""

import os

import pytest
import torch
import triton

from pixdit.kernels import block_mean, block_sparse_attention, blocks, csr_to_csc, flash_attention, topk_desc
from pixdit.kernels import block_sparse as block_sparse_module
from pixdit.kernels.topk import pooled_topk

needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()  # the kernel may run on CUDA, the oracle on CPU
    return ((a - b).norm() / b.norm()).item()


def test_topk_desc_matches_stable_sort_with_ties_and_signs():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(-3, 4, (64, 40), generator=g).float() * 0.5  # many ties, negatives, +-0
    s[0, :5] = -0.0
    ids = torch.randperm(40, generator=g).expand(64, 40)
    got = topk_desc(s, 7, ids)
    for r in range(64):
        want = sorted(range(40), key=lambda c: (-s[r, c].item(), ids[r, c].item()))[:7]
        assert got[r].tolist() == [ids[r, c].item() for c in want]
    assert topk_desc(s.double(), 7, ids).tolist() == got.tolist()
    with pytest.raises(ValueError, match="k must be in"):
        topk_desc(s, 41)


@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("int32_keys,by_counts", [(True, False), (False, False), (True, True)])
def test_csr_to_csc_is_the_exact_transpose_with_ascending_rows(int32_keys, by_counts, slots, monkeypatch):
    """Against a Python transpose: the sort (int32 and int64 keys) and, where the kernels run (a GPU or the
    interpreter), the counts."""
    if not int32_keys:  # the int64 keys of tables too big for int32
        monkeypatch.setattr(blocks, "INT32_KEYS_BELOW", 0)
    monkeypatch.setattr(blocks, "CSC_BY_COUNTS", by_counts)
    g = torch.Generator().manual_seed(1)
    batch, rows, width, cols = 3, 37, 5, 11
    index = torch.stack(
        [torch.stack([torch.randperm(cols, generator=g)[:width] for _ in range(rows)]) for _ in range(batch)]
    ).int()
    index[:, ::4, -1] = -1  # empty slots
    assert blocks._csc_by_counts(index.to(DEVICE), cols) == (by_counts and (DEVICE == "cuda" or blocks.INTERPRET))
    offsets, flat = csr_to_csc(index.to(DEVICE), cols, slots=slots)
    offsets, flat = offsets.cpu(), flat.cpu()
    assert offsets.dtype == flat.dtype == torch.int32 and offsets.shape == (batch, cols + 1)
    for bi in range(batch):
        assert offsets[bi, -1] - offsets[bi, 0] == (index[bi] >= 0).sum() and offsets[bi, -1] == index[bi].numel()
        for c in range(cols):
            got = flat[bi, offsets[bi, c] : offsets[bi, c + 1]].tolist()
            listing = [(r, row.index(c)) for r, row in enumerate(index[bi].tolist()) if c in row]
            assert got == [r * width + s if slots else r for r, s in listing]


@needs_interpreter
@pytest.mark.parametrize("slots", [False, True])
# 5 chunks of 64 entries (the last one partial, chunks splitting rows), one chunk, several blocks of 512 columns
@pytest.mark.parametrize("rows,cols", [(53, 40), (9, 40), (40, 1100)])
def test_csr_to_csc_by_counts_is_the_sorts_transpose_bit_for_bit(slots, rows, cols, monkeypatch):
    """``blocks.CSC_BY_COUNTS``: the transpose by per-chunk ranks and column counts gives the sort's offsets and rows
    exactly, with empty slots (-1), rows listing nothing, columns nobody lists, and chunks that split a row."""
    g = torch.Generator().manual_seed(3)
    batch, width = 3, 6
    index = torch.stack(
        [torch.stack([torch.randperm(cols, generator=g)[:width] for _ in range(rows)]) for _ in range(batch)]
    ).int()
    index[:, ::5, -2:] = -1  # empty slots
    index[:, 7] = -1  # a row that lists nothing
    index[index == 13] = -1  # a column that nobody lists
    monkeypatch.setattr(blocks, "CSC_BY_COUNTS", False)
    want = csr_to_csc(index, cols, slots=slots)
    monkeypatch.setattr(blocks, "CSC_BY_COUNTS", True)
    calls = []
    by_counts = blocks._csr_to_csc_by_counts
    monkeypatch.setattr(blocks, "_csr_to_csc_by_counts", lambda *a: calls.append(a) or by_counts(*a))
    got = csr_to_csc(index.to(DEVICE), cols, slots=slots)
    assert len(calls) == 1 and all(t.dtype == torch.int32 for t in got)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    monkeypatch.setattr(blocks, "CSC_COUNTS_LIMIT", batch * (cols + 2) - 1)  # counts of one chunk too many: the sort
    assert all(torch.equal(a.cpu(), b) for a, b in zip(csr_to_csc(index.to(DEVICE), cols, slots=slots), want))
    assert len(calls) == 1


@needs_interpreter
def test_csr_to_csc_by_counts_keeps_ids_past_the_last_column_inside_its_output(monkeypatch):
    """Ids >= num_cols break the contract, but a transpose that must not write outside its output takes them (the
    test of ``bsa_backward_dkdv_grouped`` lists blocks past its range's end): every column's rows as a Python
    transpose has them, the empty slots counted in ``offsets[:, 0]``, the ids past the end after every column."""
    g = torch.Generator().manual_seed(5)
    batch, rows, width, cols = 3, 70, 4, 9
    index = torch.stack(
        [torch.stack([torch.randperm(cols + 2, generator=g)[:width] for _ in range(rows)]) for _ in range(batch)]
    ).int()  # ids cols and cols + 1: past the last column
    index[:, ::6, -1] = -1
    monkeypatch.setattr(blocks, "CSC_BY_COUNTS", True)
    assert blocks._csc_by_counts(index.to(DEVICE), cols)
    offsets, flat = (x.cpu() for x in csr_to_csc(index.to(DEVICE), cols, slots=True))
    for b in range(batch):
        listing = index[b].view(-1).tolist()
        assert offsets[b, 0] == listing.count(-1)
        for c in range(cols):
            assert flat[b, offsets[b, c] : offsets[b, c + 1]].tolist() == [e for e, x in enumerate(listing) if x == c]
        assert sorted(flat[b, offsets[b, -1] :].tolist()) == [e for e, x in enumerate(listing) if x >= cols]


def test_csr_to_csc_keeps_its_index_tensors_for_eager_calls_only(monkeypatch):
    """The transposes' shape-only index tensors are made once per shape and kept for eager calls
    (``ops.shape_constant``): a cold call, a warm one, one of another shape in between and one under a dispatch mode
    (as tracing runs it: made anew, nothing kept) give the same transposes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pixdit.kernels import ops

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(ops, "_shape_constants", {})
    monkeypatch.setattr(blocks, "CSC_BY_COUNTS", False)  # the sort's index tensors (the counts need none)
    g = torch.Generator().manual_seed(4)
    index = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(2 * 7)]).view(2, 7, 3).int()
    other = torch.stack([torch.randperm(13, generator=g)[:4] for _ in range(3 * 5)]).view(3, 5, 4).int()
    cold = csr_to_csc(index, 9, slots=True)
    kept = dict(ops._shape_constants)
    assert len(kept) == 3  # the keys' base, the column bounds, the batches' first entries
    csr_to_csc(other, 13)
    assert len(ops._shape_constants) == 6
    warm = csr_to_csc(index, 9, slots=True)
    assert all(ops._shape_constants[key] is tensor for key, tensor in kept.items())  # read, not made again
    with Passthrough():
        traced = csr_to_csc(index, 9, slots=True)
        csr_to_csc(index, 10, slots=True)  # a new shape: made, not kept
    assert len(ops._shape_constants) == 6
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(cold, warm, traced))
    # the same sizes but more columns: other index tensors, not the kept ones
    wider = csr_to_csc(index, 12, slots=True)
    with Passthrough():
        assert all(torch.equal(a, b) for a, b in zip(wider, csr_to_csc(index, 12, slots=True)))
    assert block_sparse_module.shared_csc(5, "cpu") is block_sparse_module.shared_csc(5, "cpu")
    with torch.inference_mode():  # kept from a sampling call, read later by training: not an inference tensor
        offsets, _ = block_sparse_module.shared_csc(6, "cpu")
    assert not offsets.is_inference()


def test_flatten_grad_is_flatten_heads_of_the_contiguous_tensor():
    """A transposed gradient (as a model's tokens-major output gives), a contiguous slice at a storage offset (q, k, v
    of one stacked buffer) and a 3-D tensor: the values and the [B*H, N, d] strides of a contiguous flatten."""
    base = torch.randn(3, 2, 40, 4, 8)
    for x in (base[0].transpose(1, 2), base[1], base[2, 0]):
        got = block_sparse_module.flatten_grad(x)
        want = block_sparse_module.flatten_heads(x.contiguous())
        assert torch.equal(got, want) and got.stride() == want.stride() and got.is_contiguous()


def test_block_mean_fp32_and_partial_tail():
    x = torch.randn(2, 3, 40, 8, dtype=torch.bfloat16)
    m = block_mean(x, 16)
    assert m.dtype == torch.float32 and m.shape == (2, 3, 3, 8)
    assert torch.allclose(m[:, :, 2], x[:, :, 32:].float().mean(2))
    assert torch.allclose(m[:, :, 0], x[:, :, :16].float().mean(2))


@needs_interpreter
@pytest.mark.parametrize(
    "b,h,n,d,B,dtype,tokens_major",
    [
        (1, 2, 16 * 5, 16, 16, torch.float32, False),  # 5 blocks in programs of 2: the last partly past the end
        (2, 3, 32 * 3, 32, 32, torch.float16, True),  # heads interleaved ([b, N, h, d] memory)
        (1, 1, 64 * 2, 128, 64, torch.float32, True),  # 2 warps (64 tokens x 128 dims a program)
        (1, 2, 16 * 4 + 5, 16, 16, torch.float32, True),  # a partial last block of 5 tokens (SLA's tail)
        (2, 1, 37, 64, 32, torch.float16, False),  # a partial last block of 5 tokens in the last program's first block
    ],
)
def test_block_means_kernel_matches_block_mean(b, h, n, d, B, dtype, tokens_major):
    """The Triton paths' pooling (one launch for up to three tensors of one layout, fp32 sums in the kernel's order)
    against ``block_mean``: the same means up to fp32 rounding, a partial last block over its real tokens, each
    tensor in its own rows of the stacked output."""
    g = torch.Generator().manual_seed(n + d)
    xs = [torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    xs = [(x if tokens_major else x.contiguous()).to(DEVICE) for x in xs]
    got = blocks.block_means(xs, B)
    want = torch.stack([block_mean(x, B) for x in xs])
    assert got.shape == want.shape == (3, b, h, triton.cdiv(n, B), d) and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert not torch.equal(got[0], got[1])  # each tensor pooled into its own rows


class _Recorder:
    """A Triton kernel whose launches record their grids, then run."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@needs_interpreter
def test_block_means_launches_group_inputs_of_one_layout():
    """Up to three inputs of one layout and dtype share a launch (grid axis 2 picks the input): pooled together or one
    at a time, each tensor's means are the same bits, in mixed layouts and dtypes that split the launches."""
    g = torch.Generator().manual_seed(3)
    b, h, n, d, B = 2, 3, 16 * 6, 32, 16
    tokens_major = lambda dtype: torch.randn(b, n, h, d, generator=g).to(dtype).transpose(1, 2)  # noqa: E731
    plain = lambda dtype: torch.randn(b, h, n, d, generator=g).to(dtype)  # noqa: E731
    f16, f32 = torch.float16, torch.float32
    # launches: [0, 1, 2], [3], [4], [5, 6]
    xs = [plain(f16), plain(f16), plain(f16), plain(f16), tokens_major(f16), plain(f32), plain(f32)]
    xs = [x.to(DEVICE) for x in xs]
    launches = []
    real = blocks._block_means_kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "_block_means_kernel", _Recorder(real, launches))
        got = blocks.block_means(xs, B)
    assert [grid[2] for grid in launches] == [3, 1, 1, 2]
    for i, x in enumerate(xs):
        assert torch.equal(got[i], blocks.block_means([x], B)[0]), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [5, 16, 64, 70])
def test_block_mean_adjoint_equals_autograds_of_the_plain_mean_bit_for_bit(dtype, n):
    """block_mean's one-pass backward against autograd through ``mean(dtype=float32)`` (and the mean of the tail
    block over its real tokens), also on a non-contiguous input."""
    x = torch.randn(2, n, 3, 8, dtype=dtype).requires_grad_()
    xt = x.transpose(1, 2)  # [2, 3, n, 8], not contiguous
    full = n // 16
    parts = [xt[:, :, : 16 * full].reshape(2, 3, full, 16, 8).mean(3, dtype=torch.float32)]
    if 16 * full < n:
        parts.append(xt[:, :, 16 * full :].mean(2, keepdim=True, dtype=torch.float32))
    plain = torch.cat(parts, 2)
    ours = block_mean(xt, 16)
    assert torch.equal(ours, plain)
    g = torch.randn_like(plain)
    got, want = (torch.autograd.grad(y, x, g)[0] for y in (ours, plain))
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_pooled_topk_children_mode(impl):
    g = torch.Generator().manual_seed(2)
    qp, kp = torch.randn(2, 64, 32, generator=g), torch.randn(2, 64, 32, generator=g)
    parents = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(2 * 4)]).view(2, 4, 2)
    got = pooled_topk(qp.to(DEVICE), kp.to(DEVICE), 5, parents=parents.to(DEVICE), child_block=16, impl=impl).cpu()
    for bi in range(2):
        for r in range(64):
            cand = [p * 16 + j for p in parents[bi, r // 16].tolist() for j in range(16)]
            sc = {c: (qp[bi, r].double() @ kp[bi, c].double()).item() for c in cand}
            assert got[bi, r].tolist() == sorted(cand, key=lambda c: (-sc[c], c))[:5]


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("n_cand,k,ties", [(1100, 7, False), (1100, 33, True), (300, 1, True), (2049, 16, False)])
def test_pooled_topk_all_candidates_matches_fp64_oracle(impl, n_cand, k, ties):
    """Every key a candidate, beyond the one-shot kernel's 1024 (the two-pass route on Triton): exact top-k set
    and order, ties to the smaller id, against a stable fp64 sort; partial last chunk; several (batch*head) slices."""
    g = torch.Generator().manual_seed(5)
    if ties:  # small integers: exact fp32 dot products, many equal scores, also across chunk borders
        qp = torch.randint(-2, 3, (3, 24, 16), generator=g).float()
        kp = torch.randint(-2, 3, (3, n_cand, 16), generator=g).float()
    else:
        qp, kp = torch.randn(3, 24, 32, generator=g), torch.randn(3, n_cand, 32, generator=g)
    got = pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl=impl).cpu()
    want = topk_desc(qp.double() @ kp.double().transpose(-1, -2), k)
    assert got.dtype == torch.int32 and got.shape == (3, 24, k)
    assert torch.equal(got, want)


@needs_interpreter
@pytest.mark.parametrize("rows_per_program", [16, 32])
def test_streaming_topk_launch_variants_match_fp64_oracle(rows_per_program):
    """Both program heights, on tie-heavy scores with 12 chunks of candidates and k = 5."""
    from pixdit.kernels.topk import _streaming_topk

    g = torch.Generator().manual_seed(6)
    qp = torch.randint(-1, 2, (2, 24, 16), generator=g).float()
    kp = torch.randint(-1, 2, (2, 1500, 16), generator=g).float()
    out = torch.empty(2, 24, 5, dtype=torch.int32, device=DEVICE)
    got = _streaming_topk(qp.to(DEVICE), kp.to(DEVICE), 5, out, rows_per_program).cpu()
    assert torch.equal(got, topk_desc(qp.double() @ kp.double().transpose(-1, -2), 5))


def dense_masked_reference(q, k, v, lists, qb, kb, logw=None):
    """fp64 softmax over the keys of the listed blocks (a dense mask built from the lists)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    lists = lists.expand(b, h, -1, -1)
    rows = torch.arange(nq) // qb
    key_blk = torch.arange(nk) // kb
    sel = (lists[:, :, rows, :, None] == key_blk) & (lists[:, :, rows, :, None] >= 0)  # [b, h, nq, len, nk]
    mask = sel.any(3)
    s = (q.double() @ k.double().transpose(-1, -2)) * d**-0.5
    if logw is not None:
        s = s + logw.double()[key_blk]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
# (qb, kb, nq, tail): blocks >= 64 take the scalar-id paths; tail 0 = no partial block anywhere (unmasked loads)
@pytest.mark.parametrize(
    "qb,kb,nq,tail",
    [(16, 16, 200, 7), (32, 16, 100, 7), (64, 32, 150, 7), (32, 64, 256, 7), (64, 64, 256, 0), (128, 64, 256, 0)],
)
# the Triton walks read short lists from registers (listed_ids) and long ones step by step: both, on the same lists
@pytest.mark.parametrize("ids_in_registers", [True, False])
# head dim 128: the 16-row programs keep a warpgroup and the transposed backward (block_sparse.program_warps)
@pytest.mark.parametrize("d", [32, 128])
def test_block_sparse_attention_vs_dense_masked_softmax(impl, qb, kb, nq, tail, ids_in_registers, d, monkeypatch):
    if impl == "torch" and not ids_in_registers:
        pytest.skip("the PyTorch path walks no lists")
    if d == 128 and (qb, kb, ids_in_registers) != (16, 16, True):
        pytest.skip("head dim 128 changes only the programs of 16 rows")
    if not ids_in_registers:
        monkeypatch.setattr(block_sparse_module, "LIST_IN_REGISTERS", 0)
    g = torch.Generator().manual_seed(3)
    b, h = 2, 2
    nk = nq - tail  # partial last key block when tail > 0
    q = torch.randn(b, h, nq, d, generator=g)
    k, v = torch.randn(b, h, nk, d, generator=g), torch.randn(b, h, nk, d, generator=g)
    n_tiles, n_blocks = -(-nq // qb), -(-nk // kb)
    lists = torch.stack([torch.randperm(n_blocks, generator=g)[:3] for _ in range(b * h * n_tiles)])
    lists = lists.view(b, h, n_tiles, 3).int()
    lists[:, :, 1::2, 2] = -1
    logw = torch.rand(n_blocks, generator=g)
    go, gl = torch.randn(b, h, nq, d, generator=g), torch.randn(b, h, nq, generator=g)
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    o, lse = block_sparse_attention(
        *leaves,
        lists.to(DEVICE),
        query_block=qb,
        key_block=kb,
        block_log_weights=logw.to(DEVICE),
        return_lse=True,
        impl=impl,
    )
    ((o * go.to(DEVICE)).sum() + (lse * gl.to(DEVICE)).sum()).backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rl = dense_masked_reference(*ref_leaves, lists, qb, kb, logw)
    ((ro * go.double()).sum() + (rl * gl.double()).sum()).backward()
    assert rel(o, ro) < 1e-5 and rel(lse, rl) < 1e-5
    for a, r in zip(leaves, ref_leaves):
        assert rel(a.grad, r.grad) < 1e-5


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("used", ["o", "lse"])
def test_block_sparse_gradients_when_only_one_output_is_used(impl, used):
    # the backward computes Δ in the dq kernel when the LSE is unused, and starts from dO = 0 when only the LSE is
    g = torch.Generator().manual_seed(5)
    b, h, n, d, blk = 1, 2, 96, 32, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    lists = torch.stack([torch.randperm(n // blk, generator=g)[:2] for _ in range(b * h * (n // blk))])
    lists = lists.view(b, h, n // blk, 2).int()
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    o, lse = block_sparse_attention(
        *leaves, lists.to(DEVICE), query_block=blk, key_block=blk, return_lse=True, impl=impl
    )
    (o.square().sum() if used == "o" else lse.sum()).backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rl = dense_masked_reference(*ref_leaves, lists, blk, blk, None)
    (ro.square().sum() if used == "o" else rl.sum()).backward()
    for a, r in zip(leaves, ref_leaves):
        if r.grad is None:  # the LSE does not depend on v
            assert a.grad is None or not a.grad.any()
        else:
            assert rel(a.grad, r.grad) < 1e-5


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_flash_attention_is_dense_softmax(impl):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 130, 32, generator=g) for _ in range(3))
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, impl=impl)
    o.sum().backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r = torch.nn.functional.scaled_dot_product_attention(*ref_leaves)
    r.sum().backward()
    assert rel(o, r) < 1e-5
    for a, b in zip(leaves, ref_leaves):
        assert rel(a.grad, b.grad) < 1e-5


def test_split_count_gives_about_split_programs_programs():
    """Key-major lists split into about SPLIT_PROGRAMS programs in all, at least 8 list entries a part, at most 64
    parts: LLSA's coarsest level at 256², L = 2 (2 x 6 heads x 4 key groups, 1,024 query tiles) in 8 parts (one wave
    of its programs on a 132-SM GPU), at 512², L = 3 (6 x 1 groups, 4,096 tiles) in 64; enough programs already, or
    short lists, are not split."""
    from pixdit.kernels.block_sparse import SPLIT_PROGRAMS, split_count

    assert SPLIT_PROGRAMS == 384
    assert split_count(48, 1024) == 8 and split_count(6, 4096) == 64 and split_count(24, 1024) == 16
    assert split_count(384, 1024) == 1 == split_count(4096, 4096) and split_count(48, 40) == 5


@needs_interpreter
def test_flash_attention_split_key_major_lists():
    """1,100 tokens, one head: the dk/dv pass (64-key programs over the shared list of 18 query tiles of 64 rows)
    splits each list over 2 programs and sums their fp32 parts; the forward and dq walk all keys as one range in
    128-row tiles, the last tile and the last 64-key step partial."""
    from pixdit.kernels.block_sparse import DENSE_KV_TILE, split_count

    n = 1100
    assert split_count(triton.cdiv(n, DENSE_KV_TILE), triton.cdiv(n, DENSE_KV_TILE)) == 2  # the case under test
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(1, 1, n, 16, generator=g) for _ in range(4))
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v)]
    o = flash_attention(*leaves, impl="triton")
    o.backward(go.to(DEVICE))
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r = torch.nn.functional.scaled_dot_product_attention(*ref_leaves)
    r.backward(go.double())
    assert rel(o, r) < 1e-5
    for a, b in zip(leaves, ref_leaves):
        assert rel(a.grad, b.grad) < 1e-5


@needs_interpreter
@pytest.mark.parametrize(
    "key_block,group_rows,d,dtype",
    [
        (16, 256, 32, torch.float32),
        (32, 128, 16, torch.float32),
        (64, 64, 128, torch.float32),
        (16, 256, 64, torch.float16),  # half inputs (bf16 dots are wrong in the Triton 3.8 interpreter)
    ],
)
def test_grouped_dkdv_matches_fp64_autograd(key_block, group_rows, d, dtype):
    """``bsa_backward_dkdv_grouped``: each group of ``group_rows`` queries attends to the blocks its list names (log
    weights, empty slots, a partial last group); dk/dv of the range against fp64 autograd of that attention, blocks
    nobody lists zero, rows outside the range untouched."""
    g = torch.Generator().manual_seed(key_block + d)
    bh, n_groups, width, n_blocks = 2, 3, 3, 10
    nq, nk = group_rows * (n_groups - 1) + 64, n_blocks * key_block - 5  # last group and last key block partial
    q, k, v, do = (torch.randn(bh, n, d, generator=g) for n in (nq, nk, nk, nq))
    lists = torch.stack([torch.randperm(n_blocks - 1, generator=g)[:width] + 1 for _ in range(bh * n_groups)])
    lists = lists.view(bh, n_groups, width).int()
    lists[0, 1, 2] = -1  # an empty slot; block 0 is listed by nobody
    log_w = torch.rand(n_blocks, generator=g)
    scale = d**-0.5
    # fp64 reference: the attention each group's rows have, its LSE and Δ, then dK, dV by autograd
    group = torch.arange(nq) // group_rows
    blk = torch.arange(nk) // key_block
    allowed = (lists.long()[:, group, :, None] == blk.view(1, 1, 1, nk)).any(2)  # [bh, nq, nk]
    k64, v64 = (x.double().requires_grad_() for x in (k, v))
    s = (q.double() @ k64.transpose(1, 2)) * scale + log_w.double()[blk]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v64
    o.backward(do.double())
    delta = (o.detach() * do.double()).sum(-1)
    on = lambda x: x.to(DEVICE)  # noqa: E731
    dk = torch.full((bh, nk, d), 7.0, device=DEVICE)  # rows outside the range must stay 7
    dv = dk.clone()
    block_sparse_module.bsa_backward_dkdv_grouped(
        *(on(x.to(dtype)) for x in (q, k, v, do)),
        on(lse.float()),
        on(delta.float()),
        on(lists),
        group_rows,
        key_block,
        scale,
        on(log_w),
        blk_range=(0, n_blocks - 1),
        dk=dk,
        dv=dv,
    )
    inside = slice(0, (n_blocks - 1) * key_block)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel(dk[:, inside], k64.grad[:, inside]) < tol and rel(dv[:, inside], v64.grad[:, inside]) < tol
    assert (dk[:, :key_block] == 0).all() and (dv[:, :key_block] == 0).all()  # block 0: listed by nobody
    assert (dk[:, inside.stop :] == 7).all() and (dv[:, inside.stop :] == 7).all()


def forward_and_dq(q, k, v, do, lists, query_block, key_block, scale, **options):
    """``bsa_forward`` then ``bsa_backward_dq`` (Δ computed on the way) of one query-major pass with the same
    ``options`` (tail, list weights, fullness): (o, lse, Δ, dq)."""
    bs = block_sparse_module
    o, lse = bs.bsa_forward(q, k, v, lists, query_block, key_block, scale, **options)
    delta = torch.empty(q.shape[:2], device=q.device)
    dq = bs.bsa_backward_dq(q, k, v, do, lse, delta, lists, query_block, key_block, scale, o=o, **options)
    return o, lse, delta, dq


@needs_interpreter
@pytest.mark.parametrize("key_block,tail", [(16, True), (32, False)])
def test_one_list_weight_and_full_lists_are_the_per_block_masked_walk_bit_for_bit(key_block, tail):
    """LLSA's pooled pass at L = 2 (one candidate level) gives its lists one weight (``list_log_weight``: a scalar per
    step) and promises no empty slot (``full_lists``: no masks; at L = 3 with weights per block). Forward and dq equal
    those of the same lists with that weight per block and the masked walk, bit for bit. A list with an empty slot
    keeps its masks unless the caller promises fullness; a broken promise reads block 0 in the empty slot."""
    g = torch.Generator().manual_seed(key_block)
    bh, d, qb, n_blocks, width = 2, 32, 64, 12, 64 // key_block * 2
    nq, nk = 3 * qb - 8, n_blocks * key_block + (64 if tail else 0)  # a partial last query tile; tail rows last
    q, k, v, do = (torch.randn(bh, n, d, generator=g).half().to(DEVICE) for n in (nq, nk, nk, nq))
    tiles = triton.cdiv(nq, qb)
    lists = torch.stack([torch.randperm(n_blocks - 1, generator=g)[:width] + 1 for _ in range(bh * tiles)])
    lists = lists.view(bh, tiles, width).int().to(DEVICE)
    weight = 2.772588722239781  # ln 16
    per_block = torch.full((triton.cdiv(nk, key_block),), weight, device=DEVICE)
    dense_tail = (n_blocks * key_block, nk, 2 * weight) if tail else None
    scale = d**-0.5

    def run(lst, **weights):
        return forward_and_dq(q, k, v, do, lst, qb, key_block, scale, dense_tail=dense_tail, **weights)

    want = run(lists, log_weights=per_block)
    got = run(lists, list_log_weight=weight, full_lists=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = run(lists, log_weights=per_block, full_lists=True)  # LLSA at L = 3: weights per block, no masks
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    holed = lists.clone()
    holed[1, 0, 1] = -1
    want = run(holed, log_weights=per_block)
    got = run(holed, list_log_weight=weight, full_lists=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[0], run(lists, log_weights=per_block)[0])  # the empty slot mattered
    # a broken promise (an empty slot under full_lists, as a selection over NaN scores can leave) reads block 0,
    # which no list names here, instead of memory outside k and v
    got = run(holed, list_log_weight=weight, full_lists=True)
    assert all(torch.equal(a, b) for a, b in zip(got, run(holed.clamp_min(0), log_weights=per_block)))


@needs_interpreter
@pytest.mark.parametrize("tail", [True, False])
def test_list_weights_by_runs_are_the_per_block_walk_bit_for_bit(tail):
    """LLSA's pooled lists at L >= 3 hold one run of columns per candidate level, each with its own weight: passed as
    ``(columns, log weight)`` runs (``list_log_weight``; a scalar per step), forward, Δ and dq equal the per-block
    weights' walk bit for bit, with two runs and with three. Runs that end inside a step (a step has one weight), do
    not cover the list, or are too many are refused, naming the parameter."""
    g = torch.Generator().manual_seed(3)
    bh, d, qb, kb, n_blocks = 2, 32, 64, 16, 30
    nq, nk = 2 * qb, n_blocks * kb + (64 if tail else 0)
    q, k, v, do = (torch.randn(bh, n, d, generator=g).half().to(DEVICE) for n in (nq, nk, nk, nq))
    scale, ln16 = d**-0.5, 2.772588722239781
    dense_tail = (n_blocks * kb, nk, 3 * ln16) if tail else None
    lists = None

    def run(**weights):
        return forward_and_dq(q, k, v, do, lists, qb, kb, scale, dense_tail=dense_tail, full_lists=True, **weights)

    for runs in ([(4, ln16), (8, 2 * ln16)], [(4, ln16), (4, 2 * ln16), (4, 3 * ln16)]):
        # run r lists blocks 10 r .. 10 r + 9 only (as LLSA's levels sit in different bank rows), so that one table
        # of weights per block says the same as the runs
        per_block = torch.zeros(triton.cdiv(nk, kb))
        for r, (_, w) in enumerate(runs):
            per_block[10 * r : 10 * r + 10] = w
        cols = [(c, 10 * r) for r, (c, _) in enumerate(runs)]
        rows = [torch.cat([torch.randperm(10, generator=g)[:c] + lo for c, lo in cols]) for _ in range(bh * 2)]
        lists = torch.stack(rows)
        lists = lists.view(bh, 2, 12).int().to(DEVICE)
        want = run(log_weights=per_block.to(DEVICE))
        got = run(list_log_weight=runs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), runs
    for bad, why in (
        ([(2, ln16), (10, 2 * ln16)], "end at multiples of the 4 blocks"),
        ([(4, ln16), (4, 2 * ln16)], "cover the list's 12 columns"),
        ([(4, ln16)] * 4, "1 to 3"),
    ):
        with pytest.raises(ValueError, match=f"list_log_weight.*{why}"):
            run(list_log_weight=bad)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # (the interpreter computes no bf16 on the CPU)
# (query rows, key block, tail rows): the scalar-id walk in steps of 64 keys (blocks of 64, or 128 in two steps), the
# dense tail, both in one launch, and a 16-key walk (narrower than TMA_MIN_ROWS: pointer loads either way)
@pytest.mark.parametrize("qb,kb,tail", [(64, 64, 0), (128, 128, 0), (64, 64, 128), (64, 16, 128), (16, 16, 0)])
@pytest.mark.parametrize("v_view", [False, True])  # v as the columns of a fused qkv tensor (tokens-major, row stride)
def test_forward_by_tma_is_the_pointer_walk_bit_for_bit(dtype, qb, kb, tail, v_view, monkeypatch):
    """The forward's and the dq's contiguous walks take K and V by TMA descriptors where their steps are >= 64 whole
    rows (``tma_descriptors``): the same numbers as pointer loads, bit for bit, including lists whose first slots are
    empty and ids read a step ahead (lists longer than the registers hold); and the fp64 oracle."""
    g = torch.Generator().manual_seed(kb + tail)
    b, h, d = 1, 2, 32  # two heads: v's rows in qkv are 2 * h * d apart, and bh > 0 offsets the descriptors
    n_blocks = 6 if kb < 128 else 3
    nq, nk = 256 if qb >= 64 else 64, n_blocks * kb + tail  # (16-row programs: fewer of them, for the time)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    kv = torch.randn(b, nk, 2, h, d, generator=g).to(dtype)
    k = kv[:, :, 0].transpose(1, 2).contiguous()
    v = kv[:, :, 1].transpose(1, 2)  # [b, h, nk, d] as a view of kv: tokens-major, rows 2 * h * d apart
    v = v if v_view else v.contiguous()
    n_tiles = nq // qb
    lists = torch.stack([torch.randperm(n_blocks, generator=g)[: n_blocks - 1] for _ in range(b * h * n_tiles)])
    lists = lists.view(b * h, n_tiles, n_blocks - 1).int()
    lists[:, ::2, 0] = -1  # the walk's first step is an empty slot
    lists[:, 1::2, 1:3] = -1  # empty slots inside the list (every tile keeps a block)
    dense_tail = (n_blocks * kb, nk, 0.5) if tail else None
    bs = block_sparse_module
    qf, kf = (t.reshape(b * h, -1, d).to(DEVICE) for t in (q, k))
    vf = v.to(DEVICE).transpose(1, 2) if v_view else v.reshape(b * h, nk, d).to(DEVICE)
    made = []  # DESC_ROWS of each launch (0: pointer loads)
    descriptors = bs.tma_descriptors

    def recorded(*args):
        got = descriptors(*args)
        made.append(got[2])
        return got

    monkeypatch.setattr(bs, "tma_descriptors", recorded)

    do = torch.randn(b * h, nq, d, generator=g).to(dtype).to(DEVICE)
    v_flat = v.reshape(b * h, nk, d).contiguous().to(DEVICE)  # the dq reads k and v with one layout

    def run(tma, ids_in_registers):
        monkeypatch.setattr(bs, "TMA_LOADS", tma)
        monkeypatch.setattr(bs, "LIST_IN_REGISTERS", 128 if ids_in_registers else 0)
        o, lse = bs.bsa_forward(qf, kf, vf, lists.to(DEVICE), qb, kb, d**-0.5, dense_tail=dense_tail)
        delta = torch.empty(b * h, nq, device=DEVICE)
        dq = bs.bsa_backward_dq(
            qf, kf, v_flat, do, lse, delta, lists.to(DEVICE), qb, kb, d**-0.5, o=o, dense_tail=dense_tail
        )
        return o, lse, delta, dq

    want = run(False, True)
    assert made[-2:] == [0, 0]  # the forward's and the dq's launch
    for tma, in_registers in ((True, True), (True, False), (False, False)):
        got = run(tma, in_registers)
        assert all(torch.equal(a, w) for a, w in zip(got, want)), (tma, in_registers)
        # the walk that can, loads by TMA: the list walk's steps (128 keys for 128-row programs with 16-bit inputs over
        # blocks of 128), else the dense tail's 64
        rows = bs.forward_step_keys(qb, kb, d, dtype) if kb >= 64 else 64
        assert made[-2] == (rows if tma and (kb >= 64 or tail) else 0)
        assert made[-1] == (64 if tma and (kb >= 64 or tail) else 0)  # the dq steps by at most 64 keys
    # the oracle: the dense tail as more listed blocks of every tile, with the tail's log weight
    tail_ids = torch.arange(n_blocks, nk // kb).int().expand(b * h, n_tiles, -1)
    logw = torch.tensor([0.0] * n_blocks + [0.5] * (tail // kb))
    ref, _ = dense_masked_reference(q, k, v, torch.cat([lists, tail_ids], -1).view(b, h, n_tiles, -1), qb, kb, logw)
    assert rel(want[0], ref.reshape(b * h, nq, d)) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_interpreter
# (query tile, query rows): tiles of 64 rows in one step, of 128 in two; 200 rows leave a partial last tile, so every
# step masks its rows and loads q and dO by pointers
@pytest.mark.parametrize("qb,nq", [(64, 256), (128, 256), (64, 200)])
@pytest.mark.parametrize("do_view", [False, True])  # dO tokens-major [b, N, h, d], as a model hands it back
def test_key_major_backward_by_tma_is_the_pointer_walk_bit_for_bit(qb, nq, do_view, monkeypatch):
    """The key-major dk/dv walks its query tiles of >= 64 rows in steps of 64 whole rows and takes their q and dO by
    TMA descriptors (``tma_descriptors``) where every row exists: the same dk and dv as pointer loads, bit for bit;
    and the fp64 oracle's gradients."""
    g = torch.Generator().manual_seed(qb + nq)
    b, h, d, kb, nk, dtype = 2, 3, 32, 64, 256, torch.float16
    n_tiles, n_blocks = -(-nq // qb), nk // kb
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n in (nq, nk, nk))
    do = torch.randn(b, nq, h, d, generator=g).to(dtype)  # tokens-major
    lists = torch.stack([torch.randperm(n_blocks, generator=g)[:3] for _ in range(b * h * n_tiles)]).int()
    lists = lists.view(b * h, n_tiles, 3)
    bs = block_sparse_module
    qf, kf, vf = (t.reshape(b * h, -1, d).to(DEVICE) for t in (q, k, v))
    do_flat = do.transpose(1, 2).reshape(b * h, nq, d).to(DEVICE)
    o, lse = bs.bsa_forward(qf, kf, vf, lists.to(DEVICE), qb, kb, d**-0.5)
    delta = bs.delta_rows(o, do_flat)
    csc = bs.csr_to_csc(lists.to(DEVICE), n_blocks)
    seen = []  # DESC_ROWS of each dk/dv launch (0: pointer loads)

    class Recorded:  # the autotuned launcher, recording its DESC_ROWS
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["DESC_ROWS"]) or self.kernel[grid](*a, **kw)

    monkeypatch.setattr(bs, "_dkdv", Recorded(bs._dkdv))

    def run(tma):
        monkeypatch.setattr(bs, "TMA_LOADS", tma)
        grad = do.to(DEVICE) if do_view else do_flat
        return bs.bsa_backward_dkdv(qf, kf, vf, grad, lse, delta, csc, qb, kb, d**-0.5)

    want = run(False)
    got = run(True)
    assert seen == [0, 0 if nq % qb else 64]
    assert all(torch.equal(a, w) for a, w in zip(got, want))
    # the oracle: fp64 autograd through the dense masked softmax
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = dense_masked_reference(q64, k64, v64, lists.view(b, h, n_tiles, 3), qb, kb)
    ref.backward(do.transpose(1, 2).double())
    for mine, exact in zip(got, (k64.grad, v64.grad)):
        assert rel(mine.reshape(b, h, nk, d), exact) < 2e-3


def test_programs_of_128_rows(monkeypatch):
    """128-row forward programs walk blocks of >= 128 keys in steps of 128 on 4 warps (16-bit inputs, head dim <=
    64), everything else in steps of at most 64 on ``program_warps``; 8-warp programs keep at most 32 ids in
    registers (more read a step ahead), the others up to LIST_IN_REGISTERS. Without autotuning, 128-row forward and
    dq programs launch with 3 stages, every other program with 2."""
    bs, bf16, f32 = block_sparse_module, torch.bfloat16, torch.float32
    monkeypatch.setattr(bs, "AUTOTUNE", False)
    assert [bs._launch(kind, 128, 64, bf16)["num_stages"] for kind in ("forward", "dq", "dkdv")] == [3, 3, 2]
    assert [bs._launch(kind, 64, 64, bf16)["num_stages"] for kind in ("forward", "dq", "dkdv")] == [2, 2, 2]
    assert bs._forward_launch(128, 128, 64, bf16) == {"num_warps": 4, "num_stages": 3}
    assert bs._n_sub(256) == 4 and bs._n_sub(256, 128) == 2 and bs._n_sub(16) == 1
    assert [bs.forward_step_keys(128, kb, 64, bf16) for kb in (16, 64, 128, 256)] == [16, 64, 128, 128]
    assert bs.forward_step_keys(64, 128, 64, bf16) == 64 and bs.forward_step_keys(128, 128, 128, bf16) == 64
    assert bs.forward_step_keys(128, 128, 64, f32) == 64
    assert [bs.forward_warps(128, kb, 64, bf16) for kb in (64, 128)] == [8, 4]
    assert bs.forward_warps(64, 128, 64, bf16) == 4 and bs.forward_warps(16, 16, 64, bf16) == 1
    assert bs.forward_ids_in_registers(128, 64, 64, bf16) == 32
    assert bs.forward_ids_in_registers(128, 128, 64, bf16) == bs.LIST_IN_REGISTERS
    assert bs.list_slots(33, 1, 32) == 0 and bs.list_slots(32, 1, 32) == 32 and bs.list_slots(20, 1) == 32


@needs_interpreter
def test_a_dense_walk_launches_by_its_tail_steps(monkeypatch):
    """flash_attention's query tiles and key blocks are 128 rows, but it walks no list, only the dense tail in steps
    of TAIL_STEP: its launch takes the rules of those steps (8 warps), not the 128-key steps of listed blocks, whose
    never-run loop would still be compiled (112 KB of shared memory instead of 65 on the H200)."""
    bs = block_sparse_module
    seen = []
    launch = bs._forward_launch
    monkeypatch.setattr(bs, "_forward_launch", lambda *a: seen.append(a) or launch(*a))
    q = torch.randn(1, 1, 256, 32, dtype=torch.float16).to(DEVICE)
    flash_attention(q, q, q, impl="triton")
    rows, walked, head_dim, dtype = seen[-1]
    assert (rows, walked) == (bs.DENSE_TILE, bs.TAIL_STEP.value)
    assert bs.forward_warps(rows, walked, head_dim, dtype) == 8


def test_block_sparse_rejects_bad_blocks():
    q = torch.randn(1, 1, 64, 32)
    lists = torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="key_block must be a power of two >= 16"):
        block_sparse_attention(q, q, q, lists, query_block=16, key_block=24)
    with pytest.raises(ValueError, match="query_block must be a positive multiple of 16"):
        block_sparse_attention(q, q, q, lists, query_block=8, key_block=16)
    with pytest.raises(ValueError, match="block_lists must be"):
        block_sparse_attention(q, q, q, lists, query_block=32, key_block=16)


def test_program_warps_and_the_autotuners_pruning_follow_the_program_size():
    """16-row programs on one warp (every pass one listed block per step); the forward of 32 rows on
    two, its (transposed) backward on a warpgroup; programs of < 64 rows with a head dim of 128 on a warpgroup; tiles
    of 64 and 128 rows on 4 and 8 warps. The autotuner times only the configurations of the launch's program."""
    from pixdit.kernels.block_sparse import (
        _CONFIGS,
        _WARPGROUP_PROGRAMS,
        _configs_for,
        _dkdv_kernel,
        _dq_kernel,
        _fwd_kernel,
        _grouped_dkdv_kernel,
        program_warps,
        transposed_backward,
        walk_blocks_per_step,
    )

    rows = (16, 32, 48, 64, 128, 256)
    # a one-warp program (16 query rows of a forward or dq, 16 keys of a dk/dv) walks one listed block per step; the
    # others gather blocks until a step has 64 rows
    assert [walk_blocks_per_step(r, 16, 64) for r in rows] == [1, 4, 4, 4, 4, 4]
    assert [walk_blocks_per_step(r, 32, 64) for r in rows] == [1, 2, 2, 2, 2, 2]
    assert walk_blocks_per_step(16, 16, 128) == 4 and walk_blocks_per_step(32, 32, 64) == 2
    assert walk_blocks_per_step(64, 32, 64) == 2
    assert [program_warps(r, False, 64) for r in rows] == [1, 2, 2, 4, 8, 8]
    assert [program_warps(r, True, 64) for r in rows] == [1, 4, 4, 4, 8, 8]
    assert [program_warps(r, b, 128) for r in rows for b in (False, True)] == [4] * 8 + [8] * 4
    # the backward computes transposed exactly where a program of < 64 rows gets a warpgroup
    assert [transposed_backward(r, 64) for r in rows] == [False, True, True, False, False, False]
    assert [transposed_backward(r, 128) for r in rows] == [True, True, True, False, False, False]
    fwd, dq = _configs_for(_fwd_kernel), _configs_for(_dq_kernel)
    dkdv, grouped = _configs_for(_dkdv_kernel), _configs_for(_grouped_dkdv_kernel)
    bf16 = {"Q": torch.empty(0, dtype=torch.bfloat16)}

    def tried(configs):  # the configurations without a register cap
        return sorted((c.num_warps, c.num_stages) for c in configs if c.maxnreg is None)

    def caps(configs):
        return [(c.num_warps, c.num_stages, c.maxnreg) for c in configs if c.maxnreg is not None]

    one_warp, warpgroup = [(1, 2), (1, 3), (1, 4)], sorted(_WARPGROUP_PROGRAMS)
    assert tried(fwd(_CONFIGS, bf16, BLOCK_M=16, HEAD_DIM=64)) == tried(dq(_CONFIGS, bf16, BLOCK_M=16, HEAD_DIM=64))
    assert tried(fwd(_CONFIGS, bf16, BLOCK_M=16, HEAD_DIM=64)) == one_warp
    assert tried(fwd(_CONFIGS, bf16, BLOCK_M=16, HEAD_DIM=128)) == warpgroup
    assert tried(fwd(_CONFIGS, bf16, BLOCK_M=32, HEAD_DIM=32)) == [(1, 2), (1, 3), (1, 4), (2, 2), (2, 3)]
    assert tried(dq(_CONFIGS, bf16, BLOCK_M=32, HEAD_DIM=64)) == tried(fwd(_CONFIGS, bf16, BLOCK_M=64, HEAD_DIM=64))
    assert tried(dq(_CONFIGS, bf16, BLOCK_M=32, HEAD_DIM=64)) == warpgroup
    # dk/dv programs are sized by their key rows (a group of 4 blocks of 16 keys is a 64-row program)
    assert tried(dkdv(_CONFIGS, {"QUERY_BLOCK": 64} | bf16, KEY_BLOCK=16, GROUP=1, HEAD_DIM=64)) == one_warp
    assert tried(dkdv(_CONFIGS, bf16, KEY_BLOCK=16, GROUP=4, HEAD_DIM=64)) == warpgroup
    # a register-capped configuration too, for the 64-row programs, the 16-key dk/dv and the 16-row forward of 16-bit
    # inputs at head dim <= 64 only
    assert caps(fwd(_CONFIGS, bf16, BLOCK_M=64, HEAD_DIM=64)) == [(4, 2, 96)]
    assert caps(dq(_CONFIGS, bf16, BLOCK_M=64, HEAD_DIM=32)) == [(4, 2, 128)]
    assert caps(dkdv(_CONFIGS, bf16, KEY_BLOCK=16, GROUP=4, HEAD_DIM=64)) == [(4, 2, 168)]
    assert caps(dkdv(_CONFIGS, bf16, KEY_BLOCK=64, GROUP=1, HEAD_DIM=64)) == [(4, 2, 168)]
    fp32 = {"Q": torch.empty(0)}
    assert caps(fwd(_CONFIGS, fp32, BLOCK_M=64, HEAD_DIM=64)) == caps(fwd(_CONFIGS, bf16, BLOCK_M=64, HEAD_DIM=128))
    assert (
        caps(fwd(_CONFIGS, fp32, BLOCK_M=64, HEAD_DIM=64)) == [] == caps(dq(_CONFIGS, bf16, BLOCK_M=128, HEAD_DIM=64))
    )
    assert caps(grouped(_CONFIGS, bf16, KEY_BLOCK=16, SLOTS=4, HEAD_DIM=64)) == [(4, 2, 168)]
    assert caps(grouped(_CONFIGS, bf16, KEY_BLOCK=16, SLOTS=2, HEAD_DIM=64)) == []
    assert tried(grouped(_CONFIGS, bf16, KEY_BLOCK=16, SLOTS=4, HEAD_DIM=64)) == warpgroup
    keeping_ds = {"KEY_BLOCK": 16, "GROUP": 1, "HEAD_DIM": 64, "DS_SLOTS": 8}
    assert caps(dkdv(_CONFIGS, bf16, **keeping_ds)) == [(1, 2, 128)]
    assert caps(fwd(_CONFIGS, bf16, BLOCK_M=16, HEAD_DIM=64)) == [(1, 2, 80)]
    assert caps(fwd(_CONFIGS, fp32, BLOCK_M=16, HEAD_DIM=64)) == [] == caps(dkdv(_CONFIGS, fp32, **keeping_ds))
    # a capped configuration is tried only by programs of its warps and cap: not a one-warp one at 168 by the 64-key
    # dk/dv (4 warps), nor by the one-warp dk/dv (its cap is 128)
    foreign = _CONFIGS + [triton.Config({}, num_warps=1, num_stages=2, maxnreg=168)]
    assert caps(dkdv(foreign, bf16, KEY_BLOCK=16, GROUP=4, HEAD_DIM=64)) == [(4, 2, 168)]
    assert caps(dkdv(foreign, bf16, **keeping_ds)) == [(1, 2, 128)]
    assert block_sparse_module._launch("dkdv", 16, 64, torch.bfloat16).get("maxnreg") == 128
    assert "maxnreg" not in block_sparse_module._launch("dkdv", 16, 64, torch.float32)
    assert block_sparse_module._launch("forward", 16, 64, torch.bfloat16).get("maxnreg") == 80
    assert block_sparse_module._launch("forward", 64, 64, torch.bfloat16).get("maxnreg") == 96
    assert "maxnreg" not in block_sparse_module._launch("forward", 32, 64, torch.bfloat16)


@needs_interpreter
@pytest.mark.parametrize("dtype,d", [(torch.float16, 64), (torch.float32, 32)])  # (no bf16 in the interpreter)
@pytest.mark.parametrize("start", [False, True])
def test_dq_from_the_ds_that_the_dkdv_kept_matches_fp64_autograd(dtype, d, start):
    check_dq_from_kept_ds(dtype, d, start, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 32)])
def test_gpu_dq_from_the_ds_that_the_dkdv_kept_matches_fp64_autograd(dtype, d):
    check_dq_from_kept_ds(dtype, d, True, "cuda")


def check_dq_from_kept_ds(dtype, d, start, device):
    """The fine level's backward in its dS-keeping form (LLSA with pooled levels: ``keeps_ds``): the key-major dk/dv
    keeps each listed (query block, key block) pair's dS, and ``bsa_backward_ds_dq`` sums dS K per query block. With
    a partial last query block and key block, an empty slot and (``start``) an earlier pass's fp32 dq: dq, dk, dv
    against fp64 autograd of the attention the lists describe, the kept dS against fp64's dS^T, dk and dv bit for bit
    those of the dk/dv that keeps nothing, and dq close to the recomputing ``bsa_backward_dq``."""
    g = torch.Generator().manual_seed(d + start)
    bh, blk, width, n_blocks = 2, 16, 4, 9
    nq, nk = 7 * blk - 5, n_blocks * blk - 3
    q, k, v, do = (torch.randn(bh, n, d, generator=g) for n in (nq, nk, nk, nq))
    tiles = triton.cdiv(nq, blk)
    lists = torch.stack([torch.randperm(n_blocks, generator=g)[:width] for _ in range(bh * tiles)])
    lists = lists.view(bh, tiles, width).int()
    lists[1, 2, 1] = -1  # an empty slot
    scale = d**-0.5
    # fp64 reference: each query block attends to the key blocks its list names
    allowed = (lists.long()[:, torch.arange(nq) // blk, :, None] == (torch.arange(nk) // blk).view(1, 1, 1, nk)).any(2)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = ((q64 @ k64.transpose(1, 2)) * scale).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1)
    o = p @ v64
    o.backward(do.double())
    lse = torch.logsumexp(s, -1).detach()
    delta = (o.detach() * do.double()).sum(-1)
    ds_ref = p.detach() * (do.double() @ v64.detach().transpose(1, 2) - delta[..., None])  # [bh, nq, nk], unscaled
    dq_start = torch.randn(bh, nq, d, generator=g) if start else None

    bs = block_sparse_module
    on = lambda x: x.to(device)  # noqa: E731
    args = [on(x.to(dtype)) for x in (q, k, v, do)] + [on(lse.float()), on(delta.float())]
    csc = csr_to_csc(on(lists), n_blocks)
    assert bs.keeps_ds(blk, blk, d)
    ds = bs.ds_buffer(on(lists), blk, blk, dtype)
    dk, dv = bs.bsa_backward_dkdv(*args, csc, blk, blk, scale, ds=ds, ds_lists=on(lists))
    dq = bs.bsa_backward_ds_dq(args[1], ds, on(lists), nq, blk, blk, scale, dq=on(dq_start) if start else None)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    dq_want = q64.grad + (dq_start.double() if start else 0)
    assert rel(dq, dq_want) < tol and rel(dk, k64.grad) < tol and rel(dv, v64.grad) < tol
    # the kept tiles: dS^T of each listed pair, [keys, query rows] (rows past nq and keys past nk left out)
    tiles_ds = ds.view(bh, tiles, width, blk, blk).double().cpu()
    for b, t, slot in [(0, 0, 0), (1, 2, 3), (0, tiles - 1, 2), (1, tiles - 1, 0)]:
        kb = int(lists[b, t, slot])
        rows = slice(t * blk, min(nq, (t + 1) * blk))
        keys = slice(kb * blk, min(nk, (kb + 1) * blk))
        want = ds_ref[b, rows, keys].T
        got = tiles_ds[b, t, slot, : want.shape[0], : want.shape[1]]
        assert rel(got, want) < tol, (b, t, slot)
    # keeping dS changes nothing in dk, dv; the recomputing dq is the same sum up to rounding
    dk0, dv0 = bs.bsa_backward_dkdv(*args, csc, blk, blk, scale)
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
    dq0 = bs.bsa_backward_dq(*args, on(lists), blk, blk, scale, dq=on(dq_start) if start else None)
    assert rel(dq, dq0) < tol / 5


def test_keeping_ds_is_refused_where_the_dkdv_programs_are_not_one_warp():
    bs = block_sparse_module
    assert bs.keeps_ds(16, 16, 64) and bs.keeps_ds(64, 16, 32)  # query blocks of up to 64 rows, one step each
    assert not bs.keeps_ds(16, 16, 128) and not bs.keeps_ds(16, 32, 64) and not bs.keeps_ds(128, 16, 64)
    q = torch.zeros(1, 32, 128)
    lists = torch.zeros(1, 2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="ds is kept only by one-warp programs"):
        bs.bsa_backward_dkdv(
            q,
            q,
            q,
            q,
            q[..., 0],
            q[..., 0],
            csr_to_csc(lists, 2),
            16,
            16,
            1.0,
            ds=bs.ds_buffer(lists, 16, 16, q.dtype),
            ds_lists=lists,
        )
