"""The `sla` attention backend (pixdit.attention.SLAAttention) inside a tiny pixel DiT, on CPU.

.venv/bin/python -m pytest tests/kernels/test_sla_backend.py
"""

import pytest
import torch

from pixdit.attention import build_attention
from pixdit.errors import PixditError
from pixdit.flow import RectifiedFlow
from pixdit.kernels import sla_attention
from pixdit.models import build_model


@pytest.mark.parametrize("scope,feature_map", [("noncritical", "softmax"), ("all", "elu"), ("marginal", "relu")])
def test_tiny_dit_trains_a_step_and_the_zero_proj_learns(scope, feature_map):
    torch.manual_seed(0)
    # zero_init=False: with adaLN-Zero no gradient would reach the attention layers in the first step
    model = build_model(
        "DiT-T",
        input_size=(16, 16),
        hidden_size=64,
        depth=2,
        num_heads=2,
        zero_init=False,
        attention={
            "name": "sla",
            "topk": 4,
            "linear_scope": scope,
            "feature_map": feature_map,
            "negligible_ratio": 0.25 if scope == "marginal" else 0.0,
        },
    )
    proj = model.blocks[0].attn.backend.proj_linear
    assert proj.weight.abs().sum() == 0 and proj.bias.abs().sum() == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = RectifiedFlow(image_size=16).loss(model, torch.rand(2, 3, 16, 16) * 2 - 1)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert proj.weight.abs().sum() > 0


def test_output_is_sparse_plus_projected_linear_shared_across_heads():
    q, k, v = (torch.randn(2, 2, 64, 32) for _ in range(3))
    backend = build_attention({"name": "sla", "topk": 2}, dim=64, num_heads=2)
    o_sparse, o_linear = sla_attention(q, k, v, block_size=16, topk=2)
    out = backend(q, k, v, grid_hw=(8, 8), hidden=torch.zeros(2, 64, 64))
    torch.testing.assert_close(out, o_sparse)  # zero-initialised Proj
    with torch.no_grad():
        backend.proj_linear.weight.copy_(torch.randn(32, 32))
        backend.proj_linear.bias.copy_(torch.randn(32))
    out = backend(q, k, v, grid_hw=(8, 8), hidden=torch.zeros(2, 64, 64))
    w, b = backend.proj_linear.weight, backend.proj_linear.bias
    torch.testing.assert_close(out, o_sparse + o_linear @ w.T + b)


def test_bf16_autocast_forward():
    backend = build_attention({"name": "sla", "topk": 2}, dim=64, num_heads=2)
    q = torch.randn(1, 2, 64, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = backend(q, q, q, grid_hw=(8, 8), hidden=torch.zeros(1, 64, 64))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"block_size": 128}, "block_size"),
        ({"topk": 0}, "topk"),
        ({"linear_scope": "paper"}, "linear_scope"),
        ({"feature_map": "hedgehog"}, "feature_map"),
        ({"negligible_ratio": 0.1}, "marginal"),
    ],
)
def test_bad_options_are_pixdit_errors(options, message):
    with pytest.raises(PixditError, match=message):
        build_attention({"name": "sla", **options}, dim=64, num_heads=2)
