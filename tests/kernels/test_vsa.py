"""VSA (pixdit.kernels.vsa_attention) against the independent dense oracle (pixdit.kernels.reference), on CPU.

    .venv/bin/python -m pytest tests/kernels/test_vsa.py

The oracle runs in fp64; the op's exact PyTorch path runs fp32 math, so forward and all gradients (q, k, v, gate)
must agree to ~1e-5. The failure modes of the authors' kernels (docs/algorithms.md, "VSA") each have a test here.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from pixdit.kernels import vsa_attention, vsa_select
from pixdit.kernels.reference import vsa_reference, vsa_reference_scores


def _inputs(b, h, n, d, seed=0, gate=True):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, h, n, d, generator=g) for _ in range(4 if gate else 3)]
    return [x.requires_grad_() for x in xs]


def _grads(out, inputs, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad((out * upstream).sum(), inputs)


@pytest.mark.parametrize(
    "block_size,head_dim,num_tokens,topk",
    [
        (16, 32, 70, 2),  # partial last tile (6 tokens), 5 tiles
        (32, 64, 96, 1),  # K = 1
        (64, 128, 200, 2),  # partial last tile, block 64, head_dim 128
        (16, 64, 48, 3),  # K = T
    ],
)
@pytest.mark.parametrize("with_gate", [True, False])
def test_forward_and_grads_match_oracle(block_size, head_dim, num_tokens, topk, with_gate):
    q, k, v, gate = _inputs(2, 2, num_tokens, head_dim)
    gate_arg = gate if with_gate else None
    out = vsa_attention(q, k, v, block_size=block_size, topk=topk, gate=gate_arg)
    tile_idx = vsa_select(q, k, block_size=block_size, topk=topk)
    ref = vsa_reference(
        *(x.double() for x in (q, k, v)),
        block_size,
        topk,
        gate=gate_arg.double() if with_gate else None,
        tile_idx=tile_idx,
    )
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    inputs = [q, k, v] + ([gate] if with_gate else [])
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(got.double(), want.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "impl",
    [
        "torch",
        pytest.param(
            "triton",
            # CPU tensors through the Triton path: the interpreter only (on a GPU machine without it the call is
            # rightly refused); the fine gate is a PyTorch product around the kernels, whose GPU tests are elsewhere
            marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
        ),
    ],
)
def test_fine_gate_matches_oracle_with_gradients_of_both_gates(impl):
    """The paper's optional G_f: O_fine * gate_fine + gate * O_coarse, both paths, d gate_fine too."""
    q, k, v, gate = _inputs(1, 2, 70, 32, seed=8)
    gate_fine = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).requires_grad_()
    out = vsa_attention(q, k, v, block_size=16, topk=2, gate=gate, gate_fine=gate_fine, impl=impl)
    tile_idx = vsa_select(q, k, block_size=16, topk=2, impl=impl)
    ref = vsa_reference(
        *(x.double() for x in (q, k, v)), 16, 2, gate=gate.double(), tile_idx=tile_idx, gate_fine=gate_fine.double()
    )
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    inputs = [q, k, v, gate, gate_fine]
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-4, rtol=1e-4)
    ungated_fine = vsa_attention(q, k, v, block_size=16, topk=2, gate=gate, impl=impl)
    assert not torch.allclose(out, ungated_fine)  # the fine gate does act
    with pytest.raises(ValueError, match="gate_fine"):
        vsa_attention(q, k, v, block_size=16, topk=2, gate_fine=gate_fine[:, :1], impl=impl)


def test_selection_is_the_topk_of_the_coarse_scores_tie_tolerant():
    q, k, _, _ = _inputs(2, 3, 150, 32, seed=3)
    tile_idx = vsa_select(q, k, block_size=16, topk=4).long()
    scores = vsa_reference_scores(q.double(), k.double(), 16)
    chosen = scores.gather(-1, tile_idx)
    unchosen = scores.scatter(-1, tile_idx, float("-inf"))
    assert (chosen.min(-1).values >= unchosen.max(-1).values - 1e-5).all()
    assert (chosen[..., :-1] >= chosen[..., 1:] - 1e-5).all()  # best first


def test_ties_break_toward_the_smaller_tile_id_deterministically():
    # every key tile has the same mean -> all coarse scores of a row tie
    q = torch.randn(2, 2, 64, 32)
    k = torch.randn(1, 1, 16, 32).repeat(2, 2, 4, 1)
    for _ in range(2):
        assert vsa_select(q, k, block_size=16, topk=2).tolist() == [[[[0, 1]] * 4] * 2] * 2


def test_topk_all_tiles_is_full_attention():
    q, k, v, _ = _inputs(2, 2, 90, 64, seed=4)
    zero_gate = torch.zeros_like(q)
    full = F.scaled_dot_product_attention(q, k, v)
    for kwargs in ({"topk": 6}, {"topk": 100}, {"topk_ratio": 1.0}):  # 6 tiles; topk clamps to T
        out = vsa_attention(q, k, v, block_size=16, gate=zero_gate, **kwargs)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def test_batch_elements_are_independent():
    # the authors' fast kernel asserts batch == 1; ours must give every batch element its own selection
    q, k, v, gate = _inputs(3, 2, 64, 32, seed=5)
    together = vsa_attention(q, k, v, block_size=16, topk=2, gate=gate)
    for i in range(3):
        alone = vsa_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], block_size=16, topk=2, gate=gate[i : i + 1])
        torch.testing.assert_close(together[i : i + 1], alone)


def test_single_token_last_tile_has_finite_exact_gradients():
    # FastVideo PR #879 / #925: the backward masked key columns with the wrong tile size -> wrong or Inf/NaN dQ.
    # Here the last tile holds 1 real token of 16 and is selected by every query tile (K = T).
    q, k, v, gate = _inputs(1, 2, 49, 32, seed=6)
    out = vsa_attention(q, k, v, block_size=16, topk=4, gate=gate)
    ref = vsa_reference(q.double(), k.double(), v.double(), 16, 4, gate=gate.double())
    grads, ref_grads = _grads(out, [q, k, v, gate]), _grads(ref, [q, k, v, gate])
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want.double(), atol=5e-5, rtol=1e-4)


def test_bf16_inputs_give_bf16_output_close_to_oracle():
    q, k, v, gate = (x.detach().bfloat16() for x in _inputs(1, 2, 64, 64, seed=7))
    out = vsa_attention(q, k, v, block_size=16, topk=2, gate=gate)
    ref = vsa_reference(q, k, v, 16, 2, gate=gate, tile_idx=vsa_select(q, k, 16, topk=2))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "num_tiles,topk_ratio,expected",
    [(10, 0.3, 3), (256, 0.125, 32), (7, 0.0, 1), (7, 1.0, 7), (100, 0.1, 10), (3, 0.01, 1)],
)
def test_topk_ratio_to_topk_rule(num_tiles, topk_ratio, expected):
    q = torch.randn(1, 1, num_tiles * 16, 32)
    assert vsa_select(q, q, block_size=16, topk_ratio=topk_ratio).shape[-1] == expected


# means= for q of [1, 2, 32, 32] and blocks of 16 (common.check_means)
BAD_MEANS = r"vsa_attention: means must be the stacked fp32 block means of q, k, v, shape \(3, 1, 2, 2, 32\)"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 8, "topk": 1}, "block_size"),
        ({"topk": 0}, "topk"),
        ({"topk": 2.0}, "topk"),
        ({}, "exactly one"),
        ({"topk": 1, "topk_ratio": 0.5}, "exactly one"),
        ({"topk_ratio": 1.5}, "topk_ratio"),
        ({"topk": 1, "gate": torch.zeros(1, 1, 32, 32)}, "gate"),
        ({"topk": 1, "scale": -1.0}, "scale"),
        ({"topk": 1, "means": torch.zeros(3, 1, 2, 1, 32)}, BAD_MEANS),
        ({"topk": 1, "means": torch.zeros(3, 1, 2, 2, 32, dtype=torch.float64)}, BAD_MEANS),
        ({"topk": 1, "means": "means"}, BAD_MEANS),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    q = torch.randn(1, 2, 32, 32)
    with pytest.raises(ValueError, match=message):
        vsa_attention(q, q, q, **kwargs)


def test_bad_head_dim_and_shapes_are_rejected():
    x = torch.randn(1, 1, 32, 48)
    with pytest.raises(ValueError, match="head_dim"):
        vsa_attention(x, x, x, topk=1)
    y = torch.randn(1, 1, 32, 32)
    with pytest.raises(ValueError, match="same shape"):
        vsa_attention(y, y, torch.randn(1, 1, 16, 32), topk=1)


def test_fast_topk_equals_the_shared_exact_topk_with_and_without_ties():
    from pixdit.kernels.blocks import topk_desc
    from pixdit.kernels.topk import topk_desc_fast

    g = torch.Generator().manual_seed(11)
    for scores in (
        torch.randn(64, 300, generator=g),  # distinct
        torch.randint(0, 6, (64, 300), generator=g).float(),  # ties everywhere
        -torch.randint(0, 3, (64, 300), generator=g).float(),
    ):  # with -0.0
        for k in (1, 7, 300):
            assert torch.equal(topk_desc_fast(scores, k), topk_desc(scores, k))
    zeros = torch.zeros(3, 10)
    zeros[0, :5] = -0.0  # -0.0 ties with +0.0
    assert topk_desc_fast(zeros, 4).tolist() == [[0, 1, 2, 3]] * 3


def test_precomputed_selection_is_used_and_checked():
    q, k, v, _ = _inputs(1, 2, 64, 32, seed=12)
    tile_idx = torch.tensor([[3, 0], [1, 2], [0, 3], [2, 1]], dtype=torch.int32).expand(1, 2, 4, 2)
    out = vsa_attention(q, k, v, block_size=16, tile_idx=tile_idx)
    ref = vsa_reference(q.double(), k.double(), v.double(), 16, 2, tile_idx=tile_idx)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tile_idx"):
        vsa_attention(q, k, v, block_size=16, tile_idx=tile_idx[:, :, :3])
