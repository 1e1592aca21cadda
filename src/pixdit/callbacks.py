"""Lightning callbacks of a pixdit run, and the atomic checkpoint writer.

* ``SampleGrid``: every N steps and at the end of training, samples a grid with the EMA model from fixed seeds (the
  same noise every time, so grids are comparable across steps and runs), writes ``<run>/samples/step_XXXXXXX.png`` and
  sends it to the loggers that take images (TensorBoard, W&B).
* ``PerfMonitor``: images/s, pixel tokens/s and peak GPU memory, logged as ``perf/*`` (config key ``throughput``;
  not Lightning's ``ThroughputMonitor``, which counts batches and FLOPs).
* ``AtomicCheckpointIO``: checkpoints are written to a temporary file in the same directory, fsync'ed and renamed over
  the target with ``os.replace`` (``pixdit.checkpoint``); a kill during a write leaves the previous checkpoint intact.
  Next to each checkpoint ``X.ckpt`` it writes the EMA artifact ``X.ema.pt`` (EMA weights + model config: what
  pixdit-evaluate and ``init_from`` read) and removes it with the checkpoint. Weights that hold NaN or inf are never
  written (``pixdit.checkpoint.nonfinite_tensors``): the good checkpoint under the name stays.
* ``StepCheckpoint``: Lightning's ``ModelCheckpoint`` (``<run>/checkpoints/step=N.ckpt`` and ``last.ckpt``) that also
  saves the final step when ``every_n_train_steps`` does not divide ``max_steps``, and the current step when the run
  gets SIGTERM (preemption, ``kill``), after which the run stops (pixdit-train exits with status 143). It overwrites
  its own files (no ``last-v1.ckpt``), so a resumed run, also one whose directory was moved or copied, goes on
  writing ``last.ckpt``.
* ``StopOnCtrlC``: Ctrl-C (SIGINT) stops the run at the next batch boundary, through Lightning's own interrupt
  handling (exit status 1, status "interrupted"); a second Ctrl-C stops at once. Always on (pixdit-train adds it).
* ``build_callbacks(cfg.callbacks, run_dir)`` turns ``configs/callbacks/*.yaml`` into these, the progress bar and
  ``pixdit.eval.callback.FIDCallback``, through the name -> class table ``CALLBACKS``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torchvision.utils
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from pixdit.checkpoint import atomic_torch_save, ema_artifact, ema_path, nonfinite_tensors
from pixdit.config import check_renamed, construct, plain
from pixdit.errors import PixditError
from pixdit.eval.callback import FIDCallback
from pixdit.flow import check_sampler


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO whose writes are crash-safe (``pixdit.checkpoint.atomic_torch_save``): a kill during a
    checkpoint write never destroys the last good checkpoint. Each checkpoint of a DiffusionModule also gets its EMA
    artifact (``pixdit.checkpoint.ema_artifact``), written first: an interrupted save leaves an artifact at least as
    new as its checkpoint, never an older one that would be evaluated in its place. Lightning calls this on rank 0."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        bad = nonfinite_tensors(checkpoint.get("state_dict") or {})
        if bad:
            raise PixditError(
                f"not writing the checkpoint {path}: its weights hold NaN or inf ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}); the checkpoints written before are kept"
            )
        artifact = ema_artifact(checkpoint)
        if artifact is not None:
            atomic_torch_save(artifact, ema_path(path))
        atomic_torch_save(checkpoint, path)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        ema_path(path).unlink(missing_ok=True)  # ModelCheckpoint's save_top_k drops a checkpoint: its artifact too


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that also saves

    * the final step: ``every_n_train_steps`` need not divide ``trainer.max_steps`` (43,750 steps saved every 5,000
      would otherwise end with last.ckpt at step 40,000 and the last 3,750 steps lost);
    * the current step when the process got SIGTERM (Lightning's handler records it): at the end of that step, then
      the run stops with Lightning's ``SIGTERMException``. A SIGTERM during a validation pass ends it early (that is
      Lightning's); the step is then saved when the exception passes (single-process runs; a multi-GPU run resumes
      from its previous checkpoint, as its ranks may stop at different validation batches).

    Both are ordinary step checkpoints (``step=N.ckpt`` + ``last.ckpt``), so they resume exactly like the others.
    Existing files are overwritten (``enable_version_counter=False``: Lightning would write ``last-v1.ckpt`` next to a
    ``last.ckpt`` it did not write itself in this process, e.g. after a resume from a moved directory)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        preempted = trainer.received_sigterm
        if trainer.world_size > 1:  # one decision for all ranks: saving is collective
            preempted = trainer.strategy.reduce_boolean_decision(preempted, all=False)
        if (preempted or 0 < trainer.max_steps <= trainer.global_step) and not self._should_skip_saving_checkpoint(
            trainer
        ):
            self._save_step(trainer)
        if preempted:
            raise SIGTERMException()

    def on_exception(self, trainer: Trainer, pl_module, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)
        if (
            isinstance(exception, SIGTERMException)
            and trainer.world_size == 1
            and not self._should_skip_saving_checkpoint(trainer)
        ):
            self._save_step(trainer)

    def _save_step(self, trainer: Trainer) -> None:
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


class SampleGrid(Callback):
    """PNG grids of EMA samples from fixed seeds, every ``every_n_train_steps`` optimizer steps and at the end."""

    renamed_options = {"every_n_steps": "every_n_train_steps"}  # Lightning's word, as callbacks.checkpoint has it

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int = 1000,
        num_samples: int = 16,
        steps: int = 20,
        seed: int = 0,
        cfg_scale: float = 1.0,
        nrow: int | None = None,
        at_end: bool = True,
        sampler: str = "euler",
        cfg_interval: list[float] | None = None,
    ):
        if every_n_train_steps < 0 or num_samples < 1 or steps < 1:
            raise PixditError(
                f"callbacks.samples: every_n_train_steps must be >= 0 (0 = only at the end), num_samples "
                f"and steps >= 1; got every_n_train_steps={every_n_train_steps}, "
                f"num_samples={num_samples}, steps={steps}"
            )
        self.cfg_interval = check_sampler(sampler, cfg_interval, prefix="callbacks.samples.")
        self.sampler = sampler
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.num_samples = num_samples
        self.steps = steps
        self.seed = seed
        self.cfg_scale = cfg_scale
        self.nrow = nrow or max(1, int(num_samples**0.5))
        self.at_end = at_end
        self.last_path: Path | None = None
        self._last_step = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        every = self.every_n_train_steps
        if every and step > 0 and step % every == 0 and step != self._last_step:
            self.write(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.write(trainer, pl_module)

    def write(self, trainer: Trainer, pl_module) -> Path | None:
        self._last_step = trainer.global_step
        # Every rank must call sample_images if it ever synchronises; ours does not, so only rank 0 samples.
        if not trainer.is_global_zero:
            return None
        images = pl_module.sample_images(
            self.num_samples,
            steps=self.steps,
            seed=self.seed,
            cfg_scale=self.cfg_scale,
            sampler=self.sampler,
            cfg_interval=self.cfg_interval,
        )
        grid = torchvision.utils.make_grid((images.float().cpu() + 1) / 2, nrow=self.nrow, padding=2)
        grid = grid.clamp(0, 1)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / f"step_{trainer.global_step:07d}.png"
        torchvision.utils.save_image(grid, path)
        self.last_path = path
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):  # WandbLogger
                logger.log_image(key="samples", images=[grid], step=trainer.global_step)
            elif hasattr(getattr(logger, "experiment", None), "add_image"):  # TensorBoardLogger
                logger.experiment.add_image("samples", grid, global_step=trainer.global_step)
        return path


class PerfMonitor(Callback):
    """Logs ``perf/images_per_s``, ``perf/tokens_per_s`` (pixel tokens = images x H x W / patch^2) and
    ``perf/peak_mem_gb`` averaged over windows of ``window`` optimizer steps (one GPU sync per window)."""

    def __init__(self, window: int = 50):
        if window < 1:
            raise PixditError(f"callbacks.throughput.window must be >= 1, got {window}")
        self.window = window
        self._start: float | None = None
        self._start_step = 0
        self._images = 0
        self._tokens = 0

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            self._sync(pl_module)
            self._start = time.perf_counter()
            self._start_step = trainer.global_step
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        images = batch["image"]
        self._images += images.shape[0] * trainer.world_size
        self._tokens += images.shape[0] * trainer.world_size * pl_module.tokens_per_image
        # Optimizer steps, not batches: with gradient accumulation a window ends after a step's last micro-batch.
        if trainer.global_step - self._start_step < self.window:
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._start
        metrics = {"perf/images_per_s": self._images / elapsed, "perf/tokens_per_s": self._tokens / elapsed}
        if pl_module.device.type == "cuda":
            metrics["perf/peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        self._start, self._images, self._tokens = None, 0, 0

    def on_validation_start(self, trainer, pl_module) -> None:
        # Validation and sampling are not training throughput: start a fresh window afterwards.
        self._start, self._images, self._tokens = None, 0, 0


# Config key (configs/callbacks/) -> callback class, in the order the callbacks run. The perf monitor first: Lightning
# calls on_train_batch_end in list order (checkpoints always last), so a window that ends at a sampling / checkpoint
# / FID step is measured before that work runs.
CALLBACKS = {
    "throughput": PerfMonitor,
    "checkpoint": StepCheckpoint,
    "samples": SampleGrid,
    "progress_bar": TQDMProgressBar,
    "fid": FIDCallback,
}
# pixdit's defaults under the configured options (Lightning's ModelCheckpoint: step=N.ckpt, keep all, and last.ckpt).
CALLBACK_DEFAULTS = {
    "checkpoint": {"filename": "step={step}", "auto_insert_metric_name": False, "save_last": True, "save_top_k": -1}
}


class StopOnCtrlC(Callback):
    """Ctrl-C stops training at the next batch boundary; a second Ctrl-C raises at once.

    Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. When that is a
    finalizer (a finished data loader shutting down its workers, which happens between training and validation
    batches), Python prints the exception and drops it, and the run trains on as if nothing had happened. This handler
    only takes note; the next batch hook raises KeyboardInterrupt, which Lightning turns into its usual shutdown (exit
    status 1, status.json "interrupted"). Forked data-loader workers ignore the signal: the main process stops them.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._pid = None

    def _on_sigint(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked data-loader worker: the main process stops it
            return
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after the current batch (Ctrl-C again stops at once)", file=sys.stderr, flush=True)

    def _install(self) -> None:
        if self._previous is None and threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _stop_if_requested(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    # Installed once Lightning has registered its own signal handlers (it restores what it found then, at its
    # teardown), so that the handler found before the run is the one left after it.
    def on_train_start(self, trainer, pl_module) -> None:
        self._install()

    def on_validation_start(self, trainer, pl_module) -> None:  # also trainer.validate() on its own
        self._install()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stop_if_requested()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stop_if_requested()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._stop_if_requested()


def build_callbacks(cfg, run_dir: str | Path) -> list[Callback]:
    """Callbacks from ``cfg.callbacks`` (configs/callbacks/default.yaml), one per key of ``CALLBACKS``; a null entry
    turns one off. The run directory is pixdit's choice: ``checkpoint`` writes <run>/checkpoints, ``samples``
    <run>/samples. ``fid`` (configs/callbacks/fid.yaml) is built only when it is on (every_n_train_steps > 0 or
    at_end)."""
    run_dir = Path(run_dir)
    cfg = plain(cfg) or {}
    unknown = sorted(set(cfg) - set(CALLBACKS))
    if unknown:
        raise PixditError(f"unknown callbacks {unknown}; allowed: {sorted(CALLBACKS)} (set one to null to turn it off)")
    fixed = {"checkpoint": {"dirpath": str(run_dir / "checkpoints")}, "samples": {"dirpath": str(run_dir / "samples")}}
    callbacks: list[Callback] = []
    for name, cls in CALLBACKS.items():
        options = cfg.get(name)
        if options is None:
            continue
        if isinstance(options, dict):
            check_renamed(cls, options, f"callbacks.{name}")  # before `fid` is skipped: an old key is never ignored
        # FID is switched on by any non-zero every_n_train_steps or at_end; FIDCallback then checks the values.
        if (
            name == "fid"
            and isinstance(options, dict)
            and not (options.get("every_n_train_steps") or options.get("at_end"))
        ):
            continue
        if isinstance(options, dict):
            options = {**CALLBACK_DEFAULTS.get(name, {}), **options}
        callbacks.append(construct(cls, options, f"callbacks.{name}", **fixed.get(name, {})))
    return callbacks
