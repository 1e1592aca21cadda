"""Resume is exact: k steps, then `ckpt_path=last` for k more, gives bit-for-bit the weights, EMA, optimizer state and
LR schedule of 2k steps straight (CPU, fixed seeds; crosses an epoch boundary, validation runs in between).

    .venv/bin/python -m pytest tests/test_resume.py
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def h(train_helpers):
    """conftest.py's helpers: h.compose(overrides), h.tiny_model, h.tiny_data(root), h.root."""
    return train_helpers


def _run(h, run_dir, tiny_shards, max_steps, ckpt_path=None):
    from pixdit.cli import train

    overrides = [
        "experiment=quickstart",
        "trainer=cpu",
        *h.tiny_model,
        *h.tiny_data(tiny_shards, batch_size=4),
        f"trainer.max_steps={max_steps}",
        "trainer.val_check_interval=2",
        "optimizer.warmup_steps=5",
        "callbacks.checkpoint.every_n_train_steps=3",
        "callbacks.samples=null",
        "callbacks.throughput=null",
        "model.class_dropout=0.1",
    ]
    if ckpt_path:
        overrides.append(f"ckpt_path={ckpt_path}")
    train.train(h.compose(overrides), run_dir)
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)


def _assert_same(a, b, where="checkpoint"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs (max abs diff {(a.float() - b.float()).abs().max()})"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_resume_is_exact(h, tiny_shards, tmp_path):
    # 16 training images at batch 4 = 4 batches per epoch: the resumed half starts mid-epoch 0 and crosses into epoch 1.
    straight = _run(h, tmp_path / "straight", tiny_shards, max_steps=6)
    _run(h, tmp_path / "halves", tiny_shards, max_steps=3)
    resumed = _run(h, tmp_path / "halves", tiny_shards, max_steps=6, ckpt_path="last")

    assert straight["global_step"] == resumed["global_step"] == 6
    weights = {k: v for k, v in straight["state_dict"].items() if k.startswith("model.")}
    ema = {k: v for k, v in straight["state_dict"].items() if k.startswith("ema.")}
    assert weights and ema and int(ema["ema.num_updates"]) == 6
    # The run must actually have changed the weights (otherwise equality would prove nothing).
    first = _run(h, tmp_path / "one_step", tiny_shards, max_steps=1)
    assert not torch.equal(
        first["state_dict"]["model.final_layer.linear.weight"],
        straight["state_dict"]["model.final_layer.linear.weight"],
    )

    _assert_same(straight["state_dict"], resumed["state_dict"], "state_dict")  # model and EMA
    _assert_same(straight["optimizer_states"], resumed["optimizer_states"], "optimizer_states")
    _assert_same(straight["lr_schedulers"], resumed["lr_schedulers"], "lr_schedulers")
    _assert_same(straight["ShardDataModule"], resumed["ShardDataModule"], "data position")


def test_resume_from_a_final_step_off_the_checkpoint_interval_is_exact(h, tiny_shards, tmp_path):
    """5 steps with a checkpoint every 3: the final-step checkpoint (step 5, mid-epoch 1) resumes exactly too."""
    straight = _run(h, tmp_path / "straight", tiny_shards, max_steps=6)
    first = _run(h, tmp_path / "halves", tiny_shards, max_steps=5)
    assert first["global_step"] == 5
    resumed = _run(h, tmp_path / "halves", tiny_shards, max_steps=6, ckpt_path="last")
    assert resumed["global_step"] == 6
    _assert_same(straight["state_dict"], resumed["state_dict"], "state_dict")
    _assert_same(straight["optimizer_states"], resumed["optimizer_states"], "optimizer_states")
    _assert_same(straight["ShardDataModule"], resumed["ShardDataModule"], "data position")
