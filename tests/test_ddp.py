"""`trainer=ddp` on the CPU: two processes (gloo) train a few steps through train.py's own `train()`; afterwards both
ranks hold identical weights and EMA weights, and the loader gave the ranks disjoint samples.

The test runs this file as a script (``python tests/test_ddp.py OUT_DIR OVERRIDES...``). Lightning's DDP launcher
re-runs the same command for rank 1, so the script is the whole program of both ranks: it composes configs/train.yaml
with the overrides, adds an observer callback (``RankProbe``: it records what each rank saw and ended with), and calls
train.py's ``train``. Without gradient all-reduce, ranks that see different samples end with different weights, so the
equality below can fail; with a loader that ignored the rank, the sample sets would overlap.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH = 3, 4
OVERRIDES = [
    "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
    f"trainer.max_steps={STEPS}", "trainer.val_check_interval=1000", "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1",
    "model=dit_t", "+model.depth=1", "+model.hidden_size=32", "+model.num_heads=2", "model.patch_size=2",
    f"data.batch_size={BATCH}", "data.num_workers=0", "data.val_images=8", "data.flip=false",
    "callbacks.samples=null", "callbacks.checkpoint=null", "callbacks.progress_bar=null",
    "callbacks.throughput.window=1",
]


def image_digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def run_rank(out_dir: Path, overrides: list[str]) -> None:
    """The program of every rank (see module doc)."""
    import lightning as L
    from hydra import compose, initialize_config_dir

    import pixdit.callbacks
    from pixdit.config import register_resolvers

    sys.path.insert(0, str(REPO))
    import train as train_script  # train.py: the code users run

    class RankProbe(L.Callback):
        def __init__(self):
            self.seen: list[str] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen += [image_digest(image) for image in batch["image"].cpu()]

        def on_train_end(self, trainer, pl_module):
            state = {"rank": trainer.global_rank, "world_size": trainer.world_size, "step": trainer.global_step,
                     "strategy": type(trainer.strategy).__name__, "seen": self.seen,
                     "weights": {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
                     "ema": {k: v.detach().clone() for k, v in pl_module.ema.model.state_dict().items()}}
            torch.save(state, out_dir / f"rank{trainer.global_rank}.pt")

    build_callbacks = pixdit.callbacks.build_callbacks
    pixdit.callbacks.build_callbacks = lambda cfg, run_dir: build_callbacks(cfg, run_dir) + [RankProbe()]
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train_script.train(cfg, out_dir / "run")


def test_ddp_two_cpu_processes_agree_on_weights(tmp_path):
    from pixdit.data.quickstart import make_quickstart_dataset

    make_quickstart_dataset(tmp_path / "data", train_count=64, val_count=8, resolution=16, maxcount=16)
    command = [sys.executable, str(Path(__file__).resolve()), str(tmp_path), f"data.root={tmp_path / 'data'}",
               "data.resolution=16", *OVERRIDES]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, state in enumerate(ranks):
        assert (state["rank"], state["world_size"], state["step"]) == (r, 2, STEPS)
        assert state["strategy"] == "DDPStrategy"
        assert len(state["seen"]) == STEPS * BATCH
    # Same weights and EMA weights on both ranks, bit for bit (gradients were all-reduced every step) ...
    for key in ("weights", "ema"):
        a, b = ranks[0][key], ranks[1][key]
        assert a.keys() == b.keys()
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, f"{key} differ between ranks: {different[:5]}"
    # ... and training moved them (the adaLN-Zero output layer starts at exactly zero).
    assert any(v.abs().sum() > 0 for k, v in ranks[0]["weights"].items() if "final_layer.linear" in k)
    # Each rank got its own samples.
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    # Only rank 0 wrote the logs.
    assert (tmp_path / "run" / "metrics.csv").is_file()


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), sys.argv[2:])
