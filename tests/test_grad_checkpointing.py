"""model.grad_checkpointing (pixdit.models.checkpointing): every setting gives exactly the loss and gradients of the
model without it, keeps fewer activations for the backward pass, leaves names and the EMA copy intact, and a bad
value is one error naming the allowed values. Run: .venv/bin/python -m pytest tests/test_grad_checkpointing.py"""

from __future__ import annotations

import functools

import pytest
import torch

from pixdit.ema import EMA
from pixdit.errors import PixditError
from pixdit.models import build_model
from pixdit.models.checkpointing import grad_checkpointing_plan

SETTINGS = [True, "all", 1, 2, "mlp", "attention"]
ATTENTION = {"name": "llsa", "num_levels": 1, "topk": 2}  # a backend with its own autograd Function on the CPU path


def tiny(grad_checkpointing=False):
    torch.manual_seed(0)
    model = build_model(
        "DiT-T",
        input_size=(8, 8),
        depth=3,
        hidden_size=32,
        num_heads=2,
        zero_init=False,
        num_classes=4,
        class_dropout=0.5,
        attention=ATTENTION,
        grad_checkpointing=grad_checkpointing,
    )
    with torch.no_grad():  # zero_init=False leaves the adaLN gates at PyTorch's init: make every weight matter
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def loss_and_grads(model):
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 3, 8, 8, generator=g), 1000 * torch.rand(2, generator=g)
    y = torch.tensor([1, 3])
    torch.manual_seed(2)  # label dropout draws from the global generator: the same draw with and without
    loss = model(x, t, y).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def saved_bytes(model) -> int:
    """Bytes of the distinct tensors kept for the backward pass by one forward."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    g = torch.Generator().manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randn(2, 3, 8, 8, generator=g), 1000 * torch.rand(2, generator=g), torch.tensor([1, 3]))
    return sum(storages.values())


@pytest.mark.parametrize("setting", SETTINGS)
def test_same_loss_and_gradients_as_without(setting):
    reference_loss, reference_grads = loss_and_grads(tiny())
    model = tiny(setting)
    assert model.grad_checkpointing_plan, setting
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, reference_loss)
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name
    assert saved_bytes(model) < saved_bytes(tiny())  # and it does keep less for the backward pass


def test_names_state_dict_and_ema_copy_unchanged():
    plain, recomputed = tiny(), tiny(True)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    recomputed.load_state_dict(plain.state_dict())
    # The EMA is a deepcopy: its blocks must run with the copy's weights, not the original's.
    ema = EMA(recomputed)
    with torch.no_grad():
        for parameter in recomputed.parameters():
            parameter.mul_(2)
    x, t = torch.randn(1, 3, 8, 8), torch.full((1,), 500.0)
    recomputed.eval()
    expected = tiny().eval()(x, t)  # the original weights, no recomputation
    torch.testing.assert_close(ema.model(x, t), expected, rtol=0, atol=0)
    with torch.enable_grad():  # and with gradients on (recomputation active) as well
        torch.testing.assert_close(ema.model(x, t), expected, rtol=0, atol=0)


def test_plan():
    assert grad_checkpointing_plan(False, 4) == {} and grad_checkpointing_plan(None, 4) == {}
    assert grad_checkpointing_plan(0, 4) == {}
    assert grad_checkpointing_plan(True, 3) == {0: "block", 1: "block", 2: "block"}
    assert grad_checkpointing_plan(2, 4) == {0: "block", 1: "block"}
    assert grad_checkpointing_plan("mlp", 2) == {0: "mlp", 1: "mlp"}
    assert grad_checkpointing_plan("attention", 1) == {0: "attn"}


@pytest.mark.parametrize("value", [5, -1, "ffn", "true", 1.5])
def test_bad_value_names_the_allowed_ones(value):
    with pytest.raises(PixditError) as error:
        build_model("DiT-T", input_size=(8, 8), grad_checkpointing=value)  # DiT-T: 4 blocks
    message = str(error.value)
    assert "model.grad_checkpointing" in message and "from 0 to 4" in message
    assert all(word in message for word in ("false", "true", "'mlp'", "'attention'"))


@functools.cache  # one compile for both settings where they run in one process
def compiled_without_recomputation():
    torch._dynamo.reset()
    return loss_and_grads(torch.compile(tiny(), backend="aot_eager", fullgraph=True))


@pytest.mark.parametrize("setting", [True, "attention"])
def test_compiled_training_recomputes_the_joints_exactly(setting):
    """Compiled with autograd, the blocks' residual adds run inside the adaLN joints (pixdit.kernels.adaln_joint) and
    a block returns its MLP output for the next block's joint: recomputing whole blocks or only the attention gives
    the loss and gradients of the compiled model without it."""
    reference_loss, reference_grads = compiled_without_recomputation()
    torch._dynamo.reset()
    loss, grads = loss_and_grads(torch.compile(tiny(setting), backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name].flatten(), grad.flatten(), rtol=1e-5, atol=1e-7, msg=name)
