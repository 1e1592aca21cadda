"""End to end: FIDCallback in a tiny Lightning run, and scripts/evaluate.py on its checkpoint (stand-in Inception file)."""

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from lightning.pytorch.loggers import CSVLogger
from test_eval_pipeline import TINY, write_tiny_shards
from test_eval_standin import write_standin_inception

from pixdit.callbacks import AtomicCheckpointIO
from pixdit.cli import evaluate as evaluate_cli
from pixdit.errors import PixditError
from pixdit.eval import InceptionFeatureExtractor, MetricSuite, evaluate_generator, generate_uint8, load_reference
from pixdit.eval.callback import FIDCallback
from pixdit.eval.reference import make_reference_stats
from pixdit.module import DiffusionModule

REPO = Path(__file__).resolve().parent.parent
FID_OPTIONS = dict(num_samples=12, steps=2, batch_size=5, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_e2e")
    weights = write_standin_inception(root / "inception")
    write_tiny_shards(root / "shards")
    reference = make_reference_stats(
        root / "shards", InceptionFeatureExtractor(weights), batch_size=16, progress=lambda message: None
    )
    return {"root": root, "weights": weights, "reference": reference}


def suite(files, metrics=("fid", "is")):
    return MetricSuite(metrics, InceptionFeatureExtractor(files["weights"]), load_reference(str(files["reference"])))


def tiny_module():
    torch.manual_seed(0)
    return DiffusionModule(model={"name": "DiT-T", **TINY}, image_size=8)


def loader():
    generator = torch.Generator().manual_seed(0)
    batches = [{"image": torch.rand(4, 3, 8, 8, generator=generator) * 2 - 1} for _ in range(4)]
    return torch.utils.data.DataLoader(batches, batch_size=None)


def trainer(tmp_path, callback, **options):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name="log"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def test_callback_logs_fid_of_the_ema_model_every_n_train_steps_and_at_the_end(tmp_path, files):
    callback = FIDCallback(
        reference=str(files["reference"]),
        every_n_train_steps=2,
        at_end=True,
        sampler="heun",
        inception_path=str(files["weights"]),
        **FID_OPTIONS,
    )
    module = tiny_module()
    samplers_used, original = [], module.flow.sample

    def recording(*args, **kwargs):
        samplers_used.append(kwargs.get("sampler"))
        return original(*args, **kwargs)

    module.flow.sample = recording
    fit = trainer(tmp_path, callback, max_steps=3)
    fit.fit(module, train_dataloaders=loader())
    module.flow.sample = original
    rows = (tmp_path / "log" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, row.split(","))) for row in rows[1:]]
    fid_rows = [r for r in logged if r.get("fid")]
    assert [int(r["step"]) for r in fid_rows] == [2, 3]  # every 2 steps, then at the end
    assert all(float(r["is_mean"]) >= 1.0 and r["is_std"] != "" for r in fid_rows)
    assert float(fit.callback_metrics["fid"]) == pytest.approx(float(fid_rows[-1]["fid"]))
    # Independent re-computation from the trained module's EMA weights gives the logged end-of-training value.
    direct = evaluate_generator(
        module.ema.model, module.flow, suite(files), image_size=(8, 8), sampler="heun", **FID_OPTIONS
    )
    assert direct["fid"] == pytest.approx(float(fid_rows[-1]["fid"]), rel=1e-4)
    assert samplers_used and set(samplers_used) == {"heun"}  # the setting reached the generation
    assert direct["is_mean"] == pytest.approx(float(fid_rows[-1]["is_mean"]), rel=1e-4)


def test_callback_does_not_evaluate_the_checkpoint_step_again_after_a_resume(tmp_path, files):
    class Recording(FIDCallback):
        def evaluate(self, trainer, pl_module):
            evaluated.append(trainer.global_step)
            return super().evaluate(trainer, pl_module)

    options = dict(
        reference=str(files["reference"]),
        every_n_train_steps=1,
        at_end=False,
        inception_path=str(files["weights"]),
        **FID_OPTIONS,
    )
    evaluated = []
    first = trainer(tmp_path, Recording(**options), max_steps=1, accumulate_grad_batches=2)
    first.fit(tiny_module(), train_dataloaders=loader())
    first.save_checkpoint(tmp_path / "step1.ckpt")
    assert evaluated == [1]
    evaluated.clear()  # resumed: the first micro-batch (no optimizer step yet) still sees global_step 1
    resumed = trainer(tmp_path, Recording(**options), max_steps=2, accumulate_grad_batches=2)
    resumed.fit(tiny_module(), train_dataloaders=loader(), ckpt_path=tmp_path / "step1.ckpt")
    assert evaluated == [2]


def test_callback_fails_at_start_up_without_weights_and_is_off_in_fast_dev_run(tmp_path, files):
    missing = tmp_path / "none" / "inception-2015-12-05.pt"
    callback = FIDCallback(
        reference=str(files["reference"]), every_n_train_steps=1, inception_path=str(missing), **FID_OPTIONS
    )
    module = tiny_module()
    fit = trainer(tmp_path, callback, max_steps=2)
    with pytest.raises(PixditError, match="callbacks.fid.inception_path"):
        fit.fit(module, train_dataloaders=loader())
    assert fit.global_step == 0  # failed before the first training step
    # fast_dev_run (config smoke tests) skips FID entirely: no weights needed.
    quick = trainer(tmp_path, FIDCallback(inception_path=str(missing), **FID_OPTIONS), fast_dev_run=True)
    quick.fit(tiny_module(), train_dataloaders=loader())


def test_callback_reference_defaults_to_the_statistics_next_to_the_data(tmp_path, files):
    class Data(L.LightningDataModule):
        root = tmp_path / "data"

        def train_dataloader(self):
            return loader()

    callback = FIDCallback(every_n_train_steps=0, at_end=True, inception_path=str(files["weights"]), **FID_OPTIONS)
    with pytest.raises(PixditError, match=r"(?s)fid_stats/clean_8.npz does not exist.*make_fid_stats.py --shards"):
        trainer(tmp_path, callback, max_steps=1).fit(tiny_module(), datamodule=Data())


def test_evaluate_script_end_to_end(tmp_path, files):
    module = tiny_module()
    fit = trainer(tmp_path, FIDCallback(every_n_train_steps=0, at_end=False), max_steps=2)
    fit.fit(module, train_dataloaders=loader())
    run_dir = tmp_path / "run"
    fit.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    out_dir = tmp_path / "eval"
    overrides = [
        f"ckpt={run_dir}",
        "num_samples=12",
        "seeds=2",
        "seed=3",
        "sampler.steps=2",
        "sampler.name=heun",
        "cfg_interval=[0.0,0.5]",
        "batch_size=5",
        "device=cpu",
        "grid_samples=4",
        "save_npz=true",
        f"out_dir={out_dir}",
        f"eval.inception_path={files['weights']}",
        f"eval.reference={files['reference']}",
    ]
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "evaluate.py"), *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert [m["sample_indices"] for m in metrics["per_seed"]] == [[0, 12], [12, 24]]  # disjoint seed ranges
    assert metrics["fid"] == pytest.approx(np.mean([m["fid"] for m in metrics["per_seed"]]))
    assert metrics["fid_std_over_seeds"] > 0 and metrics["is_mean"] >= 1.0
    assert metrics["best"]["fid"] == min(m["fid"] for m in metrics["per_seed"])
    assert metrics["best"]["is_mean"] == max(m["is_mean"] for m in metrics["per_seed"])
    settings = metrics["settings"]
    assert settings["weights"] == "ema" and settings["steps"] == 2 and settings["precision"] == "fp32"
    assert settings["sampler"] == "heun" and settings["cfg_interval"] == [0.0, 0.5]
    assert settings["feature_networks"]["metrics"] == ["fid", "is"]
    assert settings["num_samples"] == 12 and settings["seed"] == 3 and settings["global_step"] == 2
    # A checkpoint without an EMA artifact (Lightning's own writer, or a run from before the artifact existed) is
    # read whole, with weights_only=True.
    assert settings["weights_file"] == str((run_dir / "checkpoints" / "last.ckpt").resolve())
    assert settings["reference_id"] == load_reference(str(files["reference"])).id
    # Same numbers as the in-process evaluation of the EMA model (the first seed range).
    direct = evaluate_generator(
        module.ema.model, module.flow, suite(files), image_size=(8, 8), sampler="heun", **FID_OPTIONS
    )
    assert metrics["per_seed"][0]["fid"] == pytest.approx(direct["fid"], rel=1e-4)
    # samples.npz (ADM format): uint8 NHWC, sample i at row i.
    with np.load(out_dir / "samples.npz") as samples:
        images = samples["arr_0"]
    assert images.dtype == np.uint8 and images.shape == (12, 8, 8, 3)
    expected = (
        torch.cat(
            [
                b
                for _, b in generate_uint8(
                    module.ema.model, module.flow, range(12), image_size=(8, 8), seed=3, steps=2, sampler="heun"
                )
            ]
        )
        .permute(0, 2, 3, 1)
        .numpy()
    )
    assert np.abs(images.astype(int) - expected.astype(int)).max() <= 1
    assert (out_dir / "grid.png").is_file() and not (out_dir / "samples_uint8.npy").exists()

    # pixdit's checkpoint writer adds the EMA artifact last.ema.pt; evaluation then reads it (not the whole
    # checkpoint) and gets the same numbers.
    last = run_dir / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(torch.load(last, weights_only=True), last)
    assert (run_dir / "checkpoints" / "last.ema.pt").stat().st_size < last.stat().st_size / 2
    with initialize_config_module(config_module="pixdit.configs.eval", version_base="1.3"):
        cfg = compose("evaluate", overrides=[*overrides, "seeds=1", "save_npz=false", f"out_dir={tmp_path / 'eval2'}"])
    from_artifact = evaluate_cli.evaluate(cfg)
    assert from_artifact["settings"]["weights_file"] == str((run_dir / "checkpoints" / "last.ema.pt").resolve())
    assert from_artifact["settings"]["global_step"] == 2 and from_artifact["settings"]["weights"] == "ema"
    assert from_artifact["fid"] == pytest.approx(metrics["per_seed"][0]["fid"], rel=1e-6)
    # The artifact has no raw weights: use_ema=false on it says where they are.
    with initialize_config_module(config_module="pixdit.configs.eval", version_base="1.3"):
        cfg = compose(
            "evaluate", overrides=[*overrides, f"ckpt={run_dir / 'checkpoints' / 'last.ema.pt'}", "use_ema=false"]
        )
    with pytest.raises(PixditError, match="holds only the EMA weights.*last.ckpt"):
        evaluate_cli.evaluate(cfg)

    # A missing weights file stops the script before any sample is generated, naming the config key.
    with initialize_config_module(config_module="pixdit.configs.eval", version_base="1.3"):
        cfg = compose(
            "evaluate",
            overrides=[
                *overrides[:-2],
                f"eval.inception_path={tmp_path / 'missing.pt'}",
                f"eval.reference={files['reference']}",
            ],
        )
    with pytest.raises(PixditError, match=r"(?s)missing.pt.*nvlabs-fi-cdn.*eval.inception_path"):
        evaluate_cli.evaluate(cfg)


def test_evaluate_script_rejects_a_batch_size_below_one_at_start_up(tmp_path):
    with initialize_config_module(config_module="pixdit.configs.eval", version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"ckpt={tmp_path / 'missing.ckpt'}", "device=cpu", "batch_size=0"])
    with pytest.raises(PixditError, match="batch_size=0 must be a positive int or auto"):
        evaluate_cli.evaluate(cfg)
    # A bad metric name or sampler is named before the checkpoint is even looked for.
    cfg.merge_with({"batch_size": 4, "eval": {"metrics": ["fid", "fud"]}})
    with pytest.raises(PixditError, match="eval.metrics: unknown metric.*fud.*allowed: fid, is, kid, sfid"):
        evaluate_cli.evaluate(cfg)
    cfg.merge_with({"eval": {"metrics": ["fid"]}, "sampler": {"name": "dpm"}})
    with pytest.raises(PixditError, match="sampler='dpm' is not known; allowed: euler, heun"):
        evaluate_cli.evaluate(cfg)


def test_callback_rejects_zero_inception_splits_at_construction():
    with pytest.raises(PixditError, match="callbacks.fid: .*inception_splits >= 1"):
        FIDCallback(inception_splits=0)  # would give IS = nan after the first evaluation, hours into the run
    with pytest.raises(PixditError, match="callbacks.fid.metrics: unknown metric.*'FID'"):
        FIDCallback(metrics=["FID"])
    with pytest.raises(PixditError, match="callbacks.fid.sampler='rk4'.*euler, heun"):
        FIDCallback(sampler="rk4")
    with pytest.raises(PixditError, match="callbacks.fid.cfg_interval"):
        FIDCallback(cfg_interval=[0.9, 0.1])


def test_sample_grid_uses_the_configured_sampler(tmp_path):
    from pixdit.callbacks import SampleGrid

    with pytest.raises(PixditError, match="callbacks.samples.sampler='dpm'"):
        SampleGrid(str(tmp_path), sampler="dpm")
    module = tiny_module()
    grid = SampleGrid(str(tmp_path), every_n_train_steps=0, num_samples=2, steps=2, sampler="heun", at_end=True)
    fit = trainer(tmp_path, grid, max_steps=1)
    calls = []
    original = module.flow.sample

    def recording(*args, **kwargs):
        calls.append(kwargs.get("sampler"))
        return original(*args, **kwargs)

    module.flow.sample = recording
    fit.fit(module, train_dataloaders=loader())
    assert calls == ["heun"] and grid.last_path.is_file()


def test_raw_weights_under_fsdp_are_refused_at_setup(files):
    """Under trainer=fsdp only the EMA copy is whole on every rank: FID of the raw (sharded) weights would hang."""
    from types import SimpleNamespace

    from pixdit.fsdp import FSDPStrategy

    callback = FIDCallback(
        reference=str(files["reference"]),
        every_n_train_steps=2,
        use_ema=False,
        inception_path=str(files["weights"]),
        **FID_OPTIONS,
    )
    fsdp = SimpleNamespace(strategy=FSDPStrategy(), fast_dev_run=False, datamodule=None)
    with pytest.raises(PixditError, match="use_ema=false cannot run under trainer=fsdp"):
        callback.setup(fsdp, tiny_module(), "fit")
