"""Every experiment config composes and runs `trainer.fast_dev_run` on CPU with a tiny model on shards built here, and
the quickstart runs with every attention backend (the token order follows the backend: model.token_order=auto).

    .venv/bin/python -m pytest tests/test_experiments.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pixdit.attention import attention_class
from pixdit.tokens import resolve_token_order


@pytest.fixture
def h(train_helpers):
    """conftest.py's helpers: h.compose(overrides), h.tiny_model, h.tiny_data(root), h.root."""
    return train_helpers


EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "experiment").glob("*.yaml"))


def test_the_paper_experiments_exist():
    expected = {f"ffhq{r}_{a}" for r in (32, 128, 256, 512) for a in ("full", "llsa", "vsa", "sla")}
    expected |= {f"imagenet256_{a}" for a in ("full", "llsa", "vsa", "sla")} | {"quickstart"}
    assert expected <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if e != "quickstart"])
def test_experiment_recipe(h, experiment):
    """The composed config carries the paper's recipe (docs/algorithms.md: DiT-S, patch 1, AdamW 1e-4, bf16, clip 1)."""
    cfg = h.compose([f"experiment={experiment}"])
    attention = experiment.rsplit("_", 1)[1]
    assert cfg.name == experiment
    assert cfg.model.name == "DiT-S" and cfg.model.patch_size == 1
    assert cfg.attention.name == attention
    order = resolve_token_order(cfg.model.token_order, attention_class(attention).token_order, attention)
    assert order == ("raster" if attention == "full" else "zorder")
    assert cfg.optimizer.lr == 1e-4 and cfg.flow.noise_scale == "auto"
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.gradient_clip_val == 1.0
    resolution = int(experiment.split("_")[0].removeprefix("ffhq").removeprefix("imagenet"))
    assert cfg.data.resolution == resolution
    if experiment.startswith("ffhq"):
        assert cfg.data.batch_size * resolution**2 == 262_144 or resolution == 32  # pixel tokens per step
    else:
        assert cfg.model.num_classes == 1000 and cfg.data.labelled
    if attention == "llsa":
        assert (cfg.attention.topk, cfg.attention.block_size, cfg.attention.num_levels) == (8, 16, None)
    if attention in ("vsa", "sla"):
        assert cfg.attention.topk == (20 if resolution <= 128 else 32)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_fast_dev_run(h, experiment, tiny_shards, tiny_labelled_shards, tmp_path):
    from pixdit.cli import train

    shards = tiny_labelled_shards if experiment.startswith("imagenet") else tiny_shards
    cfg = h.compose(
        [
            f"experiment={experiment}",
            "trainer=cpu",
            "trainer.devices=1",
            "trainer.fast_dev_run=1",
            *h.tiny_model,
            *h.tiny_data(shards),
            "callbacks.samples.num_samples=2",
            "callbacks.samples.steps=2",
        ]
    )
    result = train.train(cfg, tmp_path)
    assert result["global_step"] == 1
    assert result["samples"] is not None


@pytest.mark.parametrize("attention", ["llsa", "vsa", "sla"])
def test_quickstart_runs_with_a_sparse_attention(h, attention, tiny_shards, tmp_path):
    """`train.py experiment=quickstart attention=llsa` needs no token-order override (auto picks zorder)."""
    from pixdit.cli import train

    cfg = h.compose(
        [
            "experiment=quickstart",
            f"attention={attention}",
            "trainer=cpu",
            "trainer.devices=1",
            "trainer.fast_dev_run=1",
            *h.tiny_model,
            *h.tiny_data(tiny_shards),
            "callbacks.samples=null",
        ]
    )
    assert cfg.model.token_order == "auto"
    assert train.train(cfg, tmp_path)["global_step"] == 1
