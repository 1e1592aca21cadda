"""The `vsa` attention backend (pixdit.attention.VSAAttention) inside a tiny pixel DiT, on CPU.

.venv/bin/python -m pytest tests/kernels/test_vsa_backend.py
"""

import pytest
import torch

from pixdit.attention import build_attention, vsa_annealed_topk
from pixdit.errors import PixditError
from pixdit.flow import RectifiedFlow
from pixdit.kernels import vsa_attention
from pixdit.models import build_model


def _tiny_model(**attention):
    torch.manual_seed(0)
    # zero_init=False: with adaLN-Zero no gradient would reach the attention layers in the first step
    return build_model(
        "DiT-T",
        input_size=(16, 16),
        hidden_size=64,
        depth=2,
        num_heads=2,
        zero_init=False,
        attention={"name": "vsa", "topk": 4, **attention},
    )


def _train_step(model):
    flow = RectifiedFlow(image_size=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = flow.loss(model, torch.rand(2, 3, 16, 16) * 2 - 1)
    loss.backward()
    optimizer.step()
    return loss


def test_tiny_dit_trains_a_step_and_the_zero_gate_learns():
    model = _tiny_model()
    gate = model.blocks[0].attn.backend.gate
    assert gate.weight.abs().sum() == 0 and gate.bias.abs().sum() == 0
    loss = _train_step(model)
    assert torch.isfinite(loss)
    assert gate.weight.abs().sum() > 0  # d gate = dO * O_coarse is non-zero even at gate = 0


def test_zero_gate_means_fine_stage_only_and_gate_false_means_ungated_coarse():
    q, k, v = (torch.randn(2, 2, 64, 32) for _ in range(3))
    hidden = torch.randn(2, 64, 64)
    gated = build_attention({"name": "vsa", "topk": 2}, dim=64, num_heads=2)
    fine_only = vsa_attention(q, k, v, block_size=16, topk=2, gate=torch.zeros_like(q))
    torch.testing.assert_close(gated(q, k, v, grid_hw=(8, 8), hidden=hidden), fine_only)
    ungated = build_attention({"name": "vsa", "topk": 2, "gate": False}, dim=64, num_heads=2)
    assert not any(True for _ in ungated.parameters())
    torch.testing.assert_close(
        ungated(q, k, v, grid_hw=(8, 8), hidden=hidden), vsa_attention(q, k, v, block_size=16, topk=2)
    )


def test_fine_gate_starts_as_no_gate_and_learns():
    """fine_gate=true adds the paper's G_f (W = 0, b = 1): the same output as without it at initialisation, and its
    weight receives gradient (d G_f = dO * O_fine)."""
    q, k, v = (torch.randn(2, 2, 64, 32) for _ in range(3))
    hidden = torch.randn(2, 64, 64)
    plain = build_attention({"name": "vsa", "topk": 2}, dim=64, num_heads=2)
    with_fine_gate = build_attention({"name": "vsa", "topk": 2, "fine_gate": True}, dim=64, num_heads=2)
    assert with_fine_gate.fine_gate.bias.eq(1).all() and with_fine_gate.fine_gate.weight.eq(0).all()
    out = with_fine_gate(q, k, v, grid_hw=(8, 8), hidden=hidden)
    torch.testing.assert_close(out, plain(q, k, v, grid_hw=(8, 8), hidden=hidden))
    out.square().sum().backward()
    assert with_fine_gate.fine_gate.weight.grad.abs().sum() > 0
    model = _tiny_model(fine_gate=True)
    assert model.blocks[0].attn.backend.fine_gate.bias.eq(1).all()  # the model's init leaves it alone
    with pytest.raises(PixditError, match="fine_gate='yes' must be true/false"):
        build_attention({"name": "vsa", "topk": 2, "fine_gate": "yes"}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match="fine_gate must be true or false"):
        build_attention({"name": "vsa", "topk": 2, "fine_gate": 1}, dim=64, num_heads=2)


def test_bf16_autocast_forward_backward():
    model = _tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 16, 16), 1000 * torch.rand(2))
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_annealing_schedule_goes_from_dense_to_the_target():
    ks = [vsa_annealed_topk(step, 100, 10, anneal_every=50, anneal_rate=0.25) for step in (0, 49, 50, 100, 150, 999)]
    assert ks == [100, 100, 75, 50, 25, 10]
    assert vsa_annealed_topk(0, 100, 10, anneal_every=0, anneal_rate=0.02) == 10


def test_annealing_backend_needs_the_step_and_checkpoints_it():
    backend = build_attention({"name": "vsa", "topk": 2, "anneal_every": 10, "anneal_rate": 0.5}, dim=64, num_heads=2)
    q = torch.randn(1, 2, 128, 32)  # 8 tiles
    with pytest.raises(PixditError, match="set_training_step"):
        backend(q, q, q, grid_hw=(8, 16), hidden=torch.randn(1, 128, 64))
    backend.set_training_step(10)
    assert backend.current_topk(128) == 4
    assert int(backend.state_dict()["training_step"]) == 10
    backend.eval()
    backend.set_training_step(25)
    assert backend.current_topk(128) == 2


@pytest.mark.parametrize(
    "options,message",
    [
        ({"block_size": 8}, "block_size"),
        ({"topk": 0}, "topk"),
        ({"topk": 4, "topk_ratio": 0.5}, "both set.*attention.topk=null"),
        ({"anneal_every": -1}, "anneal_every"),
    ],
)
def test_bad_options_are_pixdit_errors(options, message):
    with pytest.raises(PixditError, match=message):
        build_attention({"name": "vsa", **options}, dim=64, num_heads=2)
