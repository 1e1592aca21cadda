"""Sweeps (pixdit.sweep + Hydra multirun through train.py): the grid is Hydra's, bad combinations are reported before
any run starts, a failing run does not stop the others, and the summary marks it; the launcher configs compose.

The end-to-end runs use a 16x16 copy of the quickstart data and a one-block DiT so that they take seconds on a CPU.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from pixdit.errors import PixditError
from pixdit.sweep import check_launch_layout, expand_sweep, find_invalid_runs, gpu_slots, varying

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = [
    "model=dit_t",
    "+model.depth=1",
    "+model.hidden_size=32",
    "+model.num_heads=2",
    "model.patch_size=2",
    "data.resolution=16",
    "data.batch_size=4",
    "data.num_workers=0",
    "data.val_images=8",
    "trainer=cpu",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "callbacks.samples=null",
    "callbacks.checkpoint=null",
    "callbacks.progress_bar=null",
    "callbacks.throughput.window=1",
]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from pixdit.data.quickstart import make_quickstart_dataset

    root = tmp_path_factory.mktemp("data") / "quickstart16"
    make_quickstart_dataset(root, train_count=32, val_count=8, resolution=16, maxcount=16)
    return root


def train_py(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_expand_sweep_is_hydras_cartesian_product():
    jobs = expand_sweep(["attention.topk=4,8", "seed=1", "attention.block_size=16,32"])
    assert jobs == [
        ["attention.topk=4", "seed=1", "attention.block_size=16"],
        ["attention.topk=4", "seed=1", "attention.block_size=32"],
        ["attention.topk=8", "seed=1", "attention.block_size=16"],
        ["attention.topk=8", "seed=1", "attention.block_size=32"],
    ]
    # hydra.sweeper.params (sweeps written in a config) come first, as in BasicSweeper.
    assert expand_sweep(["b=1"], {"a": "x,y"}) == [["a=x", "b=1"], ["a=y", "b=1"]]
    assert varying(jobs) == {
        "attention.topk=4",
        "attention.topk=8",
        "attention.block_size=16",
        "attention.block_size=32",
    }


def test_find_invalid_runs_uses_the_model_build():
    """In-process: a 32x32 grid is 1024 tokens; LLSA needs B^L to divide it (pixdit.kernels.llsa_check)."""
    jobs = expand_sweep(["attention.block_size=16,32", "attention.num_levels=1,3"])
    base = ["model=dit_t", "attention=llsa", "model.token_order=zorder", "data.resolution=32"]
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        invalid = find_invalid_runs(jobs, lambda job: compose(config_name="train", overrides=base + job))
    reasons = {" ".join(job): reason for job, reason in invalid}
    assert set(reasons) == {
        "attention.block_size=16 attention.num_levels=3",
        "attention.block_size=32 attention.num_levels=3",
    }
    assert "4096" in reasons["attention.block_size=16 attention.num_levels=3"]  # B^L = 16^3 is named
    assert "32768" in reasons["attention.block_size=32 attention.num_levels=3"]
    # A config error is an invalid run too, not a crash of the check.
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        invalid = find_invalid_runs([["model.no_such_key=1"]], lambda job: compose(config_name="train", overrides=job))
    assert len(invalid) == 1 and "no_such_key" in invalid[0][1]


def test_bad_combinations_are_reported_before_any_run_starts(tmp_path, tiny_data):
    sweep_dir = tmp_path / "sweep"
    result = train_py(
        "-m",
        *TINY_RUN,
        f"data.root={tiny_data}",
        "attention=llsa",
        "model.token_order=zorder",
        "model.patch_size=1",
        "attention.num_levels=1,3",
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    # 16x16 = 256 tokens: B^3 = 4096 does not divide it; L = 1 is fine.
    assert result.returncode == 2, result.stderr[-3000:]
    assert "1 of the 2 runs of this sweep cannot start; nothing was launched" in result.stderr
    assert "attention.num_levels=3:" in result.stderr and "attention.num_levels=1:" not in result.stderr
    assert "4096" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (sweep_dir / "0").exists() and not (sweep_dir / "1").exists()


def test_sweep_runs_every_job_and_the_summary_marks_the_failed_one(tmp_path, tiny_data):
    """A 3-run sweep with the basic launcher: two train, one fails at start-up (a bad batch size is only noticed by
    the data module, after the pre-launch check); Hydra still runs the others, then reports the failure."""
    sweep_dir = tmp_path / "sweep"
    result = train_py(
        "-m", *TINY_RUN, f"data.root={tiny_data}", "data.batch_size=4,2,0", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr[-3000:]  # Hydra's exit status for a sweep with a failed run
    statuses = [json.loads((sweep_dir / str(i) / "status.json").read_text()) for i in range(3)]
    assert [s["status"] for s in statuses] == ["ok", "ok", "failed"]
    assert "data.batch_size" in statuses[2]["error"] and statuses[2]["error"].startswith("PixditError")
    assert (sweep_dir / "1" / ".hydra" / "config.yaml").is_file()  # each run keeps its config

    summary = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "summarize_sweep.py"), str(sweep_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["data.batch_size"], r["status"]) for r in rows] == [("4", "ok"), ("2", "ok"), ("0", "failed")]
    for row in rows[:2]:
        assert float(row["val_loss"]) > 0 and float(row["images_per_s"]) > 0 and row["steps"] == "2"
    assert (sweep_dir / "summary.png").stat().st_size > 10_000
    assert "| failed |" in (sweep_dir / "summary.md").read_text()


def test_launcher_configs_compose():
    from hydra.core.plugins import Plugins

    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        slurm = compose(
            config_name="train",
            return_hydra_config=True,
            overrides=[
                "hydra/launcher=slurm",
                "trainer=ddp",
                "trainer.devices=4",
                "trainer.num_nodes=2",
                "hydra.launcher.gpus_per_node=4",
                "hydra.launcher.partition=gpu",
            ],
        )
        local = compose(config_name="train", return_hydra_config=True, overrides=["hydra/launcher=local_gpus"])
    # Instantiate the SLURM launcher as Hydra does and look at what it will pass to sbatch.
    launcher = Plugins.instance()._instantiate(slurm.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    params = launcher.params
    assert (params["gpus_per_node"], params["tasks_per_node"], params["nodes"]) == (4, 4, 2)  # Lightning's layout
    assert params["cpus_per_gpu"] > 0 and params["cpus_per_task"] is None and params["partition"] == "gpu"
    assert local.hydra.launcher._target_ == "hydra_plugins.pixdit_sweep.LocalGPUPoolLauncher"
    assert local.hydra.launcher.gpus_per_job == 1
    # Hydra instantiates only launchers its plugin scan found in the installed hydra_plugins namespace package.
    assert type(Plugins.instance()._instantiate(local.hydra.launcher)).__name__ == "LocalGPUPoolLauncher"


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ([], None),  # basic launcher, one device
        (["trainer=ddp"], "basic launcher runs every run as one process"),  # Lightning would re-run `train.py -m`
        (["hydra/launcher=local_gpus"], None),
        (["hydra/launcher=local_gpus", "hydra.launcher.gpus_per_job=2", "trainer=ddp", "trainer.devices=2"], None),
        (["hydra/launcher=local_gpus", "hydra.launcher.gpus_per_job=2"], "gpus_per_job=2"),
        (["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "hydra.launcher.gpus_per_node=4"], None),
        (["hydra/launcher=slurm", "trainer=ddp", "hydra.launcher.gpus_per_node=4"], None),  # devices=auto: all 4
        (
            ["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=2", "hydra.launcher.gpus_per_node=4"],
            "tasks_per_node=4",
        ),
        (["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=2", "hydra.launcher.nodes=1"], "nodes=1"),
    ],
)
def test_launch_layout(overrides, problem):
    """Every process of a multi-GPU run must be started by the launcher (see pixdit.sweep.check_launch_layout)."""
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    if problem is None:
        check_launch_layout(cfg)
    else:
        with pytest.raises(PixditError, match=problem):
            check_launch_layout(cfg)


def test_gpu_slots():
    assert gpu_slots([0, 1, 2, 3], 1) == [(0,), (1,), (2,), (3,)]
    assert gpu_slots([4, 5, 6], 2) == [(4, 5)]  # the odd GPU out stays idle rather than run a half-sized job
    assert gpu_slots([], 1) == [()]  # no GPU: one run at a time on the CPU
    with pytest.raises(PixditError, match="gpus_per_job=4"):
        gpu_slots([0, 1], 4)


def test_local_gpu_pool_runs_one_job_per_gpu(tmp_path, tiny_data):
    """hydra/launcher=local_gpus with two (pretend) GPUs: each run is its own submitit process with its own
    CUDA_VISIBLE_DEVICES; the failing run is recorded and the other one still finishes. (This machine has no GPU:
    the runs use trainer=cpu, the GPU ids only travel through the environment.)"""
    sweep_dir = tmp_path / "sweep"
    result = train_py(
        "-m",
        *TINY_RUN,
        f"data.root={tiny_data}",
        "data.batch_size=4,0",
        "hydra/launcher=local_gpus",
        "hydra.launcher.gpus=[0,1]",
        "hydra.launcher.poll_s=0.2",
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    statuses = [json.loads((sweep_dir / str(i) / "status.json").read_text()) for i in range(2)]
    assert [s["status"] for s in statuses] == ["ok", "failed"]
    assert [s["cuda_visible_devices"] for s in statuses] == ["0", "1"]
    assert "data.batch_size" in statuses[1]["error"]
    assert (sweep_dir / "0" / "metrics.csv").is_file() and (sweep_dir / ".submitit").is_dir()


def test_find_invalid_runs_checks_every_section_the_module_reads():
    """Runs that differ only in the EMA / optimizer / validation sections are not the same check: a bad EMA value in
    one of them must be reported (it used to share the cached verdict of the good run)."""
    jobs = expand_sweep(["ema.max_decay=0.9999,abc"])
    base = ["model=dit_t", "data.resolution=32"]
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        invalid = find_invalid_runs(jobs, lambda job: compose(config_name="train", overrides=base + job))
    assert [job for job, _ in invalid] == [["ema.max_decay=abc"]]
    assert "ema.max_decay" in invalid[0][1]


def test_image_size_is_read_from_the_shards_when_the_config_leaves_it_null(tiny_data):
    from omegaconf import OmegaConf

    from pixdit.sweep import image_size_of

    assert image_size_of(OmegaConf.create({"data": {"root": str(tiny_data), "resolution": None}})) == 16
    assert image_size_of(OmegaConf.create({"data": {"root": str(tiny_data), "resolution": 24}})) == 24


def test_dense_blocks_are_sweepable_and_a_bad_index_is_reported_before_launch():
    """A sweep over per-layer schedules: Hydra's list values are sweep values, each builds (DiT-T has 4 blocks), and
    an index past the model's depth is reported by the pre-launch check."""
    jobs = expand_sweep(["attention.dense_blocks=[],[0,3],[0,4]"])
    assert len(jobs) == 3
    base = ["model=dit_t", "attention=llsa", "data.resolution=16"]
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        composed = [compose(config_name="train", overrides=base + job) for job in jobs]
        invalid = find_invalid_runs(jobs, lambda job: compose(config_name="train", overrides=base + job))
    assert [list(cfg.attention.dense_blocks) for cfg in composed] == [[], [0, 3], [0, 4]]
    assert [job for job, _ in invalid] == [jobs[2]]
    assert "attention.dense_blocks=[0, 4]" in invalid[0][1] and "depth 4" in invalid[0][1]


def test_a_key_nothing_reads_is_an_invalid_run():
    """`+foo=1` was accepted silently (nothing reads it); the pre-launch check reports it like pixdit-train does."""
    base = ["model=dit_t", "data.resolution=32"]
    with initialize_config_module(config_module="pixdit.configs", version_base="1.3"):
        invalid = find_invalid_runs(
            [["+foo=1"], ["seed=1"]], lambda job: compose(config_name="train", overrides=base + job)
        )
    assert [job for job, _ in invalid] == [["+foo=1"]] and "unknown config key(s) foo" in invalid[0][1]


def test_single_runs_do_not_need_the_submitit_launcher():
    """Without hydra-submitit-launcher installed, pixdit.sweep (whose SweepCallback every training run loads) still
    imports, and only the local_gpus launcher fails, with one message naming the package."""
    script = """
import sys
sys.modules["hydra_plugins.hydra_submitit_launcher"] = None  # what a missing package gives: ImportError on import
sys.modules["hydra_plugins.hydra_submitit_launcher.submitit_launcher"] = None
from pixdit.errors import PixditError
from pixdit.sweep import LocalGPUPool, SweepCallback
SweepCallback()
try:
    LocalGPUPool()
except PixditError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hydra/launcher=local_gpus needs the hydra-submitit-launcher package" in done.stdout
