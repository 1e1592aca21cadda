"""Faults of a long training run (docs/reliability.md, "Training runs"): divergence, moved, shared and reused run
directories, SIGTERM and Ctrl-C, damaged checkpoints, and settings that ended in a traceback. Each test failed before
the behaviour it checks was added.

The runs are the tiny quickstart model on 16 + 8 crops (conftest.py): a step takes milliseconds, a subprocess run of
train.py a few seconds (Python and torch start-up).

    .venv/bin/python -m pytest tests/test_run_faults.py
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from pixdit.errors import PixditError

REPO = Path(__file__).resolve().parents[1]
QUIET = ["callbacks.samples=null", "callbacks.progress_bar=null", "trainer.enable_model_summary=false"]


@pytest.fixture
def h(train_helpers):
    """conftest.py's helpers: h.compose(overrides), h.tiny_model, h.tiny_data(root), h.root."""
    return train_helpers


def overrides(h, shards, *extra: str) -> list[str]:
    return [
        "experiment=quickstart",
        "trainer=cpu",
        *h.tiny_model,
        *h.tiny_data(shards, batch_size=4),
        *QUIET,
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=100",
        *extra,
    ]


def train(h, shards, run_dir, *extra: str) -> dict:
    from pixdit.cli import train as train_cli

    return train_cli.train(h.compose(overrides(h, shards, *extra)), run_dir)


def train_py(h, shards, *extra: str, cwd: Path, **popen) -> subprocess.CompletedProcess | subprocess.Popen:
    """train.py as a user runs it (Hydra, the run directory's lock, status.json, exit status)."""
    command = [sys.executable, str(REPO / "train.py"), *overrides(h, shards, *extra)]
    if popen:
        return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(v).all() for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, train_helpers, tiny_shards) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(train_helpers, tiny_shards, run_dir, "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=2")
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


# ------------------------------------------------------------------------------------------ 1: divergence
def test_divergence_stops_the_run_before_nan_reaches_a_checkpoint(h, tiny_shards, tmp_path):
    """lr=1e3: the loss explodes within a few steps. The run stops with one message (exit 2, status.json "failed")
    naming the step, the quantity and the last good checkpoint; every checkpoint and EMA artifact on disk is finite;
    the gradient norm is logged."""
    run_dir = tmp_path / "run"
    result = train_py(
        h,
        tiny_shards,
        "trainer.max_steps=12",
        "optimizer.lr=1e3",
        "optimizer.warmup_steps=0",
        "callbacks.checkpoint.every_n_train_steps=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert "training diverged at step" in message and "is NaN or inf" in message and "optimizer.lr" in message
    step = int(message.split("training diverged at step ")[1].split(":")[0])
    assert status(run_dir)["status"] == "failed" and "diverged" in status(run_dir)["error"]
    files = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    last_good = max(int(name[5:-5]) for name in files if name.startswith("step=") and name.endswith(".ckpt"))
    assert last_good <= step < 12 and f"step={last_good}.ckpt (step {last_good})" in message
    for name in files:
        state = load(run_dir / "checkpoints" / name)["state_dict"]
        assert all_finite(state), name
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == last_good
    with open(run_dir / "metrics.csv") as f:
        norms = [float(row["train/grad_norm"]) for row in csv.DictReader(f) if row.get("train/grad_norm")]
    assert norms and norms[0] > 0


def test_a_nan_loss_stops_the_run_or_is_skipped_when_allowed(h, tiny_shards, tmp_path, monkeypatch):
    """A NaN loss at the third step: by default the run stops naming the loss; with optimizer.skip_nonfinite_steps=1
    that update is dropped (weights and EMA unchanged, a warning) and the run finishes."""
    from pixdit.flow import RectifiedFlow

    real_loss = RectifiedFlow.loss

    def nan_at_the_third_step(calls):
        def loss(self, *args, **kwargs):
            value = real_loss(self, *args, **kwargs)
            return value * float("nan") if next(calls) == 2 else value

        return loss

    monkeypatch.setattr(RectifiedFlow, "loss", nan_at_the_third_step(itertools.count()))
    with pytest.raises(
        PixditError,
        match=r"diverged at step 2: the loss of the next update is NaN or inf \(loss nan"
        r".*The last good checkpoint is .*step=2.ckpt \(step 2\).*now 0\)",
    ):
        train(h, tiny_shards, tmp_path / "stop", "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=2")
    assert sorted(p.name for p in (tmp_path / "stop" / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step=2.ckpt"]

    monkeypatch.setattr(RectifiedFlow, "loss", nan_at_the_third_step(itertools.count()))
    with pytest.warns(UserWarning, match=r"step 2: the loss .* the update was dropped \(1 of .*=1\)"):
        result = train(h, tiny_shards, tmp_path / "skip", "trainer.max_steps=4", "optimizer.skip_nonfinite_steps=1")
    last = load(result["checkpoint"])
    assert last["global_step"] == 4 and last["nonfinite_steps_skipped"] == 1
    assert int(last["state_dict"]["ema.num_updates"]) == 3 and all_finite(last["state_dict"])


def test_the_checkpoint_writer_never_writes_nonfinite_weights(tmp_path):
    """The last line of defence: a state with NaN weights is refused; the good checkpoint and its EMA artifact stay."""
    from pixdit.callbacks import AtomicCheckpointIO
    from pixdit.module import DiffusionModule

    module = DiffusionModule(model={"name": "DiT-T", "hidden_size": 32, "depth": 1, "num_heads": 2}, image_size=8)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 1}
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(checkpoint, path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    state = dict(checkpoint["state_dict"])
    state["ema.model.final_layer.linear.weight"] = torch.full_like(
        state["ema.model.final_layer.linear.weight"], torch.nan
    )
    with pytest.raises(PixditError, match=r"not writing the checkpoint .*last.ckpt: .*NaN or inf \(ema.model.final"):
        io.save_checkpoint({**checkpoint, "state_dict": state, "global_step": 2}, path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------------------------------ 2: moved run directories
def test_a_copied_run_directory_resumes_into_its_own_last_ckpt(h, tiny_shards, tmp_path, finished_run):
    """Lightning wrote the new progress of a copied (or moved) run to last-v1.ckpt, so the next ckpt_path=last
    restored the old step again."""
    run_dir = copy_of(finished_run, tmp_path)
    train(
        h, tiny_shards, run_dir, "trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=2", "ckpt_path=last"
    )
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert names == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"], names
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 6
    assert load(run_dir / "checkpoints" / "last.ema.pt")["global_step"] == 6
    assert load(finished_run / "checkpoints" / "last.ckpt")["global_step"] == 4  # the original is untouched


# ------------------------------------------------------------------------------------------ 3: one run per directory
def test_a_run_directory_holds_one_run(h, tiny_shards, tmp_path):
    """A fresh run gives no "previous log files will be deleted" warning; a second fresh run into its directory is
    refused before Hydra rewrites anything there, with both ways out; a run into a directory another process holds
    is refused naming that process."""
    from pixdit.rundir import claim_run_directory

    run_dir = tmp_path / "run"
    first = train_py(h, tiny_shards, "trainer.max_steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "will be deleted" not in first.stderr and status(run_dir)["status"] == "ok"
    kept = {p: p.read_bytes() for p in [run_dir / "metrics.csv", run_dir / ".hydra" / "config.yaml"]}

    again = train_py(h, tiny_shards, "trainer.max_steps=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert f"the run directory {run_dir} already holds a run" in again.stderr
    assert (
        "ckpt_path=last" in again.stderr
        and "another hydra.run.dir" in again.stderr
        and "overwrite=true" in again.stderr
    )
    assert {p: p.read_bytes() for p in kept} == kept

    with claim_run_directory(run_dir, fresh=False):  # this process holds the directory, as a running pixdit-train
        busy = train_py(
            h, tiny_shards, "trainer.max_steps=3", f"hydra.run.dir={run_dir}", "ckpt_path=last", cwd=tmp_path
        )
    assert busy.returncode == 2, busy.stderr[-3000:]
    assert f"the run directory {run_dir} is in use by pid {os.getpid()} on " in busy.stderr
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2


def test_claiming_a_run_directory(tmp_path):
    """pixdit.rundir.claim_run_directory: only an earlier run's results count (not Hydra's config and log, nor a run
    that stopped at a config mistake); overwrite=true deletes those results and nothing else; a second claim while
    the first is held is refused."""
    from pixdit.rundir import claim_run_directory, write_status

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "train.log").write_text("log")
    write_status(run_dir, "failed", PixditError("a config mistake"))
    claim_run_directory(run_dir, fresh=True).close()  # nothing was trained there
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run_dir / "metrics.csv").write_text("step\n")
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(PixditError, match=r"already holds a run \(checkpoints, metrics.csv, status.json\)"):
        claim_run_directory(run_dir, fresh=True)
    claim_run_directory(run_dir, fresh=False).close()  # resuming it is fine
    with claim_run_directory(run_dir, fresh=True, overwrite=True):
        assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".pixdit.lock", "notes.txt", "train.log"]
        with pytest.raises(PixditError, match=rf"in use by pid {os.getpid()} .*another hydra.run.dir"):
            claim_run_directory(run_dir, fresh=False)
    claim_run_directory(run_dir, fresh=False).close()  # released


# ------------------------------------------------------------------------------------------ 4: SIGTERM, Ctrl-C
class SignalAt(L.Callback):
    """Sends this process SIGTERM as the training step after ``step`` starts, or during the validation at ``step``."""

    def __init__(self, step: int, during: str):
        self.step, self.during = step, during

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.during == "training" and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.during == "validation" and trainer.global_step == self.step and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("during, saved_step", [("training", 4), ("validation", 2)])
def test_sigterm_saves_the_current_step_and_resumes_exactly(h, tiny_shards, tmp_path, monkeypatch, during, saved_step):
    """SIGTERM while step 3 -> 4 trains: step 4 is saved when it ends; during the validation at step 2: step 2 is
    saved. Resuming from it gives bit for bit the weights, EMA, optimizer, schedule and data position of a run that
    never stopped (the same check as tests/test_resume.py)."""
    from test_resume import _assert_same

    import pixdit.callbacks
    from pixdit.cli import train as train_cli

    settings = [
        "trainer.max_steps=6",
        "trainer.val_check_interval=2",
        "optimizer.warmup_steps=5",
        "callbacks.checkpoint.every_n_train_steps=3",
        "callbacks.throughput=null",
    ]
    straight = load(train(h, tiny_shards, tmp_path / "straight", *settings)["checkpoint"])
    build_callbacks = pixdit.callbacks.build_callbacks
    monkeypatch.setattr(
        pixdit.callbacks,
        "build_callbacks",
        lambda cfg, run_dir: [
            *build_callbacks(cfg, run_dir),
            SignalAt(saved_step - 1 if during == "training" else saved_step, during),
        ],
    )
    with pytest.raises(
        train_cli.Preempted,
        match=rf"stopped by SIGTERM at step {saved_step}: saved .*step="
        rf"{saved_step}.ckpt",
    ):
        train(h, tiny_shards, tmp_path / "halves", *settings)
    assert load(tmp_path / "halves" / "checkpoints" / "last.ckpt")["global_step"] == saved_step
    monkeypatch.undo()
    resumed = load(train(h, tiny_shards, tmp_path / "halves", *settings, "ckpt_path=last")["checkpoint"])
    assert resumed["global_step"] == straight["global_step"] == 6
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "ShardDataModule"):
        _assert_same(straight[key], resumed[key], key)


def test_ctrl_c_in_a_finalizer_still_stops_the_run(h, tiny_shards, tmp_path, monkeypatch):
    """A Ctrl-C that lands while a finalizer runs (as when a finished data loader shuts its workers down between
    batches) was printed and dropped by Python's own handler ("Exception ignored in ... __del__"), and the run
    trained on to max_steps. Now the run stops at that batch's end through Lightning's shutdown (exit status 1), and
    the process's SIGINT handler is the one it had before."""
    import pixdit.callbacks

    class SigintInAFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside the finalizer
                pass

    steps = []

    class CtrlCAtStep3(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            steps.append(trainer.global_step)
            if trainer.global_step == 3:
                SigintInAFinalizer()  # made and finalized at once

    build_callbacks = pixdit.callbacks.build_callbacks
    monkeypatch.setattr(
        pixdit.callbacks, "build_callbacks", lambda cfg, run_dir: [*build_callbacks(cfg, run_dir), CtrlCAtStep3()]
    )
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stop:
        train(h, tiny_shards, tmp_path / "run", "trainer.max_steps=40")
    assert stop.value.code == 1 and steps[-1] == 3
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_stops_at_once_and_loader_workers_ignore_it():
    from pixdit.callbacks import StopOnCtrlC

    stop = StopOnCtrlC()
    before = signal.getsignal(signal.SIGINT)
    stop.on_train_start(None, None)
    try:
        handler = signal.getsignal(signal.SIGINT)
        assert handler is not before
        handler(signal.SIGINT, None)  # the first: noted, nothing raised yet
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            stop.on_train_batch_start(None, None, None, 0)  # raised at the next batch boundary
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, None)  # the second: at once
        stop._pid = -1  # as a forked data-loader worker sees it
        handler(signal.SIGINT, None)  # ignored there: the main process stops the workers
    finally:
        stop.teardown(None, None, "fit")
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(
    "how, exit_status, outcome", [("SIGTERM to the process group", 143, "preempted"), ("SIGINT", 1, "interrupted")]
)
def test_a_stopped_run_says_so(h, tiny_shards, tmp_path, how, exit_status, outcome):
    """`kill -TERM -PGID` (what schedulers send; it reaches the loader workers too): the current step is saved, exit
    status 143, status.json "preempted", one line and no traceback (a worker killed by the signal used to end the run
    with a RuntimeError). Ctrl-C keeps Lightning's behaviour (exit status 1) and says "interrupted"."""
    run_dir = tmp_path / "run"
    process = train_py(
        h,
        tiny_shards,
        "trainer.max_steps=100000",
        "data.num_workers=1",
        "callbacks.checkpoint.every_n_train_steps=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step=2.ckpt").is_file() and process.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 4 minutes"
            time.sleep(0.05)
        if how == "SIGINT":
            os.kill(process.pid, signal.SIGINT)
        else:
            os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == exit_status, stderr[-3000:]
    record = status(run_dir)
    assert record["status"] == outcome, record  # an unexpected outcome shows its error and traceback
    if outcome == "preempted":
        assert "Traceback" not in stderr and "stopped by SIGTERM at step" in stderr
        step = record["global_step"]
        assert step >= 2 and load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == step
        assert (
            record["checkpoint"].endswith(f"step={step}.ckpt")
            and (run_dir / "checkpoints" / f"step={step}.ckpt").is_file()
        )


# ------------------------------------------------------------------------------------------ 8, 9: damaged checkpoints
def test_a_damaged_last_ckpt_falls_back_to_the_newest_intact_checkpoint(h, tiny_shards, tmp_path, finished_run, caplog):
    """last.ckpt cut short (a copy that did not finish): ckpt_path=last resumes from the newest intact step=N.ckpt
    with a warning. Stale temporary files of an interrupted checkpoint write are removed when the run starts."""
    run_dir = copy_of(finished_run, tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    stale = run_dir / "checkpoints" / ".step=6.ckpt.tmp-4242-0123abcd"
    stale.write_bytes(b"half a checkpoint")
    mine = run_dir / "checkpoints" / "notes.tmp-1"
    mine.write_text("not a temporary file of pixdit's")
    with caplog.at_level("WARNING", logger="pixdit"):
        result = train(h, tiny_shards, run_dir, "trainer.max_steps=5", "ckpt_path=last")
    assert any(
        "cannot be read; resuming from the newest intact checkpoint of the run" in r.getMessage()
        and "step=4.ckpt (step 4)" in r.getMessage()
        for r in caplog.records
    )
    assert result["global_step"] == 5 and load(last)["global_step"] == 5
    assert not stale.exists() and mine.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            "last",
            r"ckpt_path='.*last.ckpt': cannot read the checkpoint: it is cut short, damaged or not a checkpoint.*; "
            r"the run has no other intact checkpoint in",
        ),
        (
            "garbage",
            r"ckpt_path='.*garbage.ckpt': cannot read the checkpoint.*; the newest intact checkpoint next to it is "
            r".*step=4.ckpt \(step 4\): ckpt_path=.*step=4.ckpt",
        ),
        ("init_from", r"init_from='.*garbage.ckpt': cannot read the checkpoint"),
        (
            "model",
            r"ckpt_path='.*last.ckpt' is a run of another model: this run has attention.name='vsa' \(checkpoint: "
            r"'full'\).*init_from=",
        ),
    ],
)
def test_a_checkpoint_that_cannot_be_resumed_is_one_message(h, tiny_shards, tmp_path, finished_run, damage, message):
    run_dir = copy_of(finished_run, tmp_path)
    checkpoints = run_dir / "checkpoints"
    garbage = checkpoints / "garbage.ckpt"
    garbage.write_bytes(os.urandom(4096))
    extra = {
        "last": ["ckpt_path=last"],
        "garbage": [f"ckpt_path={garbage}"],
        "init_from": [f"init_from={garbage}"],
        "model": ["ckpt_path=last", "attention=vsa", "model.token_order=zorder"],
    }[damage]
    if damage == "last":
        for path in checkpoints.glob("*.ckpt"):
            path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(PixditError, match=message):
        train(h, tiny_shards, run_dir, "trainer.max_steps=6", *extra)


def test_ckpt_path_auto_starts_a_new_run_or_resumes_the_one_there(tmp_path, finished_run):
    """ckpt_path=auto (what a requeued job passes, the same command every time): a new run in a directory without a
    checkpoint, `last` in one with a checkpoint; a directory with results but no checkpoint is refused like a new run."""
    from pixdit.cli.train import resolve_ckpt_path
    from pixdit.rundir import claim_run_directory, is_fresh_run

    empty = tmp_path / "first_start"
    assert is_fresh_run("auto", empty) and resolve_ckpt_path("auto", empty) is None
    claim_run_directory(empty, fresh=is_fresh_run("auto", empty)).close()
    run_dir = copy_of(finished_run, tmp_path)
    assert not is_fresh_run("auto", run_dir) and not is_fresh_run("last", run_dir)
    assert resolve_ckpt_path("auto", run_dir) == str(run_dir / "checkpoints" / "last.ckpt")
    claim_run_directory(run_dir, fresh=is_fresh_run("auto", run_dir)).close()
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        path.unlink()
    with pytest.raises(PixditError, match="already holds a run"):
        claim_run_directory(run_dir, fresh=is_fresh_run("auto", run_dir))


def test_the_ckpt_path_last_hint_names_the_newest_run(tmp_path):
    """No checkpoint in the run directory: the hint names the newest run of that name, not the alphabetically last."""
    from pixdit.cli.train import resolve_ckpt_path

    for name, age in (("zzz_old", 1000), ("aaa_new", 10)):
        last = tmp_path / name / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.write_bytes(b"x")
        os.utime(last, (time.time() - age, time.time() - age))
    with pytest.raises(
        PixditError,
        match=rf"newest run of this name with one is {tmp_path / 'aaa_new'}: add "
        rf"hydra.run.dir={tmp_path / 'aaa_new'}",
    ):
        resolve_ckpt_path("last", tmp_path / "new_run")


def test_the_missing_data_hint_names_the_users_path(h, tmp_path):
    from pixdit.cli import train as train_cli

    root = tmp_path / "my_data"
    cfg = h.compose(["experiment=quickstart", "trainer=cpu", f"data.root={root}"])
    with pytest.raises(PixditError, match=rf"no dataset at {root}/manifest.json.*\n.*--out {root}$"):
        train_cli.train(cfg, tmp_path / "run")


# ------------------------------------------------------------------------------------------ evaluation
@pytest.mark.parametrize(
    "case, message",
    [
        ("no ckpt", r"ckpt= is required"),
        ("garbage ckpt", r"ckpt='.*garbage.ckpt': cannot read the checkpoint"),
        ("nan weights", r"ckpt='.*last.ema.pt': the ema weights hold NaN or inf values .*diverged"),
        ("garbage reference", r"eval.reference=.*garbage.npz: not readable FID statistics"),
    ],
)
def test_evaluate_checks_the_checkpoint_and_reference_before_the_inception_weights(
    tmp_path, finished_run, case, message
):
    """pixdit-evaluate: each is one message, found before the Inception weights are looked for (there are none
    here: reaching that check would be a different message)."""
    from hydra import compose, initialize_config_module

    from pixdit.cli import evaluate as evaluate_cli

    run_dir = copy_of(finished_run, tmp_path)
    (tmp_path / "garbage.ckpt").write_bytes(os.urandom(4096))
    (tmp_path / "garbage.npz").write_bytes(os.urandom(4096))
    artifact = run_dir / "checkpoints" / "last.ema.pt"
    stored = load(artifact)
    stored["state_dict"] = {
        k: torch.full_like(v, torch.nan) if v.is_floating_point() else v for k, v in stored["state_dict"].items()
    }
    torch.save(stored, tmp_path / "nan.ema.pt")
    ckpt = {
        "no ckpt": None,
        "garbage ckpt": tmp_path / "garbage.ckpt",
        "nan weights": run_dir,
        "garbage reference": run_dir,
    }[case]
    if case == "nan weights":
        shutil.copy(tmp_path / "nan.ema.pt", artifact)
    settings = [
        "device=cpu",
        "num_samples=10",
        f"eval.inception_path={tmp_path / 'no_inception.pt'}",
        f"eval.reference={tmp_path / 'garbage.npz'}",
    ]
    with initialize_config_module(config_module="pixdit.configs.eval", version_base="1.3"):
        cfg = compose("evaluate", overrides=settings + ([f"ckpt={ckpt}"] if ckpt else []))
    with pytest.raises(PixditError, match=message):
        evaluate_cli.evaluate(cfg)


def test_load_weights_refuses_nonfinite_weights(tmp_path, finished_run):
    """init_from and scripts/llsa_recall.py read weights through load_weights too: the raw weights of a full
    checkpoint are checked as well as the EMA artifact."""
    from pixdit.checkpoint import load_weights

    checkpoint = load(finished_run / "checkpoints" / "last.ckpt")
    name = next(k for k in checkpoint["state_dict"] if k.startswith("model.") and k.endswith(".weight"))
    checkpoint["state_dict"][name] = checkpoint["state_dict"][name] * torch.inf
    torch.save(checkpoint, tmp_path / "inf.ckpt")
    with pytest.raises(
        PixditError,
        match=rf"init_from='.*inf.ckpt': the raw weights hold NaN or inf values "
        rf"\({name[len('model.') :]}\)",
    ):
        load_weights(tmp_path / "inf.ckpt", use_ema=False, key="init_from")
    assert load_weights(tmp_path / "inf.ckpt").source == "ema"  # the EMA weights of that file are finite


# ------------------------------------------------------------------------------------------ data follow-ups
def test_skipped_images_are_logged_as_a_metric(h, tmp_path):
    """Images that cannot be decoded while training are counted by the data module and logged as
    data/skipped_images (summed over ranks)."""
    import numpy as np

    from pixdit.data.imageops import encode_image
    from pixdit.data.shards import ShardWriter, write_manifest

    splits = {}
    for split, count in (("train", 16), ("val", 4)):
        with ShardWriter(tmp_path / "data", split, maxcount=8) as writer:
            for i in range(count):
                image = encode_image(np.full((8, 8, 3), i, np.uint8), "png")
                writer.write(f"{i:08d}", b"not a png" if split == "train" and i in (3, 11) else image, "png")
        splits[split] = writer.split_info()
    write_manifest(tmp_path / "data", resolution=8, image_format="png", splits=splits, source="test")
    with pytest.warns(UserWarning, match="skipping corrupt sample"):
        train(h, tmp_path / "data", tmp_path / "run", "trainer.max_steps=4")
    with open(tmp_path / "run" / "metrics.csv") as f:
        logged = [float(row["data/skipped_images"]) for row in csv.DictReader(f) if row.get("data/skipped_images")]
    assert logged[-1] == 2 and logged == sorted(logged)
