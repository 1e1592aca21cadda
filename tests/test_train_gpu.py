"""train.py on a CUDA GPU (bf16 autocast, fused AdamW, CUDA random streams; optionally torch.compile): a few steps of
the quickstart experiment write a checkpoint, a sample grid and throughput/memory metrics. Skipped without CUDA.

    .venv/bin/python -m pytest -m gpu tests/test_train_gpu.py
"""

from __future__ import annotations

import csv

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("compile", [False, True])
def test_quickstart_on_gpu(train_helpers, tiny_shards, tmp_path, compile):
    from pixdit.cli import train

    h = train_helpers
    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=gpu",
            *h.tiny_model,
            *h.tiny_data(tiny_shards, batch_size=4),
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            "trainer.log_every_n_steps=1",
            "callbacks.checkpoint.every_n_train_steps=3",
            "callbacks.samples.every_n_train_steps=3",
            "callbacks.samples.num_samples=4",
            "callbacks.samples.steps=2",
            "callbacks.throughput.window=2",
            f"compile={str(compile).lower()}",
        ]
    )
    result = train.train(cfg, tmp_path)
    assert result["global_step"] == 6 and result["samples"] and result["checkpoint"]
    checkpoint = torch.load(result["checkpoint"], weights_only=True, map_location="cpu")
    assert int(checkpoint["state_dict"]["ema.num_updates"]) == 6
    assert checkpoint["state_dict"]["ema.model.final_layer.linear.weight"].dtype == torch.float32
    with open(tmp_path / "metrics.csv") as f:
        logged = {k for row in csv.DictReader(f) for k, v in row.items() if v}
    assert {"train/loss", "val/loss", "val/loss_ema", "perf/tokens_per_s", "perf/peak_mem_gb"} <= logged
