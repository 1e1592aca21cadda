"""`trainer=ddp` and `trainer=fsdp` on the CPU: two processes (gloo) train a few steps through train.py's own
`train()`; afterwards both ranks hold identical weights and EMA weights, and the loader gave the ranks disjoint
samples. Resuming from a checkpoint at half the steps continues exactly: same weights on every rank as the run that
never stopped, same samples. FSDP (weights, gradients and AdamW sharded over the two processes, pixdit.fsdp) ends
with the weights DDP ends with, up to float rounding, with gradient clipping active (a wrong global gradient norm
would show) and every block recomputed in the backward (model.grad_checkpointing=true inside the FSDP units).

The test runs this file as a script (``python tests/test_distributed.py OUT_DIR OVERRIDES...``). Lightning's launcher
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
STEPS, BATCH = 4, 4
CHECKPOINT_EVERY_2 = ["callbacks.checkpoint.every_n_train_steps=2"]  # every one kept: the resumes start at step=2
DDP = ["trainer=ddp"]
FSDP = ["trainer=fsdp", "model.grad_checkpointing=true"]  # + recomputation inside the FSDP units
OVERRIDES = [
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.gradient_clip_val=0.05",
    "trainer.val_check_interval=1000",
    "trainer.enable_model_summary=false",
    "trainer.log_every_n_steps=1",
    "model=dit_t",
    "+model.depth=1",
    "+model.hidden_size=32",
    "+model.num_heads=2",
    "model.patch_size=2",
    f"data.batch_size={BATCH}",
    "data.num_workers=0",
    "data.val_images=8",
    "data.flip=false",
    "callbacks.samples=null",
    "callbacks.progress_bar=null",
    "callbacks.throughput.window=1",
]


def image_digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()


def run_rank(out_dir: Path, overrides: list[str]) -> None:
    """The program of every rank (see module doc)."""
    import lightning as L
    from hydra import compose, initialize_config_module

    import pixdit.callbacks
    from pixdit.cli import train as train_script  # the code `python train.py` / `pixdit-train` runs
    from pixdit.config import register_resolvers

    class RankProbe(L.Callback):
        def __init__(self):
            self.seen: list[str] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen += [image_digest(image) for image in batch["image"].cpu()]

        def on_train_end(self, trainer, pl_module):
            from torch.distributed.tensor import DTensor

            def whole(tensor):  # FSDP's shards, gathered (every rank takes part)
                return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()

            state = {
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "step": trainer.global_step,
                "strategy": type(trainer.strategy).__name__,
                "seen": self.seen,
                "weights": {k: whole(v) for k, v in pl_module.model.state_dict().items()},
                "ema": {k: whole(v) for k, v in pl_module.ema.model.state_dict().items()},
                "sharded": any(isinstance(p, DTensor) for p in pl_module.model.parameters()),
            }
            torch.save(state, out_dir / f"rank{trainer.global_rank}.pt")

    build_callbacks = pixdit.callbacks.build_callbacks
    pixdit.callbacks.build_callbacks = lambda cfg, run_dir: build_callbacks(cfg, run_dir) + [RankProbe()]
    register_resolvers()
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train_script.train(cfg, out_dir / "run")
    # A process group left open aborts some exits (gloo threads at interpreter teardown, status -6): train() closes it.
    assert not torch.distributed.is_initialized(), "train() left the process group open"


def run_two(strategy: list[str], out_dir: Path, data_root: Path, *overrides: str) -> list[dict]:
    """Run this file as a 2-process training (``strategy``: DDP or FSDP) into ``out_dir``; the two ranks' end
    states."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        str(out_dir),
        f"data.root={data_root}",
        "data.resolution=16",
        *strategy,
        *OVERRIDES,
        *overrides,
    ]
    result = subprocess.run(command, cwd=out_dir.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_same_weights(a: dict, b: dict, what: str) -> None:
    for key in ("weights", "ema"):
        assert a[key].keys() == b[key].keys()
        different = [k for k in a[key] if not torch.equal(a[key][k], b[key][k])]
        assert not different, f"{what}: {key} differ: {different[:5]}"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from pixdit.data.quickstart import make_quickstart_dataset

    root = tmp_path_factory.mktemp("ddp") / "data"
    make_quickstart_dataset(root, train_count=64, val_count=8, resolution=16, maxcount=16)
    return root


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_root):
    """STEPS steps of DDP without a stop: the two ranks' end states (and the run directory)."""
    out_dir = tmp_path_factory.mktemp("ddp") / "straight"
    return run_two(DDP, out_dir, data_root, f"trainer.max_steps={STEPS}", *CHECKPOINT_EVERY_2), out_dir


@pytest.fixture(scope="module")
def straight_fsdp(tmp_path_factory, data_root):
    """The same with trainer=fsdp."""
    out_dir = tmp_path_factory.mktemp("fsdp") / "straight"
    return run_two(FSDP, out_dir, data_root, f"trainer.max_steps={STEPS}", *CHECKPOINT_EVERY_2), out_dir


def test_ddp_two_cpu_processes_agree_on_weights(straight):
    ranks, out_dir = straight
    for r, state in enumerate(ranks):
        assert (state["rank"], state["world_size"], state["step"]) == (r, 2, STEPS)
        assert state["strategy"] == "DDPStrategy"
        assert len(state["seen"]) == STEPS * BATCH
    # Same weights and EMA weights on both ranks, bit for bit (gradients were all-reduced every step) ...
    assert_same_weights(ranks[0], ranks[1], "rank 0 vs rank 1")
    # ... and training moved them (the adaLN-Zero output layer starts at exactly zero).
    assert any(v.abs().sum() > 0 for k, v in ranks[0]["weights"].items() if "final_layer.linear" in k)
    # Each rank got its own samples.
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])
    # Rank 0 wrote the logs and the checkpoint.
    assert (out_dir / "run" / "metrics.csv").is_file() and (out_dir / "run" / "checkpoints" / "last.ckpt").is_file()


def half_way(run: tuple[list[dict], Path]) -> str:
    """The override that resumes from a straight run's checkpoint at half its steps, as after a preemption there."""
    return f"ckpt_path='{run[1] / 'run' / 'checkpoints' / f'step={STEPS // 2}.ckpt'}'"


def test_ddp_resume_is_exact(tmp_path, data_root, straight):
    """New processes resumed from the straight run's checkpoint at half the steps: the rest == straight through, on
    both ranks (model, EMA, data)."""
    half = STEPS // 2
    resumed = run_two(
        DDP, tmp_path / "resumed", data_root, f"trainer.max_steps={STEPS}", half_way(straight), *CHECKPOINT_EVERY_2
    )
    for r in (0, 1):
        assert resumed[r]["step"] == STEPS
        assert resumed[r]["seen"] == straight[0][r]["seen"][half * BATCH :]  # the data picks up where it stopped
        assert_same_weights(straight[0][r], resumed[r], f"rank {r}, straight vs resumed")


def test_fsdp_trains_like_ddp(straight, straight_fsdp):
    """trainer=fsdp: the model really is sharded, both ranks end with the same weights and the same full EMA, the
    ranks saw the samples DDP's saw, and the weights are DDP's up to float rounding; it writes a checkpoint (full
    state dict) and its EMA artifact, which load like DDP's."""
    from pixdit.checkpoint import load_weights

    ranks, out_dir = straight_fsdp
    for r, state in enumerate(ranks):
        assert (state["rank"], state["world_size"], state["step"], state["strategy"]) == (r, 2, STEPS, "FSDPStrategy")
        assert state["sharded"]
        assert state["seen"] == straight[0][r]["seen"]
    assert_same_weights(ranks[0], ranks[1], "FSDP rank 0 vs rank 1")
    for key in ("weights", "ema"):
        for name, value in straight[0][0][key].items():
            torch.testing.assert_close(ranks[0][key][name], value, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
    last = out_dir / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert (
        checkpoint["state_dict"].keys()
        == torch.load(straight[1] / "run" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"].keys()
    )
    ema = load_weights(last).state_dict  # from the EMA artifact next to the checkpoint
    for name, value in ranks[0]["ema"].items():
        assert torch.equal(ema[name], value), name


def test_fsdp_resume_is_exact(tmp_path, data_root, straight_fsdp):
    """trainer=fsdp: new processes resumed from the straight run's checkpoint at half the steps (a full state dict
    loaded into the shards, with AdamW's state) == straight through, bit for bit, on both ranks (model, EMA, data)."""
    half = STEPS // 2
    resumed = run_two(
        FSDP,
        tmp_path / "resumed",
        data_root,
        f"trainer.max_steps={STEPS}",
        half_way(straight_fsdp),
        *CHECKPOINT_EVERY_2,
    )
    for r in (0, 1):
        assert resumed[r]["step"] == STEPS
        assert resumed[r]["seen"] == straight_fsdp[0][r]["seen"][half * BATCH :]
        assert_same_weights(straight_fsdp[0][r], resumed[r], f"FSDP rank {r}, straight vs resumed")


@pytest.mark.parametrize(
    "runs, needed", [(["1gpu"], 1), (["1gpu", "1gpu_seed1"], 1), (["1gpu", "2gpu"], 2), (["2gpu_fsdp"], 2)]
)
def test_bench_scaling_asks_only_for_the_gpus_its_runs_need(runs, needed, tmp_path):
    import runpy

    assert runpy.run_path(str(REPO / "scripts" / "bench_scaling.py"))["gpus_needed"](runs) == needed
    if torch.cuda.device_count() >= needed:
        return  # the refusal below is what a machine with too few GPUs sees
    cmd = [sys.executable, "scripts/bench_scaling.py", "--out", str(tmp_path), "--runs", *runs]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"needs {needed} GPU(s), found {torch.cuda.device_count()}" in run.stderr


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), sys.argv[2:])
