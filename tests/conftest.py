"""Shared test helpers: tiny webdataset shards built on the fly, and in-process Hydra composition of train.py's config.

Tests get the helpers through the `train_helpers` fixture (never `from conftest import ...`: tests/kernels has its own
conftest module, and the two would shadow each other).

    .venv/bin/python -m pytest tests/test_train.py tests/test_resume.py tests/test_experiments.py
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"


def compose_config(overrides: list[str]):
    """train.py's config for these command-line overrides, composed in-process (no Hydra run directory) from the
    installed package pixdit.configs, as pixdit-train loads it."""
    from hydra import compose, initialize_config_module

    from pixdit.config import register_resolvers

    register_resolvers()
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


# A model small enough that a CPU step at 32x32 pixels (1024 tokens) takes milliseconds.
TINY_MODEL = ["model=dit_t", "+model.hidden_size=32", "+model.depth=1", "+model.num_heads=2"]


def tiny_data_overrides(root: Path, batch_size: int = 2) -> list[str]:
    return [
        f"data.root={root}",
        "data.resolution=null",
        "data.num_workers=0",
        f"data.batch_size={batch_size}",
        "data.val_images=4",
        "data.epoch_images=null",
    ]


@pytest.fixture(scope="session")
def train_helpers() -> SimpleNamespace:
    """root, config_dir, compose(overrides), tiny_model (overrides), tiny_data(root, batch_size) (overrides)."""
    return SimpleNamespace(
        root=ROOT, config_dir=CONFIG_DIR, compose=compose_config, tiny_model=TINY_MODEL, tiny_data=tiny_data_overrides
    )


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """Unlabelled 32x32 shards: 16 train + 8 val crops of scikit-image's photographs (the quickstart builder)."""
    from pixdit.data.quickstart import make_quickstart_dataset

    out = tmp_path_factory.mktemp("tiny_quickstart")
    make_quickstart_dataset(out, train_count=16, val_count=8, resolution=32, maxcount=8, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_labelled_shards(tmp_path_factory) -> Path:
    """ImageNet-like labelled 32x32 shards (1000 classes, as the imagenet256 experiments expect)."""
    from pixdit.data.imageops import encode_image
    from pixdit.data.shards import ShardWriter, write_manifest

    out = tmp_path_factory.mktemp("tiny_imagenet")
    rng = np.random.default_rng(0)
    splits = {}
    for split, count in (("train", 8), ("val", 4)):
        with ShardWriter(out, split, maxcount=8) as writer:
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                writer.write(f"{i:08d}", encode_image(pixels, "png"), "png", label=int(rng.integers(0, 1000)))
        splits[split] = writer.split_info()
    write_manifest(
        out,
        resolution=32,
        image_format="png",
        splits=splits,
        source="random test images",
        classes=[f"n{i:08d}" for i in range(1000)],
    )
    return out
