"""SLA (pixdit.kernels.sla_attention) against the independent dense oracle (pixdit.kernels.reference), on CPU.

    .venv/bin/python -m pytest tests/kernels/test_sla.py

Split in two: a tie-tolerant selection test, and attention tests that hand the op's own critical blocks to
the fp64 oracle and compare both branches and every gradient (q, k, v through phi, and the layer's Proj W, b).
The authors' failure modes (docs/algorithms.md, "SLA") each have a test here.
"""

import pytest
import torch
import torch.nn.functional as F

from pixdit.kernels import sla_attention, sla_select
from pixdit.kernels.reference import sla_reference, sla_reference_scores


def _inputs(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).requires_grad_() for _ in range(3)]


def _proj(d, seed=2, zero=False):
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(d, d, generator=g) / d**0.5, torch.randn(d, generator=g)
    if zero:
        w, b = torch.zeros(d, d), torch.zeros(d)
    return w.requires_grad_(), b.requires_grad_()


def _combine_and_grads(o_sparse, o_linear, w, b, inputs, seed=1):
    out = o_sparse + o_linear @ w.to(o_linear.dtype).T + b.to(o_linear.dtype)  # the layer's Proj
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return out, torch.autograd.grad((out * upstream).sum(), inputs)


def _compare(q, k, v, block_size, topk, scope, feature_map, negligible_ratio=0.0, zero_proj=False):
    w, b = _proj(q.shape[-1], zero=zero_proj)
    o_s, o_l = sla_attention(
        q,
        k,
        v,
        block_size=block_size,
        topk=topk,
        linear_scope=scope,
        feature_map=feature_map,
        negligible_ratio=negligible_ratio,
    )
    critical, negligible = sla_select(q, k, block_size=block_size, topk=topk, negligible_ratio=negligible_ratio)
    r_s, r_l = sla_reference(
        q.double(),
        k.double(),
        v.double(),
        block_size,
        topk,
        scope,
        feature_map,
        num_negligible=negligible.shape[-1],
        crit_idx=critical,
    )
    torch.testing.assert_close(o_s.double(), r_s, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(o_l.double(), r_l, atol=2e-5, rtol=1e-5)
    out, grads = _combine_and_grads(o_s, o_l, w, b, [q, k, v, w, b])
    ref, ref_grads = _combine_and_grads(r_s, r_l, w, b, [q, k, v, w, b])
    for name, got, want in zip("q k v W b".split(), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4, msg=f"d{name}")
    return o_s, o_l, grads


@pytest.mark.parametrize("scope,negligible_ratio", [("noncritical", 0.0), ("all", 0.0), ("marginal", 0.4)])
@pytest.mark.parametrize("feature_map", ["softmax", "elu", "relu"])
def test_every_scope_and_feature_map_matches_oracle(scope, feature_map, negligible_ratio):
    q, k, v = _inputs(2, 2, 70, 32)  # 5 blocks of 16, the last one partial (6 tokens)
    _compare(q, k, v, 16, 2, scope, feature_map, negligible_ratio)


@pytest.mark.parametrize("block_size,head_dim,num_tokens,topk", [(64, 32, 200, 2), (16, 128, 40, 1), (32, 64, 96, 2)])
def test_block_sizes_and_head_dims(block_size, head_dim, num_tokens, topk):
    # head_dim != block_size: the authors' first pooling kernel wrote pooled blocks at the wrong offset (f29377f)
    q, k, v = _inputs(2, 1, num_tokens, head_dim, seed=3)
    _compare(q, k, v, block_size, topk, "noncritical", "softmax")


def test_zero_proj_still_trains_proj_and_sends_nothing_through_phi():
    q, k, v = _inputs(1, 2, 64, 32, seed=4)
    o_s, o_l, (dq, dk, dv, dw, db) = _compare(q, k, v, 16, 1, "noncritical", "softmax", zero_proj=True)
    assert dw.abs().sum() > 0 and db.abs().sum() > 0
    # with W = 0 the gradients of q, k equal those of the sparse branch alone
    o_s = sla_attention(q, k, v, block_size=16, topk=1)[0]
    upstream = torch.randn(o_s.shape, generator=torch.Generator().manual_seed(1))
    dq_sparse = torch.autograd.grad((o_s * upstream).sum(), q)[0]
    torch.testing.assert_close(dq, dq_sparse)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_selection_is_the_topk_of_the_smooth_k_scores_tie_tolerant(impl):
    """Critical = the K highest, negligible = the K_neg lowest smooth-K block scores (fp64 oracle), on both selection
    paths (the negligible blocks go through the same top-k as the critical ones, on negated scores)."""
    q, k, _ = _inputs(2, 3, 150, 32, seed=5)
    critical, negligible = sla_select(q, k, block_size=16, topk=3, negligible_ratio=0.3, impl=impl)
    scores = sla_reference_scores(q.double(), k.double(), 16)
    crit_scores = scores.gather(-1, critical.long())
    rest = scores.scatter(-1, critical.long(), float("-inf"))
    assert (crit_scores.min(-1).values >= rest.max(-1).values - 1e-5).all()
    neg_scores = scores.gather(-1, negligible.long())
    rest = scores.scatter(-1, negligible.long(), float("inf"))
    assert negligible.shape[-1] == 3 and (neg_scores.max(-1).values <= rest.min(-1).values + 1e-5).all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_ties_critical_to_smaller_ids_negligible_to_larger_ids(impl):
    q, k = torch.zeros(1, 2, 96, 32), torch.randn(1, 2, 96, 32)  # pooled q = 0: every score is exactly 0
    critical, negligible = sla_select(q, k, block_size=16, topk=2, negligible_ratio=0.34, impl=impl)
    assert critical.tolist() == [[[[0, 1]] * 6] * 2]
    assert negligible.tolist() == [[[[5, 4]] * 6] * 2]


def test_all_blocks_critical_gives_full_attention_and_an_exact_zero_linear_branch():
    q, k, v = _inputs(2, 2, 90, 64, seed=6)
    for kwargs in ({"topk": 6}, {"topk": 50}, {"topk_ratio": 1.0}):
        o_s, o_l = sla_attention(q, k, v, block_size=16, **kwargs)
        torch.testing.assert_close(o_s, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
        assert (o_l == 0).all()
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad((o_s + o_l).sum(), [q, k, v]))


def test_relu_with_vanishing_features_gives_zero_not_nan():
    # all-negative queries: relu(q) = 0 -> the authors' SLA-1 kernel divides 0 by 0
    q, k, v = _inputs(1, 2, 64, 32, seed=7)
    q_neg = (-q.detach().abs() - 0.1).requires_grad_()
    for scope in ("noncritical", "all", "marginal"):
        o_s, o_l = sla_attention(
            q_neg,
            k,
            v,
            block_size=16,
            topk=1,
            linear_scope=scope,
            feature_map="relu",
            negligible_ratio=0.25 if scope == "marginal" else 0.0,
        )
        assert (o_l == 0).all()
        grads = torch.autograd.grad((o_s + 2 * o_l).sum(), [q_neg, k, v])
        assert all(torch.isfinite(g).all() for g in grads)


def test_marginal_without_negligible_equals_noncritical():
    q, k, v = _inputs(1, 2, 80, 32, seed=8)
    a = sla_attention(q, k, v, block_size=16, topk=2, linear_scope="marginal")
    b = sla_attention(q, k, v, block_size=16, topk=2, linear_scope="noncritical")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_batch_elements_are_independent():
    q, k, v = _inputs(3, 2, 64, 32, seed=9)
    together = sla_attention(q, k, v, block_size=16, topk=2)
    for i in range(3):
        alone = sla_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], block_size=16, topk=2)
        for x, y in zip(together, alone):
            torch.testing.assert_close(x[i : i + 1], y)


@pytest.mark.parametrize(
    "num_blocks_,ratio,expected", [(100, 0.29, 29), (10, 0.01, 1), (10, 0.0, 1), (30, 0.1, 3), (8, 1.0, 8)]
)
def test_ratio_to_topk_rule_never_gives_zero(num_blocks_, ratio, expected):
    # the authors' int(ratio * T) gives 28 for 0.29 * 100 and 0 (-> NaN) for small ratios
    q = torch.randn(1, 1, num_blocks_ * 16, 32)
    assert sla_select(q, q, block_size=16, topk_ratio=ratio)[0].shape[-1] == expected


def test_bf16_inputs_give_bf16_outputs_close_to_oracle():
    q, k, v = (x.detach().bfloat16() for x in _inputs(1, 2, 64, 64, seed=10))
    o_s, o_l = sla_attention(q, k, v, block_size=16, topk=2)
    r_s, r_l = sla_reference(q, k, v, 16, 2, crit_idx=sla_select(q, k, 16, topk=2)[0])
    assert o_s.dtype == o_l.dtype == torch.bfloat16
    torch.testing.assert_close(o_s.float(), r_s, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(o_l.float(), r_l, atol=2e-2, rtol=2e-2)


# means= for q of [1, 2, 32, 32] and blocks of 16 (common.check_means)
BAD_MEANS = r"sla_attention: means must be the stacked fp32 block means of q, k, v, shape \(3, 1, 2, 2, 32\)"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 128, "topk": 1}, "block_size"),
        ({"topk": 0}, "topk"),
        ({}, "exactly one"),
        ({"topk": 1, "topk_ratio": 0.1}, "exactly one"),
        ({"topk_ratio": -0.1}, "topk_ratio"),
        ({"topk": 1, "linear_scope": "paper"}, "linear_scope"),
        ({"topk": 1, "feature_map": "hedgehog"}, "feature_map"),
        ({"topk": 1, "negligible_ratio": 0.1}, "marginal"),
        ({"topk": 1, "linear_scope": "marginal", "negligible_ratio": 1.0}, "negligible_ratio"),
        ({"topk": 1, "means": torch.zeros(3, 1, 2, 1, 32)}, BAD_MEANS),
        ({"topk": 1, "means": torch.zeros(3, 1, 2, 2, 32, dtype=torch.float64)}, BAD_MEANS),
        ({"topk": 1, "means": "means"}, BAD_MEANS),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    q = torch.randn(1, 2, 32, 32)
    with pytest.raises(ValueError, match=message):
        sla_attention(q, q, q, **kwargs)
