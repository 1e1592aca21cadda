"""train.py end to end on CPU: the quickstart experiment writes a checkpoint and a PNG grid; user mistakes give one
clear message and a non-zero exit, never a traceback.

    .venv/bin/python -m pytest tests/test_train.py
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from pixdit.errors import PixditError


@pytest.fixture
def h(train_helpers):
    """conftest.py's helpers: h.compose(overrides), h.tiny_model, h.tiny_data(root), h.root."""
    return train_helpers


def test_quickstart_smoke_writes_checkpoint_samples_and_metrics(h, tiny_shards, tmp_path):
    from pixdit.cli import train

    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=4),
            *h.tiny_model,
            "model.patch_size=2",
            "trainer.max_steps=4",
            "trainer.val_check_interval=2",
            "trainer.log_every_n_steps=1",
            "callbacks.checkpoint.every_n_train_steps=2",
            "callbacks.samples.every_n_train_steps=2",
            "callbacks.samples.num_samples=4",
            "callbacks.samples.steps=2",
            "callbacks.throughput.window=2",
            "logger=[csv,tensorboard]",
        ]
    )
    result = train.train(cfg, tmp_path)
    assert result["global_step"] == 4
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == [
        "last.ckpt",
        "last.ema.pt",
        "step=2.ckpt",
        "step=2.ema.pt",
        "step=4.ckpt",
        "step=4.ema.pt",
    ], checkpoints
    samples = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert samples == ["step_0000002.png", "step_0000004.png"], samples
    grid = Image.open(tmp_path / "samples" / "step_0000004.png")
    assert grid.size == (2 * 32 + 3 * 2, 2 * 32 + 3 * 2)  # 2x2 grid of 32x32 samples, padding 2

    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    state = checkpoint["state_dict"]
    assert int(state["ema.num_updates"]) == 4 == checkpoint["global_step"]
    assert {"torch", "cuda", "numpy", "python"} <= set(checkpoint["rng_states"])
    assert "ShardDataModule" in checkpoint  # the data position
    assert checkpoint["hyper_parameters"]["model"]["name"] == "DiT-T"

    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v}
    assert {"train/loss", "val/loss", "val/loss_ema", "perf/images_per_s", "perf/tokens_per_s"} <= logged
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))


def _fail_message(capsys, overrides):
    from pixdit.cli import train

    with pytest.raises(SystemExit) as exit_info:
        train.check_overrides(overrides)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_unknown_experiment_lists_choices(capsys):
    err = _fail_message(capsys, ["experiment=ffhq1024_llsa"])
    assert "ffhq1024_llsa" in err and "ffhq256_llsa" in err and "quickstart" in err


def test_unknown_key_lists_keys(capsys):
    err = _fail_message(capsys, ["experiment=quickstart", "trainer.max_step=10"])
    assert "unknown config key 'trainer.max_step'" in err and "max_steps" in err
    err = _fail_message(capsys, ["optimizer.learning_rate=1"])
    assert "optimizer.learning_rate" in err and "lr" in err and "warmup_steps" in err


@pytest.mark.parametrize("name", ["samples", "fid"])
def test_renamed_callback_key_names_the_new_one(capsys, tmp_path, name):
    """every_n_steps became every_n_train_steps (Lightning's word): the old key, on the command line or in a config
    section, is one message naming the new key - also for `fid`, which an unset every_n_train_steps would turn off."""
    from pixdit.callbacks import build_callbacks

    err = _fail_message(capsys, ["experiment=quickstart", f"callbacks.{name}.every_n_steps=100"])
    assert f"callbacks.{name}.every_n_steps was renamed: use callbacks.{name}.every_n_train_steps" in err
    with pytest.raises(
        PixditError,
        match=rf"callbacks.{name}.every_n_steps was renamed: use "
        rf"callbacks.{name}.every_n_train_steps",
    ):
        build_callbacks({name: {"every_n_steps": 100}}, tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+trainer.max_stepz=3"], r"max_stepz.*trainer.*max_steps"),  # no such Trainer argument
        (["data.batch_size=abc"], r"data.batch_size='abc' must be int"),  # a word for a number
        (["seed=abc"], r"seed='abc' must be a non-negative integer"),  # one message, not a TypeError later
        (["model.patch_size=3"], r"32x32.*patch_size=3"),  # names both the image and the patch
        (["ckpt_path=last"], "hydra.run.dir"),  # nothing to resume: how to name the run
        (["model.num_classes=10"], r"model.num_classes=10 .* no class labels"),  # unlabelled data
        (["flow.noise_scale=auto", "+flow.noise_scal=2"], r"noise_scal.*flow"),
        (["compile=fast"], "compile='fast'.*true, false or auto"),
        # settings that ended in a traceback (Lightning's or AdamW's), some of them mid-run, or that ran forever
        (["trainer.max_steps=-1"], r"trainer.max_steps=-1 must be a whole number >= 1.*forever"),
        (["trainer.max_steps=0"], r"trainer.max_steps=0 must be a whole number >= 1"),
        (["trainer.max_steps=-5"], r"trainer.max_steps=-5 must be a whole number >= 1"),
        (["trainer.accumulate_grad_batches=0"], r"trainer.accumulate_grad_batches=0 must be a whole number >= 1"),
        (["trainer.val_check_interval=0"], r"trainer.val_check_interval=0 must be a number of optimizer steps >= 1"),
        (["optimizer.betas=[0.9]"], r"optimizer.betas=\[0.9\] must be two numbers in \[0, 1\)"),
        (["optimizer.lr=-0.1"], r"optimizer.lr=-0.1 must be a number >= 0"),
        (["optimizer.skip_nonfinite_steps=-1"], r"optimizer.skip_nonfinite_steps=-1 must be a whole number >= 0"),
        (["+foo=1"], r"unknown config key\(s\) foo \(added with \+KEY=...\).*Top-level keys: attention"),
        pytest.param(
            ["trainer=gpu"],
            r"trainer.accelerator=gpu .* no CUDA GPU.*trainer=cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU"),
        ),
    ],
)
def test_bad_setting_is_one_named_error(h, tiny_shards, tmp_path, overrides, message):
    """train() turns a bad setting into a PixditError naming the key and what is allowed (train.py prints it)."""
    from pixdit.cli import train

    cfg = h.compose(["experiment=quickstart", "trainer=cpu", *h.tiny_model, *h.tiny_data(tiny_shards), *overrides])
    with pytest.raises(PixditError, match=message):
        train.train(cfg, tmp_path / "run")


@pytest.mark.parametrize(
    "section, options, message",
    [
        ("optimizer", {"lr": "abc"}, r"optimizer.lr='abc' must be float"),
        ("optimizer", {"warmup_stepz": 3}, r"warmup_stepz.*optimizer.*warmup_steps"),
        ("validation", {"seed": "abc"}, r"validation.seed='abc' must be int"),
        ("validation", {"sead": 1}, r"sead.*validation.*seed"),
        ("seed", "abc", r"seed='abc' must be a non-negative integer"),
    ],
)
def test_module_sections_name_bad_values(h, section, options, message):
    """A word for a number in the optimizer / validation sections or the seed is a clear error when the module is
    built, not a TypeError from AdamW at the first step."""
    from pixdit.module import DiffusionModule

    with pytest.raises(PixditError, match=message):
        DiffusionModule(model={"name": "DiT-T", "depth": 1}, image_size=8, **{section: options})


def test_research_command_without_data_is_one_clear_message(h, tmp_path):
    """The README's research command on a machine without FFHQ shards: the path and the prepare command, exit 2."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(
        [sys.executable, str(h.root / "train.py"), "experiment=ffhq256_llsa", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "data/ffhq256" in result.stderr and "prepare_data.py" in result.stderr


def test_init_from_lower_resolution_checkpoint(h, tiny_shards, tmp_path, caplog):
    """The paper's 32 -> 128 progression, in small: a 32-px checkpoint initialises a 16-px Z-order model; the EMA
    weights are loaded (from the EMA artifact next to the checkpoint, or from the checkpoint itself for runs without
    one), EMA/optimizer/step start fresh and the log says so."""
    from pixdit.cli import train
    from pixdit.data.quickstart import make_quickstart_dataset
    from pixdit.module import DiffusionModule

    low = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_model,
            *h.tiny_data(tiny_shards),
            "trainer.max_steps=2",
            "callbacks.samples=null",
        ]
    )
    train.train(low, tmp_path / "low")
    checkpoint_path = tmp_path / "low" / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint_path, weights_only=False)["state_dict"]

    small = {"name": "DiT-T", "hidden_size": 32, "depth": 1, "num_heads": 2, "token_order": "zorder", "patch_size": 2}
    module = DiffusionModule(model=small, image_size=16)
    message = module.init_from(checkpoint_path)
    assert "EMA" in message and "start fresh" in message and "last.ema.pt" in message
    for name, value in module.model.state_dict().items():
        if f"ema.model.{name}" in state:
            assert torch.equal(value, state[f"ema.model.{name}"]), name
    (tmp_path / "low" / "checkpoints" / "last.ema.pt").rename(tmp_path / "artifact.pt")  # a run from before
    from_checkpoint = DiffusionModule(model=small, image_size=16)
    assert "EMA weight tensors from " + str(checkpoint_path) in from_checkpoint.init_from(checkpoint_path)
    for name, value in from_checkpoint.model.state_dict().items():
        assert torch.equal(value, module.model.state_dict()[name]), name
    assert int(module.ema.num_updates) == 0
    assert torch.equal(module.ema.model.final_layer.linear.weight, module.model.final_layer.linear.weight)

    other = tmp_path / "other_data"
    make_quickstart_dataset(other, train_count=4, val_count=2, resolution=16, maxcount=4, seed=1)
    high = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_model,
            *h.tiny_data(other),
            "model.token_order=zorder",
            "trainer.fast_dev_run=1",
            "callbacks.samples=null",
            f"init_from={checkpoint_path}",
        ]
    )
    with caplog.at_level("INFO", logger="pixdit"):
        train.train(high, tmp_path / "high")
    assert any("init_from: loaded" in r.getMessage() for r in caplog.records)

    wrong = DiffusionModule(
        model={"name": "DiT-T", "hidden_size": 64, "depth": 1, "num_heads": 2, "patch_size": 2}, image_size=16
    )
    with pytest.raises(PixditError, match="does not fit this model"):
        wrong.init_from(checkpoint_path)


def test_fid_callback_is_wired_and_checked_at_start(h, tiny_shards, tmp_path):
    """callbacks.fid (configs/callbacks/fid.yaml) is off by default; switched on, its start-up check runs before the
    first step (no Inception weights or reference statistics here -> a PixditError naming the config key)."""
    from pixdit.callbacks import build_callbacks
    from pixdit.cli import train

    cfg = h.compose(["experiment=quickstart", "trainer=cpu", *h.tiny_model, *h.tiny_data(tiny_shards)])
    assert "FIDCallback" not in {type(c).__name__ for c in build_callbacks(cfg.callbacks, tmp_path)}
    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_model,
            *h.tiny_data(tiny_shards),
            "callbacks.fid.at_end=true",
            f"callbacks.fid.cache_dir={tmp_path}/none",
            f"callbacks.fid.inception_path={tmp_path}/none/inception.pt",
        ]
    )
    assert "FIDCallback" in {type(c).__name__ for c in build_callbacks(cfg.callbacks, tmp_path)}
    with pytest.raises(PixditError, match="callbacks.fid"):
        train.train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before training


def test_validation_loss_is_fixed_across_batch_sizes(h, tiny_shards):
    """val/loss uses per-image fixed noise and timesteps: the same number for any validation batch size, and a
    different seed gives a different number (so the noise really is fixed by the seed, not by chance)."""
    import lightning as L

    from pixdit.data.datamodule import ShardDataModule
    from pixdit.module import DiffusionModule

    model = {"name": "DiT-T", "hidden_size": 32, "depth": 1, "num_heads": 2, "zero_init": False}

    def val_loss(val_batch_size, seed=0):
        torch.manual_seed(0)  # same initial weights every time
        module = DiffusionModule(model=model, image_size=32, validation={"seed": seed})
        torch.manual_seed(1234 + val_batch_size)  # global RNG state must not matter
        data = ShardDataModule(
            root=str(tiny_shards), batch_size=2, val_batch_size=val_batch_size, num_workers=0, val_images=8
        )
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        return trainer.validate(module, datamodule=data, verbose=False)[0]

    a, b, c = val_loss(2), val_loss(8), val_loss(3)
    for key in ("val/loss", "val/loss_ema"):
        assert abs(a[key] - b[key]) < 1e-6 and abs(a[key] - c[key]) < 1e-6, (key, a, b, c)
    assert abs(val_loss(2, seed=1)["val/loss"] - a["val/loss"]) > 1e-4


@pytest.mark.parametrize("warmup_steps", [0, 1, 4])
def test_lr_warmup_is_linear_then_constant(warmup_steps):
    """optimizer.warmup_steps=W: lr * (step + 1) / W for the first W optimizer steps, then lr (LinearLR)."""
    from pixdit.module import DiffusionModule

    module = DiffusionModule(
        model={"name": "DiT-T", "depth": 1}, image_size=8, optimizer={"lr": 1e-3, "warmup_steps": warmup_steps}
    )
    optimizers = module.configure_optimizers()
    optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [1e-3 * min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1e-3 for step in range(6)]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_bench_train_script_runs_on_cpu(h, capsys, tmp_path):
    """scripts/bench_train.py's CPU check (the GPU numbers are in docs/benchmarks.md): several attention variants in
    one run, speed-ups over full attention, a skipped (size, variant), the md/json/png files, --profile, --plot-from."""
    import json
    import runpy

    bench = runpy.run_path(str(h.root / "scripts" / "bench_train.py"))
    out_dir = tmp_path / "bench"
    bench["main"](
        [
            "--device",
            "cpu",
            "--quick",
            "--attention",
            "full",
            "llsa",
            "llsa:num_levels=3",
            "--profile",
            "--out",
            str(out_dir),
        ]
    )
    out = capsys.readouterr().out
    assert "| model | params M | grad ckpt | size | tokens/img | tokens/step | batch | variant |" in out
    assert "| peak GB | est. GB | MFU % | speed-up | note |" in out
    assert "| 16x16 | 256 | 2,048 | 8 | full |" in out and "| 32x32 | 1,024 | 2,048 | 2 | llsa |" in out
    assert "## profile: one training step of DiT-S llsa at 32x32, batch 2" in out and "step/backward" in out
    assert "CPU time by phase (median of 3 steps, wall clock):" in out and "| backward |" in out and "| ema |" in out
    assert "CPU time by kind of kernel:" in out and "| matmul |" in out
    assert (out_dir / "bench_train.md").read_text().count("| 32x32 |") == 3
    assert (out_dir / "bench_train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = {(r["side"], r["variant"]): r for r in json.loads((out_dir / "bench_train.json").read_text())["rows"]}
    assert len(rows) == 6
    for side in (16, 32):
        full, llsa, llsa_3 = rows[side, "full"], rows[side, "llsa"], rows[side, "llsa:num_levels=3"]
        assert full["status"] == llsa["status"] == "ok" and full["speedup"] == 1.0
        assert llsa["speedup"] == pytest.approx(full["ms_per_step"] / llsa["ms_per_step"])
        assert llsa["tokens_per_s"] == pytest.approx(2048 / (llsa["ms_per_step"] / 1000))
        # 16^3 = 4096 does not divide 256 or 1024 tokens: a row with the model's reason, not a crash
        assert llsa_3["status"] == "skipped" and "multiple of block_size**num_levels = 4096" in llsa_3["note"]
        phases = {p["phase"]: p for p in llsa["profile"]["phases"]}
        assert set(phases) == {"forward+loss", "backward", "clip", "optimizer", "ema"}
        assert all(p["ms"] > 0 for p in phases.values()) and phases["backward"]["ms"] > phases["clip"]["ms"]
        assert sum(p["share %"] for p in phases.values()) == pytest.approx(100)
        assert sum(k["share %"] for k in llsa["profile"]["kernels"]) == pytest.approx(100)
    assert "skipped: attention=llsa cannot handle a 16x16 token grid" in out

    (out_dir / "bench_train.png").unlink()
    bench["main"](["--plot-from", str(out_dir / "bench_train.json")])
    assert (out_dir / "bench_train.png").is_file()
    # an option the backend does not take stops the run before anything is timed, naming the variant and the key
    with pytest.raises(SystemExit, match="--attention llsa:topk=4,blocksize=8: unknown key.*blocksize"):
        bench["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa:topk=4,blocksize=8"])


def load_bench_train(h, monkeypatch):
    """scripts/bench_train.py as a module whose functions a test can replace."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", h.root / "scripts" / "bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_train", bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_bench_train_memory_budget(h, monkeypatch):
    """--memory-budget: checked before anything runs (it needs --compile and a fraction in (0, 1]), then set as the
    partitioner's budget for the compiled step and named in the settings line."""
    import torch._functorch.config

    bench = load_bench_train(h, monkeypatch)
    with pytest.raises(SystemExit, match="--memory-budget applies to the compiled step: add --compile"):
        bench.main(["--device", "cpu", "--quick", "--memory-budget", "0.9"])
    with pytest.raises(SystemExit, match=r"--memory-budget=1.5 must be a number in \(0, 1\]"):
        bench.main(["--device", "cpu", "--quick", "--compile", "--memory-budget", "1.5"])
    seen = {}

    def fake_run(args, *rest, **options):
        seen["budget"] = torch._functorch.config.activation_memory_budget
        seen["settings"] = bench.settings_line(args, [bench.parse_model("DiT-S")], [False])
        return []

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "markdown", lambda rows: "")
    with torch._functorch.config.patch(activation_memory_budget=1.0):  # the setting is process-wide: restored after
        bench.main(["--device", "cpu", "--quick", "--compile", "--memory-budget", "0.7"])
    assert seen["budget"] == 0.7 and "compile=True, activation memory budget 0.7," in seen["settings"]


def test_bench_train_means_both_is_an_ab_of_the_block_means_switch(h, monkeypatch):
    """--means both: a backend with block means (LLSA) runs twice, with the prologue's means and pooling them itself
    (its label says so), one without (full) once; the class switch is set for each row and restored."""
    from pixdit.models.dit import Attention

    bench = load_bench_train(h, monkeypatch)
    seen = []

    def fake_run_row(args, model, side, grad_checkpointing, variant, warmup, steps):
        seen.append((variant.label, Attention.fuse_block_means))
        return {
            "model": "m",
            "side": side,
            "grad_ckpt": "false",
            "variant": variant.label,
            "status": "skipped",
            "note": "",
        }

    monkeypatch.setattr(bench, "run_row", fake_run_row)
    monkeypatch.setattr(bench, "markdown", lambda rows: "")
    args = bench.parse_args(["--device", "cpu", "--sizes", "16", "--attention", "full", "llsa", "--means", "both"])
    variants = [bench.parse_variant(spec) for spec in args.attention]
    rows = bench.run(args, [bench.parse_model("DiT-S")], variants, [False])
    assert seen == [("full", True), ("llsa", True), ("llsa", False)] and Attention.fuse_block_means is True
    assert [r["variant"] for r in rows] == ["full", "llsa", "llsa (means in backend)"]


def test_bench_train_flops_count_the_attended_tokens(h, monkeypatch):
    """MFU's model FLOPs: 6 x the per-token parameters (not the adaLN / embedders, which run once per image) x tokens
    + 3 x 4 x tokens x keys per query x hidden per block, with the backend's own keys per query: a sparse backend is
    not charged dense attention."""
    from pixdit.models import build_model

    bench = load_bench_train(h, monkeypatch)
    n, d = 64 * 64, 64
    for attention, keys in (({"name": "full"}, n), ({"name": "llsa", "num_levels": 2, "topk": 8}, 272)):
        model = build_model(
            "DiT-T", input_size=64, depth=2, hidden_size=d, num_heads=2, num_classes=10, attention=attention
        )
        per_token = sum(
            p.numel() for block in model.blocks for part in (block.attn, block.mlp) for p in part.parameters()
        )
        per_token += sum(p.numel() for p in [*model.x_embedder.parameters(), *model.final_layer.linear.parameters()])
        expected = 6 * per_token * n + 2 * 12 * n * keys * d
        assert bench.training_flops_per_image(model, n) == expected


def test_bench_train_table_mode_and_the_largest_batch_that_fits(h, capsys, tmp_path, monkeypatch):
    """--models and --grad-checkpointing give one row each; a row whose batch runs out of memory halves it until it
    fits and says so, and at batch 1 is an OOM row; settings are checked against every model first."""
    import json

    bench = load_bench_train(h, monkeypatch)
    measure = bench.measure

    def out_of_memory_above_2(args, side, batch, config, label, warmup, steps):
        if batch > 2 and config["model"]["name"] == "DiT-B" or config["model"]["grad_checkpointing"] == "mlp":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return measure(args, side, batch, config, label, warmup, steps)

    monkeypatch.setattr(bench, "measure", out_of_memory_above_2)
    bench.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--models",
            "DiT-S",
            "DiT-B",
            "--attention",
            "full",
            "--grad-checkpointing",
            "true",
            "mlp",
            "--sizes",
            "16",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert [(r["model"], r["grad_ckpt"], r["status"], r["batch"]) for r in rows] == [
        ("DiT-S (quick)", "true", "ok", 8),
        ("DiT-S (quick)", "mlp", "OOM", 1),
        ("DiT-B (quick)", "true", "ok", 2),
        ("DiT-B (quick)", "mlp", "OOM", 1),
    ]
    assert rows[2]["note"] == "largest batch that fits: 2 of 8 (OOM at batch 8; OOM at batch 4)"
    assert rows[1]["note"].startswith("CUDA out of memory at batch 1; OOM at batch 8; OOM at batch 4; OOM at batch 2")
    assert rows[0]["mfu_percent"] > 0 and rows[0]["est_gb"]
    # several models: the model-size figure (tokens/s and MFU against parameters), also redrawn from two JSON files
    assert (tmp_path / "bench_train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench.main(
        [
            "--plot-from",
            str(tmp_path / "bench_train.json"),
            str(tmp_path / "bench_train.json"),
            "--out",
            str(tmp_path / "re"),
        ]
    )
    assert (tmp_path / "re" / "bench_train.png").is_file()
    with pytest.raises(SystemExit, match="model.grad_checkpointing=5 is out of range"):
        bench.main(["--device", "cpu", "--quick", "--grad-checkpointing", "5"])  # the quick model has 2 blocks


def test_bench_train_after_an_oom_tries_the_high_estimates_batch(h, monkeypatch):
    """With --compile the first batch is the largest that fits halfway between the estimate's bounds; an
    out-of-memory error then tries the largest batch the high bound allows (not half), and only after that halves."""
    import pixdit.memory

    bench = load_bench_train(h, monkeypatch)
    args = bench.parse_args(["--device", "cpu", "--quick", "--compile"])
    args.tokens_per_step = 16 * 16 * 8  # 8 images of 16x16
    model, variant = bench.parse_model("DiT-S"), bench.parse_variant("full")
    config = bench.module_config(args, model, variant, False)
    estimate = bench.memory_estimate(args, 16, 8, config)
    low_image, high_image = estimate.bytes_per_image
    mid_image = (low_image + high_image) / 2
    free = (estimate.low + estimate.high) / 2 - 4 * mid_image + 1  # halfway, 4 of the 8 images fit
    high_fits = pixdit.memory.largest_batch(estimate, free, "high")
    assert pixdit.memory.largest_batch(estimate, free, "mid") == 4 and 1 < high_fits < 4
    monkeypatch.setattr(pixdit.memory, "free_memory", lambda device: free)
    tried = []

    def fake_measure(args, side, batch, config, label, warmup, steps):
        tried.append(batch)
        if batch > high_fits - 1:  # even the high estimate's batch is one too many: then halving takes over
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"ms_per_step": 1.0}

    monkeypatch.setattr(bench, "measure", fake_measure)
    row = bench.run_row(args, model, 16, False, variant, 1, 1)
    assert tried == [4, high_fits, high_fits // 2]
    assert row["status"] == "ok" and row["batch"] == high_fits // 2
    assert row["note"].startswith(f"largest batch that fits: {high_fits // 2} of 8 (2,048 tokens/step do not fit")
    assert row["note"].endswith(f"; OOM at batch 4; OOM at batch {high_fits})")


def test_loggers(h, tmp_path):
    """logger=[csv,tensorboard] both write into the run directory; logger=wandb without the package says how to get
    it; an unknown logger option is named."""
    import importlib.util

    from pixdit.cli import train

    loggers = train.build_loggers(h.compose(["logger=[csv,tensorboard]"]).logger, tmp_path)
    assert [type(x).__name__ for x in loggers] == ["CSVLogger", "TensorBoardLogger"]
    assert Path(loggers[0].log_dir) == tmp_path and Path(loggers[1].log_dir) == tmp_path / "tensorboard"
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(PixditError, match="pip install wandb"):
            train.build_loggers(h.compose(["logger=wandb"]).logger, tmp_path)
    with pytest.raises(PixditError, match="flush_every.*logger.csv"):
        train.build_loggers(h.compose(["+logger.csv.flush_every=3"]).logger, tmp_path)
    with pytest.raises(PixditError, match="logger 'mlflow' is not known; available: csv, tensorboard, wandb"):
        train.build_loggers({"mlflow": {}}, tmp_path)


def test_callbacks_from_the_table(h, tmp_path):
    """callbacks.* keys name classes of pixdit.callbacks.CALLBACKS, built in the table's order with pixdit's run
    directory; an unknown name or option is a named error."""
    from pixdit.callbacks import build_callbacks

    callbacks = build_callbacks(h.compose(["callbacks.checkpoint.save_top_k=0"]).callbacks, tmp_path)
    assert [type(c).__name__ for c in callbacks] == ["PerfMonitor", "StepCheckpoint", "SampleGrid", "TQDMProgressBar"]
    assert callbacks[1].dirpath == str(tmp_path / "checkpoints") and callbacks[1].save_top_k == 0
    assert callbacks[1].save_last and callbacks[2].dirpath == tmp_path / "samples"
    with pytest.raises(PixditError, match=r"unknown callbacks \['ema_swap'\]; allowed: .*'throughput'"):
        build_callbacks({"ema_swap": {}}, tmp_path)
    with pytest.raises(PixditError, match="windo.*callbacks.throughput.*window"):
        build_callbacks({"throughput": {"windo": 3}}, tmp_path)


def test_vsa_annealing_follows_the_optimizer_step(h, tiny_shards, tmp_path):
    """The training loop drives VSA's dense-to-sparse schedule: the backends see global_step, and it is checkpointed."""
    from pixdit.cli import train

    cfg = h.compose(
        [
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=2),
            *h.tiny_model,
            "attention=vsa",
            "model.token_order=zorder",
            "attention.topk=1",
            "attention.anneal_every=1",
            "attention.anneal_rate=0.5",
            "trainer.max_steps=3",
            "trainer.limit_val_batches=0",
            "callbacks.samples.every_n_train_steps=0",
        ]
    )
    result = train.train(cfg, tmp_path)
    assert result["global_step"] == 3
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    steps = {k: int(v) for k, v in state.items() if k.endswith("attn.backend.training_step")}
    assert steps and set(steps.values()) == {2}, steps  # set before the third (last) optimizer step


def test_throughput_window_counts_optimizer_steps(h, tiny_shards, tmp_path, monkeypatch):
    """callbacks.throughput.window is in optimizer steps: with 2 micro-batches of 4 images per step and window=2, a
    window holds 16 images. A clock that advances 1 s per reading makes images_per_s = images in the window."""
    import itertools
    from types import SimpleNamespace

    import pixdit.callbacks
    from pixdit.cli import train

    clock = itertools.count()
    monkeypatch.setattr(pixdit.callbacks, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=4),
            *h.tiny_model,
            "model.patch_size=2",
            "trainer.max_steps=4",
            "trainer.accumulate_grad_batches=2",
            "trainer.val_check_interval=100",
            "trainer.log_every_n_steps=2",
            "callbacks.throughput.window=2",
            "callbacks.samples=null",
            "callbacks.checkpoint=null",
            "callbacks.progress_bar=null",
        ]
    )
    train.train(cfg, tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        rates = [float(row["perf/images_per_s"]) for row in csv.DictReader(f) if row.get("perf/images_per_s")]
    assert rates == [16.0, 16.0], rates


def test_throughput_window_excludes_sampling(h, tiny_shards, tmp_path, monkeypatch):
    """A sample grid written at the step a window ends is not training time: with a clock that advances 1 s per
    reading and 100 s per sample grid, every window still reports its images per 1 s."""
    import itertools
    from types import SimpleNamespace

    import pixdit.callbacks
    from pixdit.cli import train

    clock = itertools.count()
    monkeypatch.setattr(pixdit.callbacks, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    write = pixdit.callbacks.SampleGrid.write

    def slow_write(self, trainer, pl_module):  # the real write, plus 100 s on the fake clock
        for _ in range(100):
            next(clock)
        return write(self, trainer, pl_module)

    monkeypatch.setattr(pixdit.callbacks.SampleGrid, "write", slow_write)
    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=4),
            *h.tiny_model,
            "model.patch_size=2",
            "trainer.max_steps=4",
            "trainer.val_check_interval=100",
            "trainer.log_every_n_steps=2",
            "callbacks.throughput.window=2",
            "callbacks.samples.every_n_train_steps=2",
            "callbacks.samples.num_samples=1",
            "callbacks.samples.steps=1",
            "+callbacks.samples.at_end=false",
            "callbacks.checkpoint=null",
            "callbacks.progress_bar=null",
        ]
    )
    train.train(cfg, tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        rates = [float(row["perf/images_per_s"]) for row in csv.DictReader(f) if row.get("perf/images_per_s")]
    assert rates == [8.0, 8.0], rates


def test_final_step_is_checkpointed_when_the_interval_does_not_divide_max_steps(h, tiny_shards, tmp_path):
    """max_steps=5 with a checkpoint every 2 steps: last.ckpt must hold step 5 (it held step 4: the last step's
    training was lost, and result["checkpoint"] pointed at an older model than the one that was sampled)."""
    from pixdit.cli import train

    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=4),
            *h.tiny_model,
            "model.patch_size=2",
            "trainer.max_steps=5",
            "trainer.val_check_interval=2",
            "callbacks.checkpoint.every_n_train_steps=2",
            "callbacks.samples=null",
            "callbacks.progress_bar=null",
        ]
    )
    result = train.train(cfg, tmp_path)
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert [c for c in checkpoints if c.endswith(".ckpt")] == [
        "last.ckpt",
        "step=2.ckpt",
        "step=4.ckpt",
        "step=5.ckpt",
    ], checkpoints
    assert len(checkpoints) == 8 and torch.load(tmp_path / "checkpoints" / "last.ema.pt")["global_step"] == 5
    last = torch.load(result["checkpoint"], weights_only=False)
    assert last["global_step"] == 5 and int(last["state_dict"]["ema.num_updates"]) == 5
    # ... and validated: the "final" validation loss (sweep summaries, bench_scaling) is the last step's, not step 4's
    with open(tmp_path / "metrics.csv") as f:
        val_steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert val_steps[-1] == 5 and len(val_steps) == len(set(val_steps)), val_steps


def test_fused_adamw_with_bf16_autocast_clips_gradients(h, tiny_shards, tmp_path):
    """The GPU recipe (bf16-mixed, fused AdamW, gradient_clip_val=1.0) on the CPU: Lightning's AMP plugin refuses to
    clip for a fused optimizer (it assumes an fp16 GradScaler); bf16 has none, so the module clips itself. The
    clipped step must equal an unfused AdamW's step on the same clipped gradients."""
    from pixdit.cli import train

    results = {}
    for fused in (True, False):
        cfg = h.compose(
            [
                "trainer=cpu",
                "trainer.precision=bf16-mixed",
                f"optimizer.fused={fused}",
                "trainer.gradient_clip_val=1e-3",
                *h.tiny_data(tiny_shards, batch_size=2),
                *h.tiny_model,
                "trainer.max_steps=2",
                "trainer.limit_val_batches=0",
                "callbacks.samples.every_n_train_steps=0",
            ]
        )
        out = tmp_path / f"fused_{fused}"
        assert train.train(cfg, out)["global_step"] == 2
        results[fused] = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, value in results[True].items():
        torch.testing.assert_close(value, results[False][name], rtol=1e-5, atol=1e-6, msg=name)


def test_compile_memory_budget_is_checked_set_and_warned_about(h, tiny_shards, tmp_path, caplog):
    """compile_memory_budget: a number in (0, 1] or one error naming the key; set for the compiled step's partitioner;
    a warning where nothing is compiled; the sweep's pre-flight check refuses a bad value before any run starts."""
    import torch._functorch.config

    from pixdit.cli import train
    from pixdit.sweep import check_run_config

    base = ["experiment=quickstart", "trainer=cpu", *h.tiny_model, *h.tiny_data(tiny_shards), "trainer.max_steps=1"]
    for bad in ("0", "1.5", "abc", "true"):
        cfg = h.compose([*base, f"compile_memory_budget={bad}"])
        with pytest.raises(PixditError, match=r"compile_memory_budget=.* must be a number in \(0, 1\]"):
            train.train(cfg, tmp_path / f"bad{bad}")
        with pytest.raises(PixditError, match=r"compile_memory_budget=.* must be a number in \(0, 1\]"):
            check_run_config(cfg)
    with torch._functorch.config.patch(activation_memory_budget=1.0), caplog.at_level("WARNING", logger="pixdit"):
        train.train(h.compose([*base, "compile_memory_budget=0.8"]), tmp_path / "run")
        assert torch._functorch.config.activation_memory_budget == 0.8
    assert "compile_memory_budget=0.8 has no effect: the model is not compiled" in caplog.text


def test_compile_option():
    from pixdit.runtime import resolve_compile

    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "gpu") is False
    assert resolve_compile("auto", "cpu") is False  # never compiles for a CPU trainer or device
    assert resolve_compile("auto", "auto") is torch.cuda.is_available()
    assert resolve_compile("auto", "cuda") is torch.cuda.is_available()
    with pytest.raises(PixditError, match="compile='yes' is not allowed"):
        resolve_compile("yes", "cuda")


def test_dense_blocks_schedule_trains_and_travels_with_the_checkpoint(h, tiny_shards, tmp_path):
    """attention.dense_blocks on the command line: shown in the composed config, a short LLSA run with dense first and
    last blocks trains, and its EMA artifact rebuilds the same per-block schedule; a bad index stops the run before
    anything is written."""
    from omegaconf import OmegaConf

    from pixdit.cli import train
    from pixdit.module import load_generator

    base = [
        "experiment=quickstart",
        "trainer=cpu",
        *h.tiny_data(tiny_shards),
        "model=dit_t",
        "+model.hidden_size=32",
        "+model.depth=3",
        "+model.num_heads=2",
        "attention=llsa",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=0",
        "callbacks.samples=null",
    ]
    assert "dense_blocks: []" in OmegaConf.to_yaml(h.compose(base).attention)  # the default is visible
    cfg = h.compose([*base, "attention.dense_blocks=[0,2]"])
    assert list(cfg.attention.dense_blocks) == [0, 2]
    assert train.train(cfg, tmp_path / "run")["global_step"] == 2
    model, _, weights = load_generator(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert weights.path.name == "last.ema.pt"
    assert [block.attn.backend.name for block in model.blocks] == ["full", "llsa", "full"]

    with pytest.raises(PixditError, match=r"attention.dense_blocks=\[0, 3\]: 3 is not a block index.*depth 3"):
        train.train(h.compose([*base, "attention.dense_blocks=[0,3]"]), tmp_path / "bad")
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_memory_check_before_the_first_step_and_out_of_memory_advice(h, tiny_shards, tmp_path, monkeypatch):
    """train.py compares the memory estimate (pixdit.memory) with the device's free memory before any step, and turns
    an out-of-memory error in a step into the same advice; both are one PixditError naming the knobs."""
    import pixdit.memory
    from pixdit.cli import train
    from pixdit.module import DiffusionModule

    cfg = h.compose(
        [
            "experiment=quickstart",
            "trainer=cpu",
            *h.tiny_data(tiny_shards, batch_size=4),
            *h.tiny_model,
            "trainer.max_steps=2",
            "callbacks.samples=null",
        ]
    )
    monkeypatch.setattr(pixdit.memory, "free_memory", lambda device: 1024.0)  # a device with 1 KiB free
    with pytest.raises(PixditError, match="does not fit") as error:
        train.train(cfg, tmp_path / "too_big")
    assert "data.batch_size=1 (now 4" in str(error.value) and "model.grad_checkpointing=true" in str(error.value)
    assert not (tmp_path / "too_big" / "checkpoints").exists()  # refused before the first step

    monkeypatch.undo()

    def out_of_memory(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(DiffusionModule, "training_step", out_of_memory)
    with pytest.raises(PixditError, match=r"ran out of GPU memory at step 0 \(CUDA out of memory\)") as error:
        train.train(cfg, tmp_path / "oom")
    assert "data.batch_size=2 (now 4" in str(error.value) and "trainer=fsdp" in str(error.value)


def test_bench_train_kernel_table_sorts_pixdit_kernels_by_kind(h, monkeypatch):
    """--profile's kind-of-kernel table: each pixdit kernel lands in its own row (qk_norm_rope's Triton kernels by
    their real names, which also contain "_fwd_kernel"; Inductor's block means although their names contain
    "topk_select"), CPU-side ops are not counted twice, the rest is "other"."""
    import importlib
    from types import SimpleNamespace

    bench = load_bench_train(h, monkeypatch)
    norm_rope_kernels = ["_qk_norm_rope_fwd_kernel", "_qk_norm_rope_bwd_kernel"]
    module = importlib.import_module("pixdit.kernels.qk_norm_rope")  # the package exports a function of that name
    assert all(hasattr(module, name) for name in norm_rope_kernels)  # the names the profiler will show
    events = [
        (norm_rope_kernels[0], "CUDA", 4000),
        (norm_rope_kernels[1], "CUDA", 6000),
        ("_QKNormRope", "CPU", 9000),  # the autograd op that launched the kernel: not device time
        ("_dkdv_kernel", "CUDA", 3000),
        ("_pooled_topk_kernel", "CUDA", 1000),
        ("triton_per_fused_mean_pooled_topk_select_view_13", "CUDA", 700),  # Inductor's pooled q/k/v, not selection
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float, float>>>", "CUDA", 300),
        ("triton_poi_fused_gelu_0", "CUDA", 2000),
        ("nvjet_sm90_tst_192x192", "CUDA", 5000),
        ("void at::native::reduce_kernel<...>", "CUDA", 500),
    ]
    prof = SimpleNamespace(
        key_averages=lambda **_: [
            SimpleNamespace(key=k, device_type=f"DeviceType.{t}", self_device_time_total=us) for k, t, us in events
        ]
    )
    rows = {row["part"]: row["ms"] for row in bench.kernel_table(prof, cuda=True)}
    assert rows == {
        "qk-norm + RoPE": 10.0,
        "matmul": 5.0,
        "sparse attention (pixdit.kernels)": 3.0,
        "Inductor fused elementwise": 2.0,
        "block selection (top-k)": 1.0,
        "block means (pooling)": 1.0,
        "other": 0.5,
    }


def test_every_pixdit_kernel_has_a_kind_in_the_kernel_table():
    """Each Triton kernel of pixdit.kernels (the names the profiler shows) lands in a named row of the kind-of-kernel
    table, not in "other"; found by walking the package, so a new kernel without a row fails here."""
    import importlib
    import pkgutil
    import re

    import pixdit.kernels
    from pixdit.report import KERNEL_CATEGORIES

    names = set()
    for info in pkgutil.iter_modules(pixdit.kernels.__path__):
        module = importlib.import_module(f"pixdit.kernels.{info.name}")
        names |= {name for name, obj in vars(module).items() if name.endswith("_kernel") and hasattr(obj, "fn")}
    assert {"_block_means_kernel", "_row_topk_kernel", "_sla_fwd_kernel", "_joint_bwd_kernel"} <= names
    kinds = {name: next((g for g, p in KERNEL_CATEGORIES if re.search(p, name)), "other") for name in names}
    assert [name for name, kind in kinds.items() if kind == "other"] == []
    assert kinds["_block_means_kernel"] == kinds["_next_level_kernel"] == "block means (pooling)"
    assert kinds["_rescore_kernel"].startswith("block sel")
    assert kinds["_combine_bwd_kernel"] == kinds["_sum_slots_kernel"] == "sparse attention (pixdit.kernels)"


def test_bandwidth_table_ranks_inductor_kernels_by_time_lost(monkeypatch, tmp_path):
    """--compile --profile's bandwidth table: byte estimates read from the output code Inductor writes under the
    directory ``enable_inductor_kernel_bytes`` gives it (two graphs' kernels of one name with different estimates get
    none), joined with the profiled calls by name; floor = GB / 4 TB/s."""
    from types import SimpleNamespace

    import torch._inductor.config as inductor_config

    from pixdit.report import (
        bandwidth_markdown,
        bandwidth_report,
        bandwidth_table,
        enable_inductor_kernel_bytes,
        inductor_kernel_gb,
    )

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "old"))  # both restored after the test
    monkeypatch.setattr(inductor_config, "benchmark_kernel", False)
    directory = enable_inductor_kernel_bytes()
    assert inductor_config.benchmark_kernel and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory)
    assert directory.is_dir() and not any(directory.iterdir())

    def kernel(name, gb):  # how Inductor's output code holds a kernel, with config.benchmark_kernel on
        meta = f"{{'grid_type': 'Grid1D', 'kernel_name': '{name}', 'num_load': 1, 'kernel_num_gb': {gb}, 'kernel_flop': 0}}"
        return f"{name} = async_compile.triton('{name}', '''\n@triton_heuristics.pointwise(\n    inductor_meta={meta},\n)\n''')\n"

    graphs = {
        "forward.py": kernel("triton_poi_fused_gelu_0", 1.6) + kernel("triton_red_fused_layer_norm_1", 0.4),
        "backward.py": kernel("triton_poi_fused_add_2", 0.2) + kernel("triton_poi_fused_stack_3", 1.024e-06),
        "backward2.py": kernel("triton_poi_fused_add_2", 0.3),  # another graph's kernel of the same name
    }
    for file, source in graphs.items():  # as Inductor writes output code under its cache directory
        (tmp_path / "ab" / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ab" / file).write_text(source)
    (tmp_path / "ab" / "notes.txt").write_text(kernel("triton_poi_fused_other_9", 5.0))  # not a .py file
    kernel_gb = inductor_kernel_gb(tmp_path)
    assert kernel_gb == {
        "triton_poi_fused_gelu_0": 1.6,
        "triton_red_fused_layer_norm_1": 0.4,
        "triton_poi_fused_add_2": None,
        "triton_poi_fused_stack_3": 1.024e-06,
    }
    assert inductor_kernel_gb([graphs["forward.py"]]) == {
        "triton_poi_fused_gelu_0": 1.6,
        "triton_red_fused_layer_norm_1": 0.4,
    }

    events = [  # name, device, calls, self microseconds
        ("triton_poi_fused_gelu_0", "CUDA", 12, 4800),  # 19.2 GB in 4.8 ms: at the floor
        ("triton_red_fused_layer_norm_1", "CUDA", 12, 2400),  # 4.8 GB in 2.4 ms: 1.2 ms lost
        ("triton_red_fused_layer_norm_1", "CPU", 12, 9000),  # the launch on the host: not device time
        ("triton_poi_fused_add_2", "CUDA", 24, 500),
        ("nvjet_sm90_tst_192x192", "CUDA", 24, 9000),  # not Inductor's
    ]
    prof = SimpleNamespace(
        key_averages=lambda **_: [
            SimpleNamespace(key=k, device_type=f"DeviceType.{t}", count=n, self_device_time_total=us)
            for k, t, n, us in events
        ]
    )
    rows = bandwidth_table(prof, kernel_gb, peak_tbs=4.0)
    assert [row["kernel"] for row in rows] == [
        "triton_red_fused_layer_norm_1",
        "triton_poi_fused_add_2",  # no byte count: ranked by its time
        "triton_poi_fused_gelu_0",
    ]
    norm = rows[0]
    assert norm["calls"] == 12 and norm["ms"] == pytest.approx(2.4) and norm["GB"] == pytest.approx(4.8)
    assert norm["floor ms"] == pytest.approx(1.2) and norm["lost ms"] == pytest.approx(1.2)
    assert rows[2]["GB/s"] == pytest.approx(4000) and rows[2]["lost ms"] == pytest.approx(0)
    assert "GB" not in rows[1]
    summary = bandwidth_markdown(rows, top=2)
    assert summary.count("| triton_") == 2 and "| triton_poi_fused_add_2 | 24 | 0.500 | ? |" in summary
    assert "3 Inductor kernels, 7.700 ms, 24.000 GB" in summary and "lost 1.200 ms" in summary
    assert "1 kernels without one byte count" in summary
    # what the scripts call: the table with the estimates under the directory, titled; nothing without them
    report_rows, text = bandwidth_report(prof, tmp_path, top=2)
    assert report_rows == rows and text.startswith("Inductor's kernels, most time lost") and summary in text
    assert bandwidth_report(prof, None) == ([], "")
