"""The training-memory estimate and its advice (pixdit.memory), on the CPU with made-up free-memory values: how it
scales with each knob, the error before the first step names every knob, a CUDA out-of-memory error becomes the same
advice, and the per-block activation count brackets what the model really saves for its backward pass.
Run: .venv/bin/python -m pytest tests/test_memory.py"""

from __future__ import annotations

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.memory import GiB, check_fits, estimate_training_memory, explain_out_of_memory, largest_batch
from pixdit.models import build_model
from pixdit.models.checkpointing import grad_checkpointing_plan


def model(name="DiT-B", side=256, grad_checkpointing=False, depth=None, **options):
    with torch.device("meta"):  # no memory: only the shapes matter
        return build_model(
            name,
            input_size=side,
            attention={"name": "llsa", "num_levels": 2},
            grad_checkpointing=grad_checkpointing,
            **({"depth": depth} if depth else {}),
            **options,
        )


def activations(estimate, bound=1):
    return estimate.parts["activations"][bound]


def test_scales_with_each_knob():
    dit_b = model()
    base = estimate_training_memory(dit_b, 4)
    assert base.low < base.high
    assert activations(estimate_training_memory(dit_b, 8)) == pytest.approx(2 * activations(base))
    # the one measured point (docs in pixdit.memory): eager DiT-B 256^2 LLSA, batch 4, peaked at 122.8 GiB
    assert base.low / GiB < 122.8 < base.high / GiB * 1.05
    fp32 = estimate_training_memory(dit_b, 4, precision="32-true")
    assert 1.9 < activations(fp32) / activations(base) <= 2.0
    depth = len(dit_b.blocks)
    recompute_all = estimate_training_memory(dit_b, 4, grad_checkpointing=grad_checkpointing_plan(True, depth))
    mlp_only = estimate_training_memory(dit_b, 4, grad_checkpointing=grad_checkpointing_plan("mlp", depth))
    first_half = estimate_training_memory(dit_b, 4, grad_checkpointing=grad_checkpointing_plan(depth // 2, depth))
    assert activations(recompute_all) < activations(first_half) < activations(base)
    assert activations(recompute_all) < activations(mlp_only) < activations(base)
    assert estimate_training_memory(model(grad_checkpointing=True), 4).high == recompute_all.high  # the model's plan
    # FSDP shards the weights, gradients and AdamW state; DDP adds its gradient buckets
    ddp = estimate_training_memory(dit_b, 4, strategy="ddp", world_size=2)
    fsdp = estimate_training_memory(dit_b, 4, strategy="fsdp", world_size=2)
    assert fsdp.parts["AdamW"][0] == base.parts["AdamW"][0] / 2 and fsdp.parts["EMA"] == base.parts["EMA"]
    assert fsdp.low < base.low < ddp.low


def test_error_before_the_first_step_names_every_knob():
    dit_xl = model("DiT-XL", num_heads=18)  # head dim 64: the LLSA kernels take 16, 32, 64, 128 (72 is refused)
    estimate = estimate_training_memory(dit_xl, 8, precision="32-true")
    with pytest.raises(PixditError) as error:
        check_fits(dit_xl, estimate, 139 * GiB, where="cuda:0")
    message = str(error.value)
    for knob in (
        "data.batch_size=",
        "model.grad_checkpointing=true",
        "trainer.precision=bf16-mixed",
        "trainer=fsdp",
        "compile_memory_budget=0.9",
        "does not fit cuda:0",
        "139.0 GiB are free",
    ):
        assert knob in message, (knob, message)
    fits = largest_batch(estimate, 139 * GiB)
    assert f"data.batch_size={max(1, fits)} (now 8" in message
    # between the bounds: no error, but "may not fit"; above the high bound: fits
    small = estimate_training_memory(model("DiT-S", side=64), 4)
    assert check_fits(model("DiT-S", side=64), small, (small.low + small.high) / 2) is False
    assert check_fits(model("DiT-S", side=64), small, small.high + 1) is True


def test_largest_batch_is_the_largest_that_fits():
    dit_b = model()
    estimate = estimate_training_memory(dit_b, 4)
    free = 80 * GiB
    n = largest_batch(estimate, free)
    assert estimate_training_memory(dit_b, n).high <= free < estimate_training_memory(dit_b, n + 1).high
    low = largest_batch(estimate, free, "low")
    assert estimate_training_memory(dit_b, low).low <= free < estimate_training_memory(dit_b, low + 1).low

    def mid(batch):  # halfway between the bounds
        other = estimate_training_memory(dit_b, batch)
        return (other.low + other.high) / 2

    m = largest_batch(estimate, free, "mid")
    assert n < m < low and mid(m) <= free < mid(m + 1)
    with pytest.raises(ValueError, match="bound must be one of .*'mid'"):
        largest_batch(estimate, free, "typical")


def test_out_of_memory_becomes_one_error_with_the_advice():
    dit_b = model()
    estimate = estimate_training_memory(dit_b, 16)

    class Trainer:
        global_step = 0

    with pytest.raises(PixditError) as error:
        with explain_out_of_memory(dit_b, estimate, Trainer()):
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                "capacity of 139.8 GiB of which 1.2 GiB is free.\nmore lines"
            )
    message = str(error.value)
    assert "ran out of GPU memory at step 0 (CUDA out of memory)" in message
    assert "data.batch_size=8" in message and "model.grad_checkpointing=true" in message
    with explain_out_of_memory(dit_b, estimate):  # anything else passes through untouched
        pass
    with pytest.raises(ValueError):
        with explain_out_of_memory(dit_b, estimate):
            raise ValueError("not memory")


def saved_bytes(net, x, t) -> int:
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(x, t)
    return sum(storages.values())


@pytest.mark.parametrize("setting", [False, True, "mlp", "attention"])
def test_per_block_count_brackets_what_a_block_saves(setting):
    """What two more blocks add to the tensors saved for the backward (CPU, fp32, full attention: the PyTorch ops
    behind the GPU's) lies between the estimate's low and high per-block counts."""
    x, t = torch.randn(2, 3, 16, 16), torch.rand(2) * 1000
    measured, estimated = [], []
    for depth in (2, 4):
        torch.manual_seed(0)
        net = build_model("DiT-T", input_size=16, depth=depth, hidden_size=32, num_heads=2, grad_checkpointing=setting)
        measured.append(saved_bytes(net, x, t))
        estimated.append(estimate_training_memory(net, 2, precision="32-true").parts["activations"])
    added = measured[1] - measured[0]
    assert estimated[1][0] - estimated[0][0] <= added <= estimated[1][1] - estimated[0][1], (added, estimated)
