"""SLA's Triton path: under TRITON_INTERPRET=1 on CPU (fp32, tiny sizes) against the fp64 dense oracle for every
``linear_scope`` and feature map, and on the GPU (``-m gpu``, bf16/fp16 at real sizes) against the exact fp32 path.

    .venv/bin/python -m pytest tests/kernels/test_sla_triton.py  # CPU: interpreter (see tests/kernels/conftest.py)
    python -m pytest tests/kernels/test_sla_triton.py -m gpu  # CUDA machine
"""

import pytest
import torch

from pixdit.kernels import block_sparse, sla_attention, sla_select
from pixdit.kernels.blocks import block_mean, block_means
from pixdit.kernels.reference import sla_reference

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(b, h, n, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(b, h, n, d, generator=g, device=device).to(dtype) for _ in range(5)]
    return [x.requires_grad_() for x in xs[:3]] + [x.detach() for x in xs[3:]]


def _run(q, k, v, up_s, up_l, **kwargs):
    o_s, o_l = sla_attention(q, k, v, **kwargs)
    loss = (o_s.float() * up_s.float()).sum() + (o_l.float() * up_l.float()).sum()
    return [o_s.detach(), o_l.detach()] + list(torch.autograd.grad(loss, [q, k, v]))


@interpreter_only
@pytest.mark.parametrize("scope,negligible_ratio", [("noncritical", 0.0), ("all", 0.0), ("marginal", 0.25)])
@pytest.mark.parametrize("feature_map", ["softmax", "elu", "relu"])
# the list walks read short lists from registers and long ones step by step (block_sparse.LIST_IN_REGISTERS): both
@pytest.mark.parametrize("ids_in_registers", [True, False])
def test_interpreted_triton_matches_oracle(scope, feature_map, negligible_ratio, ids_in_registers, monkeypatch):
    if not ids_in_registers:
        monkeypatch.setattr(block_sparse, "LIST_IN_REGISTERS", 0)
    q, k, v, up_s, up_l = _inputs(1, 2, 70, 32)  # 5 blocks of 16, the last one partial
    kwargs = dict(block_size=16, topk=2, linear_scope=scope, feature_map=feature_map, negligible_ratio=negligible_ratio)
    got = _run(q, k, v, up_s, up_l, impl="triton", **kwargs)
    critical, negligible = sla_select(q, k, 16, topk=2, negligible_ratio=negligible_ratio, impl="triton")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    r_s, r_l = sla_reference(
        qd, kd, vd, 16, 2, scope, feature_map, num_negligible=negligible.shape[-1], crit_idx=critical
    )
    loss = (r_s * up_s.double()).sum() + (r_l * up_l.double()).sum()
    want = [r_s.detach(), r_l.detach()] + list(torch.autograd.grad(loss, [qd, kd, vd]))
    for name, a, r in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("n,block_size", [(64, 16), (70, 16), (100, 32)])
def test_triton_pooling_for_the_scores_matches_the_exact_one(n, block_size):
    """The Triton path's pooled q and smooth-K k for the classification scores (``block_means`` and the
    token-weighted mean of k's block means) against the PyTorch reductions, a partial last block included."""
    from pixdit.kernels import sla

    q, k, *_ = _inputs(2, 3, n, 32, device="cuda" if CUDA else "cpu", seed=n)
    got = sla._pooled_for_scores(q, k, block_size, triton_path=True)
    want = sla._pooled_for_scores(q, k, block_size)
    for name, a, b in zip(("q", "k"), got, want):
        assert a.shape == b.shape == (2, 3, -(-n // block_size), 32) and a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@interpreter_only
@pytest.mark.parametrize("block_size,d,n", [(64, 64, 130), (32, 128, 64), (16, 16, 37)])
def test_interpreted_triton_block_sizes(block_size, d, n):
    q, k, v, up_s, up_l = _inputs(1, 1, n, d, seed=1)
    got = _run(q, k, v, up_s, up_l, block_size=block_size, topk=1, impl="triton")
    want = _run(q, k, v, up_s, up_l, block_size=block_size, topk=1, impl="torch")
    for name, a, r in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=name)


@interpreter_only
def test_interpreted_triton_edge_cases_have_no_nan():
    q, k, v, up_s, up_l = _inputs(1, 2, 48, 32, seed=2)
    for kwargs in ({"topk": 3}, {"topk": 1, "linear_scope": "marginal", "negligible_ratio": 0.67}):
        got = _run(q, k, v, up_s, up_l, block_size=16, impl="triton", **kwargs)  # empty linear sets
        assert (got[1] == 0).all() and all(torch.isfinite(x).all() for x in got)
    q_neg = (-q.detach().abs() - 0.1).requires_grad_()  # relu(q) = 0 everywhere
    got = _run(q_neg, k, v, up_s, up_l, block_size=16, topk=1, feature_map="relu", impl="triton")
    assert (got[1] == 0).all() and all(torch.isfinite(x).all() for x in got)


@interpreter_only
@pytest.mark.parametrize("scope", ["noncritical", "marginal", "all"])
def test_interpreted_triton_rows_with_an_empty_linear_set_are_exactly_zero(scope):
    # relu features that vanish on the whole linear set of some query blocks (and not of others). The fused kernel
    # computes "global sums - excluded blocks", which leaves only fp32 rounding on those rows: they must still give
    # exactly 0 with exactly zero gradient, and every other row must match the exact path.
    q, k, v, up_s, up_l = _inputs(1, 2, 64, 32, seed=4)  # 4 blocks of 16
    with torch.no_grad():
        k[:, :, 32:] = -k[:, :, 32:].abs() - 0.1  # relu(k) = 0 on key blocks 2, 3
        if scope == "all":
            q[:, :, :16] = -q[:, :, :16].abs() - 0.1  # relu(q) = 0 on query block 0
    crit = {
        "noncritical": [[0, 1], [2, 3], [0, 1], [1, 2]],
        "marginal": [[0], [2], [0], [1]],
        "all": [[0], [2], [0], [1]],
    }[scope]
    neg = [[1], [3], [1], [2]] if scope == "marginal" else [[]] * 4
    selection = tuple(
        torch.tensor(x, dtype=torch.int32).reshape(1, 1, 4, -1).expand(1, 2, 4, -1).contiguous() for x in (crit, neg)
    )  # linear sets of blocks 0, 2: keys 2, 3
    kwargs = dict(block_size=16, linear_scope=scope, feature_map="relu", selection=selection)
    got = _run(q, k, v, up_s * 0, up_l, impl="triton", **kwargs)  # gradients of the linear branch only
    want = _run(q, k, v, up_s * 0, up_l, impl="torch", **kwargs)
    empty = [*range(0, 16)] + ([] if scope == "all" else [*range(32, 48)])
    assert (got[1][:, :, empty] == 0).all() and (got[2][:, :, empty] == 0).all()
    assert got[1].abs().sum() > 0
    for name, a, r in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=name)


@interpreter_only
def test_interpreted_triton_half_precision_matches_exact_path():
    # fp16 (the interpreter has no bf16 dots): phi rounded to the input dtype, tf32 products of the 1/den-scaled terms
    q, k, v, up_s, up_l = _inputs(1, 2, 100, 32, torch.float16, seed=5)
    kwargs = dict(block_size=16, topk=2, linear_scope="marginal", feature_map="elu", negligible_ratio=0.3)
    got = _run(q, k, v, up_s, up_l, impl="triton", **kwargs)
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = _run(*exact, up_s, up_l, impl="torch", **kwargs)
    assert got[1].dtype == torch.float16
    for name, a, r in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), got, want):
        assert _rel(a, r) < TOL[torch.float16], (name, _rel(a, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "scope,feature_map", [("noncritical", "softmax"), ("all", "softmax"), ("marginal", "elu"), ("noncritical", "relu")]
)
@pytest.mark.parametrize("b,h,n,d,block_size,topk", [(2, 3, 16384, 64, 16, 20), (1, 2, 4096 - 5, 128, 64, 8)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_triton_matches_exact_path(dtype, scope, feature_map, b, h, n, d, block_size, topk, mark):
    q, k, v, up_s, up_l = _inputs(b, h, n, d, dtype, "cuda")
    kwargs = dict(
        block_size=block_size,
        topk=topk,
        linear_scope=scope,
        feature_map=feature_map,
        negligible_ratio=0.1 if scope == "marginal" else 0.0,
    )
    kwargs["selection"] = sla_select(q, k, block_size, topk=topk, negligible_ratio=kwargs["negligible_ratio"])
    got = _run(q, k, v, up_s, up_l, impl="triton", **kwargs)  # one selection for both paths
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = _run(*exact, up_s, up_l, impl="torch", **kwargs)
    for name, a, r in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, r) < TOL[dtype], (name, _rel(a, r))


@pytest.mark.parametrize("scope,feature_map", [("noncritical", "softmax"), ("all", "elu"), ("marginal", "relu")])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_deterministic_bitwise(scope, feature_map, mark):
    q, k, v, up_s, up_l = _inputs(2, 3, 16384, 64, torch.bfloat16, "cuda", seed=3)
    kwargs = dict(
        block_size=16,
        topk=20,
        linear_scope=scope,
        feature_map=feature_map,
        negligible_ratio=0.1 if scope == "marginal" else 0.0,
    )
    a = _run(q, k, v, up_s, up_l, **kwargs)
    b = _run(q, k, v, up_s, up_l, **kwargs)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_under_autocast_at_the_two_pass_size(mark):
    # 4,096 blocks (256^2 tokens): the two-pass selection under a training step's autocast keeps fp32 scores
    q, k, v, up_s, up_l = _inputs(1, 2, 65536, 64, torch.float32, "cuda", seed=6)
    want = sla_select(q, k, block_size=16, topk=32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = sla_select(q, k, block_size=16, topk=32)
        grads = _run(q, k, v, up_s, up_l, block_size=16, topk=32)
    assert torch.equal(got[0], want[0])
    assert all(torch.isfinite(x).all() for x in grads)


# --------------------------------------------------------------------------- block means given by the caller
def _stacked_means(xs, block_size):
    return torch.stack([block_mean(x.detach(), block_size) for x in xs])


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreter_only)])
def test_given_means_are_the_ones_computed_here(impl):
    """means= (what the model's qk_norm_rope prologue hands over) replaces the selection's pooling: given the block
    means of q, k, v, the selection and the outputs and gradients are bitwise those without it (the Triton path pools
    with the same kernel; the PyTorch path's mean(k) from the block means moves the scores by fp32 rounding only,
    which reorders no block of these inputs). 100 tokens: the last of 7 blocks is partial."""
    q, k, v, up_s, up_l = _inputs(1, 2, 100, 32, seed=7)
    means = block_means([q, k, v], 16) if impl == "triton" else _stacked_means((q, k, v), 16)
    opts = dict(block_size=16, topk=3, impl=impl)
    assert torch.equal(sla_select(q, k, means=means, **opts)[0], sla_select(q, k, **opts)[0])
    given = _run(q, k, v, up_s, up_l, means=means, **opts)
    computed = _run(q, k, v, up_s, up_l, **opts)
    for name, a, b in zip(("o_sparse", "o_linear", "dq", "dk", "dv"), given, computed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreter_only)])
def test_given_means_are_used(impl):
    """The means are read, not recomputed: other tensors' means give their selection, on both paths."""
    q, k, v, _, _ = _inputs(1, 2, 100, 32, seed=8)
    other = _stacked_means(_inputs(1, 2, 100, 32, seed=9)[:3], 16)
    opts = dict(block_size=16, topk=3, impl=impl)
    chosen = sla_select(q, k, means=other, **opts)
    assert not torch.equal(chosen[0], sla_select(q, k, **opts)[0])
    with_other = sla_attention(q, k, v, means=other, **opts)
    assert not torch.equal(with_other[0], sla_attention(q, k, v, **opts)[0])
    for a, b in zip(with_other, sla_attention(q, k, v, selection=chosen, **opts)):
        assert torch.equal(a, b)
