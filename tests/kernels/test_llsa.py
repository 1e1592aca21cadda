"""LLSA on CPU: exact PyTorch path and the Triton kernels under TRITON_INTERPRET=1 (set in conftest.py) against the
independent fp64 dense oracle (pixdit.kernels.reference), given the same index tables.

    .venv/bin/python -m pytest tests/kernels/test_llsa.py -q
"""

import math

import pytest
import torch

from pixdit.kernels import llsa_attention, llsa_check, llsa_num_levels, llsa_select
from pixdit.kernels.blocks import block_mean, block_means
from pixdit.kernels.reference import llsa_dense, llsa_hier_topk

needs_interpreter = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before pixdit.kernels is imported",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads(fn, q, k, v, go):
    for x in (q, k, v):
        x.grad = None
    o = fn(q, k, v)
    o.backward(go)
    return o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def compare_to_oracle(
    b, h, N, d, B, L, K, Le=None, impl="torch", reference_l1_grad=False, seed=0, tol=1e-5, dtype=None
):
    """LLSA's output and gradients against the fp64 oracle given the same selection (inputs in ``dtype``, fp32 by
    default)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(b, h, N, d, generator=g).to(dtype or torch.float32) for _ in range(4))
    q, k, v = (x.to(DEVICE).requires_grad_() for x in (q, k, v))
    go = go.to(DEVICE)
    ks = llsa_check(N, B, L, K, Le)["topk"]
    index = llsa_select(q, k, B, ks, L)
    ours = grads(
        lambda q, k, v: llsa_attention(
            q, k, v, B, K, L, Le, index=index, impl=impl, reference_l1_grad=reference_l1_grad
        ),
        q,
        k,
        v,
        go,
    )
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = grads(
        lambda q, k, v: llsa_dense(q, k, v, B, [i.long() for i in index], Le, reference_l1_grad=reference_l1_grad),
        q64,
        k64,
        v64,
        go.double(),
    )
    for name, a, r in zip(("o", "dq", "dk", "dv"), ours, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, r) < tol, (name, rel(a, r))
    return ours, ref


# ------------------------------------------------------------------------------------------------ configuration
def test_num_levels_follows_the_paper():
    assert [llsa_num_levels(n, 16) for n in (16, 256, 1024, 4096, 16384, 65536, 262144)] == [1, 1, 1, 2, 2, 3, 3]
    assert llsa_num_levels(768, 16) == 1 and llsa_num_levels(4096, 64) == 1


def test_check_reports_effective_settings():
    cfg = llsa_check(16384, 16, 2, 8)
    assert cfg["topk"] == [8, 8] and cfg["tokens_per_query"] == 128 + 128 + 64
    assert llsa_check(65536, 16, 3, 8)["tokens_per_query"] == 400  # 128 + 128 + 128 + 16 tokens per query
    assert llsa_check(65536, 16, 2, 8)["tokens_per_query"] == 512
    assert llsa_check(512, 16, 2, 8)["topk"] == [8, 2]  # K_L clamped to N_L = 2
    assert llsa_check(512, 16, 2, [64, 1])["topk"] == [16, 1]  # K_1 clamped to K_2 * B
    assert llsa_check(1024, 16, 2, 8, enrich_levels=1)["tokens_per_query"] == 128 + 64
    assert llsa_check(1024, 16, 2, 8, enrich_levels=0)["tokens_per_query"] == 128


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_tokens=1000, block_size=16), "multiple of block_size\\*\\*num_levels = 16, got 1000"),
        (dict(num_tokens=4096 + 16, block_size=16, num_levels=2), "= 256, got 4112"),
        (dict(num_tokens=1024, block_size=24), "power of two >= 16"),
        (dict(num_tokens=1024, block_size=8), "power of two >= 16"),
        (dict(num_tokens=1024, block_size=16, topk=0), "topk must be >= 1"),
        (dict(num_tokens=1024, block_size=16, topk=[8, 8]), "list of num_levels=1"),
        (dict(num_tokens=1024, block_size=16, num_levels=0), "num_levels must be an int >= 1"),
        (
            dict(num_tokens=1024, block_size=16, enrich_levels=2),
            "enrich_levels must be an int in \\[0, num_levels=1\\]",
        ),
        (dict(num_tokens=8, block_size=16), "at least block_size=16 tokens"),
    ],
)
def test_check_rejects_impossible_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        llsa_check(**kwargs)


def test_bad_tensor_inputs():
    q = torch.randn(1, 1, 256, 32)
    with pytest.raises(ValueError, match="same shape"):
        llsa_attention(q, q, torch.randn(1, 1, 256, 16))
    with pytest.raises(ValueError, match="batch, heads, tokens, head_dim"):
        llsa_attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        llsa_attention(q, q, q.long())
    for impl in ("triton", "torch"):  # both paths take the same inputs: what runs on CPU runs on the GPU
        with pytest.raises(ValueError, match="head_dim must be one of"):
            x = torch.randn(1, 1, 256, 48)
            llsa_attention(x, x, x, impl=impl)
    with pytest.raises(ValueError, match="multiple of block_size"):
        x = torch.randn(1, 1, 250, 32)
        llsa_attention(x, x, x)


# ------------------------------------------------------------------------------------- exact PyTorch path (CPU)
@pytest.mark.parametrize(
    "b,h,N,d,B,L,K,Le",
    [
        (2, 2, 256, 32, 16, 1, 8, None),  # l1 with N/B < 64 (the reference drops enrichment here)
        (1, 2, 3 * 256, 32, 16, 1, 8, None),  # token count not a power of two
        (2, 1, 2 * 16 * 16, 32, 16, 2, 8, None),  # L = 2, N_2 = 2 (partial coarsest block, K_2 clamped)
        (1, 1, 4096, 16, 16, 3, [4, 4, 1], None),  # L = 3
        (1, 2, 1024, 32, 16, 2, 8, 1),  # enrich_levels < L
        (1, 1, 1024, 32, 16, 2, 8, 0),  # no enrichment at all
        (1, 1, 1024, 32, 32, 1, 3, None),  # B = 32
        (1, 1, 512, 32, 16, 2, [32, 2], None),  # K_L = N_L and K_1 = K_2 * B (every candidate kept)
        (2, 2, 512, 32, 16, 1, 1, None),  # K = 1
    ],
)
def test_torch_path_matches_oracle(b, h, N, d, B, L, K, Le):
    compare_to_oracle(b, h, N, d, B, L, K, Le, impl="torch")


def test_torch_path_reference_l1_grad_scales_pooled_gradient():
    (o, dq, dk, dv), _ = compare_to_oracle(1, 2, 512, 32, 16, 1, 4, impl="torch", reference_l1_grad=True)
    (o2, dq2, dk2, dv2), _ = compare_to_oracle(1, 2, 512, 32, 16, 1, 4, impl="torch")
    assert torch.equal(o, o2) and torch.allclose(dq, dq2) and not torch.allclose(dk, dk2, rtol=1e-2)


# ------------------------------------------------------------------------------- Triton kernels (interpreter)
@needs_interpreter
@pytest.mark.parametrize(
    "b,h,N,d,B,L,K,Le",
    [
        (2, 2, 256, 32, 16, 1, 8, None),
        (1, 1, 3 * 256, 32, 16, 1, 8, None),
        (1, 2, 2 * 16 * 16, 32, 16, 2, 8, None),
        (1, 1, 1024, 32, 16, 2, 4, 1),
        (1, 1, 1024, 32, 32, 1, 3, None),
        (1, 1, 512, 32, 16, 2, [32, 2], None),
        (1, 1, 512, 64, 16, 1, 1, 0),
        (1, 1, 2048, 16, 16, 1, 4, None),  # coarsest level of 128 rows: whole contiguous steps, no mask
        (1, 1, 1024, 32, 64, 1, 2, None),  # B = 64: one fine block per pooled tile
        (1, 1, 1024, 32, 128, 1, 2, None),  # B = 128: a fine block spans two pooled tiles
    ],
)
def test_triton_matches_oracle(b, h, N, d, B, L, K, Le):
    compare_to_oracle(b, h, N, d, B, L, K, Le, impl="triton")


@needs_interpreter
def test_triton_reference_l1_grad():
    compare_to_oracle(1, 1, 512, 32, 16, 1, 4, impl="triton", reference_l1_grad=True)


@needs_interpreter
def test_triton_selection_made_here_equals_the_same_selection_given():
    """A selection that llsa_attention makes itself fills every slot of the pooled pass's lists, so that pass walks
    them without masks; the same selection given as ``index`` (which may hold empty slots) takes the masked walk.
    Output and gradients equal, bit for bit. (Both add the one candidate level's weight as a scalar: the oracle tests
    above check that weight, test_block_sparse checks it against the weight per block.)"""
    g = torch.Generator().manual_seed(11)
    L = 2  # one candidate level (L = 3, two runs: test_list_weights_by_runs_or_per_block_give_the_same_bits)
    q, k, v, go = (torch.randn(1, 2, 512, 16, generator=g).to(DEVICE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    index = llsa_select(q, k, 16, 4, L)
    made = grads(lambda q, k, v: llsa_attention(q, k, v, 16, 4, L, impl="triton"), q, k, v, go)
    given = grads(lambda q, k, v: llsa_attention(q, k, v, 16, 4, L, index=index, impl="triton"), q, k, v, go)
    assert all(torch.equal(a, b) for a, b in zip(made, given))


@needs_interpreter
@pytest.mark.parametrize("partial", ["float32", "input"])
def test_triton_fine_partial_in_either_dtype_matches_oracle(partial, monkeypatch):
    """The fine pass's partial output, which the pooled pass continues from, in fp32 or in the inputs' dtype
    (``PARTIAL_DTYPE``; the dtype the fine launch was given is pinned): fp16 inputs against the fp64 oracle."""
    from pixdit.kernels import block_sparse as bs
    from pixdit.kernels import llsa

    monkeypatch.setattr(llsa, "PARTIAL_DTYPE", partial)
    given = []
    forward = bs.bsa_forward
    monkeypatch.setattr(bs, "bsa_forward", lambda *a, **kw: given.append(kw.get("out_dtype")) or forward(*a, **kw))
    compare_to_oracle(1, 1, 1024, 32, 16, 2, 4, impl="triton", seed=5, tol=2e-3, dtype=torch.float16)
    assert given == [torch.float32 if partial == "float32" else torch.float16, torch.float16]  # fine, pooled


@needs_interpreter
def test_a_bad_partial_dtype_is_named(monkeypatch):
    """A ``PARTIAL_DTYPE`` other than its two values is refused with its name and the allowed values."""
    from pixdit.kernels import llsa

    monkeypatch.setattr(llsa, "PARTIAL_DTYPE", "bf16")
    q = torch.randn(1, 1, 256, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r'llsa.PARTIAL_DTYPE must be "float32" or "input".*got \'bf16\''):
        llsa_attention(q, q, q, 16, 4, 1, impl="triton")


@pytest.mark.parametrize(
    "N,L,K,runs,tail_rows,whole_steps",
    [
        (65536, 2, 8, None, 256, True),  # 256²: one weight, the coarsest level of 256 rows
        (16384, 2, 8, None, 64, True),  # 128²
        (262144, 3, 8, [(8, 1), (8, 2)], 64, True),  # 512², L = 3: one weight per level, a tail of one step
        (4096, 3, [4, 4, 1], [(4, 1), (1, 2)], 1, False),  # the last run ends inside a step: masked steps
        (4096, 3, [2, 2, 1], "per block", 1, False),  # a run ends inside a step that the next one goes on in
    ],
)
def test_pooled_pass_weights_at_llsas_sizes(N, L, K, runs, tail_rows, whole_steps):
    """What LLSA's pooled pass passes at its sizes (``_pooled_list_args``; B = 16, head dim 64): the candidate
    levels' weights as runs of ``l ln B`` where they end at whole steps, else per block; its coarsest level's rows;
    and whether its walk needs no masks (``FULL_LIST``: full lists of whole steps)."""
    from pixdit.kernels import block_sparse as bs
    from pixdit.kernels.llsa import COARSE_TILE, _bank_tail, _pooled_list_args

    B, d, ln16 = 16, 64, math.log(16)
    ks = llsa_check(N, B, L, K)["topk"]
    widths = tuple(ks[lvl] for lvl in range(1, L))
    logw = torch.zeros(4)
    args = _pooled_list_args(B, L, L, logw, widths, d, True)
    if runs == "per block":
        assert args == {"log_weights": logw, "full_lists": True}
    else:
        want = ln16 if runs is None else [(c, lvl * ln16) for c, lvl in runs]
        assert args == {"list_log_weight": want, "full_lists": True}
    lo, hi, _ = _bank_tail(N, B, L, L)
    assert hi - lo == tail_rows
    lists = torch.zeros(1, 1, sum(widths), dtype=torch.int32)
    weights = bs._list_args(
        logw if runs == "per block" else None,
        *bs.list_runs(args.get("list_log_weight")),
        True,
        lists,
        hi,
        B,
        bs.walk_blocks_per_step(COARSE_TILE, B, d),
    )
    assert weights["FULL_LIST"] == whole_steps
    assert weights["LIST_RUNS"] == (0 if runs == "per block" else len(runs or [None]))


@needs_interpreter
def test_list_weights_by_runs_or_per_block_give_the_same_bits(monkeypatch):
    """``llsa.LIST_WEIGHT_RUNS``: the candidate levels' weights as runs of list columns (a scalar per step) or per
    bank block (a load per key): at L = 3 (two runs) the same output and gradients, bit for bit, each form the one
    passed to the kernels, and both the fp64 oracle's (the oracle test at L = 3: its 4,096 tokens are the longest
    sequence the interpreter runs, so it runs once, here)."""
    from pixdit.kernels import llsa

    g = torch.Generator().manual_seed(12)
    q, k, v, go = (torch.randn(1, 1, 4096, 16, generator=g).to(DEVICE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    passed, pooled_args = [], llsa._pooled_list_args
    monkeypatch.setattr(llsa, "_pooled_list_args", lambda *a: passed.append(pooled_args(*a)) or passed[-1])
    results = {}
    for by_runs in (True, False):
        monkeypatch.setattr(llsa, "LIST_WEIGHT_RUNS", by_runs)
        passed.clear()
        # K = 4 at the middle level: its run fills whole steps of the walk (the runs' condition); K = 1 at the fine
        # level, whose pass the runs do not touch (K = 4 there took 1.4x the interpreter's time)
        results[by_runs] = grads(lambda q, k, v: llsa_attention(q, k, v, 16, [1, 4, 1], 3, impl="triton"), q, k, v, go)
        assert passed and all(("list_log_weight" in args) == by_runs for args in passed)
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    index = llsa_select(q, k, 16, [1, 4, 1], 3)  # the selection llsa_attention made
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = grads(lambda q, k, v: llsa_dense(q, k, v, 16, [i.long() for i in index]), q64, k64, v64, go.double())
    for name, a, r in zip(("o", "dq", "dk", "dv"), results[True], ref):
        assert rel(a, r) < 1e-5, (name, rel(a, r))


@needs_interpreter
@pytest.mark.parametrize("Le", [None, 0])  # the pooled pass writes the output, or the fine pass alone
def test_triton_output_is_tokens_major_and_takes_its_gradient_in_any_layout(Le):
    """The Triton path returns a transposed view of a tokens-major [b, N, h, d] tensor (a model's projection reads it
    without a copy); the gradient arriving in that layout (the model's case), transposed or broadcast (stride 0) gives
    the same gradients, bit for bit."""
    g = torch.Generator().manual_seed(7)
    # one sample of two heads: the tokens-major layout [b, N, h, d] still interleaves the heads (the interpreter
    # runs four backward passes here; two samples doubled the suite's longest test)
    q, k, v, go = (torch.randn(1, 2, 256, 16, generator=g).to(DEVICE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    index = llsa_select(q, k, 16, 4, 2)
    fn = lambda q, k, v: llsa_attention(q, k, v, 16, 4, 2, Le, index=index, impl="triton")  # noqa: E731
    o = fn(q, k, v)
    assert o.shape == (1, 2, 256, 16) and o.transpose(1, 2).is_contiguous()
    want = grads(fn, q, k, v, go)
    tokens_major = go.transpose(1, 2).contiguous().transpose(1, 2)
    assert all(torch.equal(a, b) for a, b in zip(grads(fn, q, k, v, tokens_major), want))
    row = torch.randn(16, generator=g).to(DEVICE)
    broadcast = grads(fn, q, k, v, row.expand(1, 2, 256, 16))
    assert all(torch.equal(a, b) for a, b in zip(broadcast, grads(fn, q, k, v, row.expand(1, 2, 256, 16).clone())))


@needs_interpreter
@pytest.mark.parametrize("L,Le", [(2, None), (1, 0)])
def test_triton_reads_v_in_place_without_autograd(L, Le, monkeypatch):
    """v as qk_norm_rope(..., v_view=True) gives it in sampling: the v columns of a [b, N, 3 * h * d] qkv tensor.
    Without autograd the forward reads it where it is (k and v are not flattened into one layout), with the same
    output, bit for bit, as a contiguous copy; with autograd it is flattened, and the gradients are the same too."""
    from pixdit.kernels import block_sparse

    b, h, N, d = 1, 2, 256, 16  # two heads: qkv's v columns interleave them
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, N, 3 * h * d, generator=g).to(DEVICE)
    q, k, v = qkv.unflatten(-1, (3, h, d)).unbind(2)
    q, k, v = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2)
    index = llsa_select(q, k, 16, 4, L)
    fn = lambda q, k, v: llsa_attention(q, k, v, 16, 4, L, Le, index=index, impl="triton")  # noqa: E731
    want = fn(q, k, v.contiguous())
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(block_sparse, "flatten_kv", lambda k, v: pytest.fail("v was copied"))
        assert torch.equal(fn(q, k, v), want)
    if Le == 0:  # (the gradients: once with the pooled pass, once without)
        return
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    go = torch.randn(b, h, N, d, generator=g).to(DEVICE)
    strided_v = qkv.clone().unflatten(-1, (3, h, d))[:, :, 2].transpose(1, 2)
    strided_v.copy_(leaves[2].detach())  # the same values, in qkv's layout, as a leaf
    strided_v.requires_grad_()
    assert all(torch.equal(x, y) for x, y in zip(grads(fn, *leaves[:2], strided_v, go), grads(fn, *leaves, go)))


# ------------------------------------------------------------------------------------------------ selection
def sets(t):
    return t.long().sort(-1).values


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("N,L,K", [(1024, 1, 8), (4096, 2, 8), (4096, 3, [8, 8, 4])])
def test_selection_matches_fp64_oracle_as_sets(impl, N, L, K):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, N, 32, generator=g).to(DEVICE) for _ in range(2))
    ks = llsa_check(N, 16, L, K)["topk"]
    ours = llsa_select(q, k, 16, ks, L, impl=impl)
    ref = llsa_hier_topk(q.double(), k.double(), 16, ks)
    for lvl in range(L):
        assert ours[lvl].dtype == torch.int32 and ours[lvl].shape == ref[lvl].shape
    # coarsest level on equal inputs; finer levels given the same parents (use ours to build the oracle's)
    assert (sets(ours[-1]) == sets(ref[-1])).all(-1).float().mean() >= 0.99
    for lvl in range(L - 1):
        same = (sets(ours[lvl]) == sets(ref[lvl])).all(-1).float().mean()
        assert same >= 0.99 or lvl < L - 1 and same >= 0.95


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_selection_order_is_descending_and_ties_go_to_smaller_ids(impl):
    q = torch.ones(1, 1, 4096, 32, device=DEVICE)
    index = llsa_select(q, torch.ones_like(q), 16, [8, 8], 2, impl=impl)  # every score ties
    assert (index[1] == torch.arange(8, device=DEVICE, dtype=torch.int32)).all()
    # level 1: candidates = children of parents 0..7 (ids 0..127), the smallest 8 win
    assert index[0].shape == (1, 1, 256, 8) and (index[0] == torch.arange(8, device=DEVICE, dtype=torch.int32)).all()
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 1024, 32, generator=g).to(DEVICE) for _ in range(2))
    idx = llsa_select(q, k, 16, 8, 1, impl=impl)[0].long()
    qp, kp = q.view(1, 2, 64, 16, 32).mean(3), k.view(1, 2, 64, 16, 32).mean(3)
    s = (qp @ kp.transpose(-1, -2)).gather(-1, idx)
    assert (s[..., 1:] <= s[..., :-1]).all()


def test_selection_is_deterministic_and_int32():
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 3, 4096, 32, generator=g) for _ in range(2))
    a, b = llsa_select(q, k, 16, 8), llsa_select(q, k, 16, 8)
    assert all(torch.equal(x, y) and x.dtype == torch.int32 for x, y in zip(a, b))


def test_worked_example_weights():
    """A pooled token counts B^l times: equal keys/values at all levels -> plain weighted average."""
    B, N = 16, 512
    q = torch.zeros(1, 1, N, 32)
    k = torch.zeros(1, 1, N, 32)
    v = torch.randn(1, 1, N, 32)
    index = llsa_select(q, k, B, 1, 2)
    o = llsa_attention(q, k, v, B, 1, 2, index=index)
    # query block 0 sees fine block 0 (16 tokens, w 1), level-1 children of level-2 block 0 (16 tokens, w 16),
    # both level-2 tokens (w 256): zero logits -> weights are the multiplicities
    v1 = v.view(1, 1, 32, 16, 32).mean(3)
    v2 = v.view(1, 1, 2, 256, 32).mean(3)
    want = (v[0, 0, :16].sum(0) + 16 * v1[0, 0, :16].sum(0) + 256 * v2[0, 0].sum(0)) / (16 + 16 * 16 + 2 * 256)
    assert torch.allclose(o[0, 0, 0], want, atol=1e-5)
    assert math.isclose(llsa_check(N, B, 2, 1)["tokens_per_query"], 16 + 16 + 2)


@needs_interpreter
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_contiguous_inputs_and_tiny_sequences(impl):
    """q/k/v as transposed views of [b, N, h, d] (what a fused qkv projection gives), N = 16 and 32 (one or two
    fine blocks; the 64-row pooled tiles are mostly masked)."""
    for N in (16, 32):
        g = torch.Generator().manual_seed(N)
        leaves = [torch.randn(2, N, 3, 32, generator=g).to(DEVICE).requires_grad_() for _ in range(3)]
        q, k, v = (x.transpose(1, 2) for x in leaves)
        index = llsa_select(q, k, 16, 8, 1)
        llsa_attention(q, k, v, 16, 8, 1, index=index, impl=impl).sum().backward()
        ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
        llsa_dense(*(x.transpose(1, 2) for x in ref_leaves), 16, [i.long() for i in index]).sum().backward()
        for a, r in zip(leaves, ref_leaves):
            assert rel(a.grad, r.grad) < 1e-5


# ------------------------------------------------------------------- the Triton path's pyramid and bank
@needs_interpreter
@pytest.mark.parametrize(
    "B,levels,n_bank,n,dtype",
    [
        (16, 2, 2, 3, torch.float16),  # q, k, v stacked (a selection made here), every level banked
        (16, 3, 3, 2, torch.float32),  # k, v stacked (a given selection), L = 3
        (16, 3, 1, 3, torch.float16),  # enrich_levels 1 of 3: only the first level banked
        (32, 2, 0, 2, torch.float16),  # no bank (enrich_levels 0): q and k, the levels alone
        (16, 1, 1, 3, torch.float16),  # L = 1: nothing to pool, the first level copied
    ],
)
def test_pyramid_kernel_levels_and_bank(B, levels, n_bank, n, dtype):
    check_pyramid_kernel(B, levels, n_bank, n, dtype, 16, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("levels,n_bank", [(2, 2), (3, 3), (3, 1)])
def test_gpu_pyramid_kernel_levels_and_bank(levels, n_bank):
    check_pyramid_kernel(16, levels, n_bank, 3, torch.bfloat16, 64, "cuda")


def check_pyramid_kernel(B, levels, n_bank, n, dtype, d, device):
    """The Triton path's pyramid (one launch per level above the first): each level the fp32 block mean of the one
    below (up to the summation order) and the bank's rows the k and v levels cast, bit for bit, at their offsets,
    every row written."""
    from pixdit.kernels.llsa import _bank_layout, _pyramid_and_bank

    g = torch.Generator().manual_seed(5)
    b, h = 2, 3
    N = B**levels * 2
    level1 = torch.randn(n, b, h, N // B, d, generator=g).to(device)
    bank = offsets = None
    if n_bank:
        offsets, total = _bank_layout(N, B, levels, n_bank)
        bank = torch.full((2, b * h, total, d), float("nan"), device=device, dtype=dtype)
    pyramid = _pyramid_and_bank(level1, B, levels, bank, offsets or ())
    assert len(pyramid) == levels and pyramid[0] is level1
    for lvl in range(1, levels):
        want = block_mean(pyramid[lvl - 1], B)
        assert pyramid[lvl].shape == want.shape and pyramid[lvl].dtype == torch.float32
        torch.testing.assert_close(pyramid[lvl], want, rtol=1e-6, atol=1e-6)
    if bank is None:
        return
    for lvl in range(n_bank):
        rows = bank[:, :, offsets[lvl] : offsets[lvl] + N // B ** (lvl + 1)]
        assert torch.equal(rows, pyramid[lvl][-2:].flatten(1, 2).to(dtype)), lvl  # k's and v's
    assert not bank.isnan().any(), "a bank row nobody wrote"


# --------------------------------------------------------------------------- block means given by the caller
def stacked_means(q, k, v, B):
    return torch.stack([block_mean(x.detach(), B) for x in (q, k, v)])


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("L,Le", [(2, None), (2, 0), (1, 1)])
def test_given_means_are_the_ones_computed_here(impl, L, Le):
    """means= (what the model's qk_norm_rope prologue hands over) replaces the first level of the selection's and
    the bank's pyramids: given the means of q, k, v (as each path pools them: the Triton path with its kernel),
    output and gradients are those without it (bitwise, except the PyTorch path's gradients on CUDA)."""

    g = torch.Generator().manual_seed(11)
    q, k, v, go = (torch.randn(1, 1, 512, 32, generator=g).to(DEVICE) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    fn = lambda means: lambda q, k, v: llsa_attention(q, k, v, 16, 4, L, Le, means=means, impl=impl)  # noqa: E731
    means = stacked_means(q, k, v, 16) if impl == "torch" else block_means([q, k, v], 16)
    given = grads(fn(means), q, k, v, go)
    computed = grads(fn(None), q, k, v, go)
    assert torch.equal(given[0], computed[0])
    if impl == "torch" and DEVICE == "cuda":  # the gathers' backward adds with atomics there: not bitwise
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(given[1:], computed[1:]))
    else:
        assert all(torch.equal(a, b) for a, b in zip(given[1:], computed[1:]))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_given_means_are_used(impl):
    """The means are read, not recomputed: means of other tensors change the selection (and on the Triton path the
    pooled bank), so the output changes."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 1, 512, 32, generator=g).to(DEVICE) for _ in range(3))
    other = stacked_means(*(torch.randn(1, 1, 512, 32, generator=g).to(DEVICE) for _ in range(3)), 16)
    computed = llsa_attention(q, k, v, 16, 4, 2, impl=impl)
    assert not torch.equal(llsa_attention(q, k, v, 16, 4, 2, means=other, impl=impl), computed)


def test_bad_means_name_the_parameter():
    q = torch.randn(1, 2, 256, 32)
    for bad in (stacked_means(q, q, q, 16)[:2], stacked_means(q, q, q, 16).double(), torch.zeros(3, 1, 2, 8, 32)):
        with pytest.raises(
            ValueError, match=r"means must be the stacked fp32 block means of q, k, v, shape \(3, 1, 2, 16, 32\)"
        ):
            llsa_attention(q, q, q, 16, 4, 1, means=bad)
