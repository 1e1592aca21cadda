"""FIDCallback: FID / Inception Score (and any other metric of pixdit.eval.metrics) of the EMA model during training,
logged as `fid`, `is_mean`, `is_std` (`kid`, `sfid`, `precision`, `recall`, `fd_dinov2`) at the optimizer step: with
the CSV logger they land in metrics.csv (one row per evaluation, column `step`), which scripts/summarize_sweep.py
turns into FID-vs-step curves.

Config: configs/callbacks/fid.yaml (train.py builds it as `callbacks.fid`); e.g.

    python train.py experiment=ffhq128_llsa callbacks.fid.every_n_train_steps=5000 callbacks.fid.num_samples=10000 \
        callbacks.fid.reference=cleanfid:ffhq_trainval70k callbacks.fid.inception_path=/data/inception-2015-12-05.pt

* Checks: metric names, sampler and CFG interval when the callback is built; the weights files and the reference
  statistics (resolution, what it holds, its Inception pipeline) in `setup`, before the first training step, never
  mid-training (a PixditError names the file, its source and the config key).
* Every rank generates its share of the samples (per-index seeds: same images for any GPU count), features are
  combined across ranks and the metrics computed once (rank 0) and sent to every rank, so all ranks log the same value
  and `ModelCheckpoint(monitor="fid")` works.
* Memory: generation runs in batches of at most `batch_size` and halves the batch on CUDA out-of-memory, so an
  evaluation cannot kill the training run. It is skipped under `fast_dev_run`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from pixdit.errors import PixditError
from pixdit.eval.evaluator import evaluate_generator
from pixdit.eval.metrics import MetricSuite, build_suite, check_metric_names
from pixdit.eval.reference import default_stats_path
from pixdit.eval.sampling import check_batch_size
from pixdit.flow import check_sampler
from pixdit.fsdp import FSDPStrategy
from pixdit.runtime import resolve_compile, resolve_precision

log = logging.getLogger(__name__)


class FIDCallback(Callback):
    """FID/IS of generated samples every `every_n_train_steps` optimizer steps (0 = never) and/or at the end of
    training."""

    config_key = "callbacks.fid"
    renamed_options = {"every_n_steps": "every_n_train_steps"}  # Lightning's word, as callbacks.checkpoint has it

    def __init__(
        self,
        reference: str | None = None,  # None: <data root>/fid_stats/clean_<res>.npz (scripts/make_fid_stats.py)
        every_n_train_steps: int = 0,
        at_end: bool = True,
        num_samples: int = 10_000,
        steps: int = 20,
        sampler: str = "euler",
        cfg_interval: list[float] | None = None,
        cfg_scale: float = 1.0,
        seed: int = 0,
        batch_size: int | str = 64,
        compile: bool | str = "auto",
        use_ema: bool = True,
        precision: str = "auto",
        metrics: list[str] = ("fid", "is"),
        inception_mode: str = "clean",
        inception_splits: int = 10,
        inception_path: str | None = None,
        cache_dir: str | None = None,
        dinov2_path: str | None = None,
        cleanfid_stats_dir: str | None = None,
        download: bool = False,
    ):
        key = self.config_key
        if every_n_train_steps < 0 or num_samples < max(2, inception_splits) or steps < 1 or inception_splits < 1:
            raise PixditError(
                f"{key}: every_n_train_steps must be >= 0 (0 = only at the end), inception_splits >= 1, num_samples >= "
                f"inception_splits ({inception_splits}) and >= 2, steps >= 1; got every_n_train_steps="
                f"{every_n_train_steps}, num_samples={num_samples}, steps={steps}"
            )
        check_batch_size(batch_size, f"{key}.batch_size")
        resolve_compile(compile, "cpu")  # checks the value now (auto = on CUDA, decided at each evaluation)
        resolve_precision(precision, "cpu", key=f"{key}.precision")  # checks the name now; `auto` = the trainer's
        self.metrics = check_metric_names(metrics, key)
        self.cfg_interval = check_sampler(sampler, cfg_interval, prefix=f"{key}.")
        self.sampler = sampler
        self.reference_name = reference
        self.every_n_train_steps = every_n_train_steps
        self.at_end = at_end
        self.num_samples = num_samples
        self.steps = steps
        self.cfg_scale = cfg_scale
        self.seed = seed
        self.batch_size = batch_size
        self.compile = compile
        self.use_ema = use_ema
        self.precision = precision
        self.inception_mode = inception_mode
        self.inception_splits = inception_splits
        self.inception_path = inception_path
        self.cache_dir = cache_dir
        self.dinov2_path = dinov2_path
        self.cleanfid_stats_dir = cleanfid_stats_dir
        self.download = download
        self.enabled = every_n_train_steps > 0 or at_end
        self.suite: MetricSuite | None = None
        self.last_metrics: dict | None = None
        self._reference = None  # the resolved reference name
        self._resolution = None
        self._last_step = -1

    # ------------------------------------------------------------------ start-up checks
    def setup(self, trainer: Trainer, pl_module, stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        if trainer.fast_dev_run:
            log.info("FIDCallback: skipped under fast_dev_run")
            self.enabled = False
            return
        key = self.config_key
        if not self.use_ema and isinstance(trainer.strategy, FSDPStrategy):
            # The sharded model gathers its weights from every rank at each forward, but the ranks sample different
            # numbers of batches: the run would hang. The EMA copy is whole on every rank (pixdit.fsdp).
            raise PixditError(
                f"{key}.use_ema=false cannot run under trainer=fsdp (the sharded raw weights would need "
                f"every rank in each forward); use {key}.use_ema=true (the default) or trainer=ddp"
            )
        resolution = int(pl_module.image_size[0])
        reference = self.reference_name
        data_root = getattr(trainer.datamodule, "root", None) if trainer.datamodule is not None else None
        if not reference and data_root is not None and set(self.metrics) != {"is"}:
            # Default: the statistics scripts/make_fid_stats.py writes next to the training shards.
            reference = str(default_stats_path(data_root, resolution, self.inception_mode))
            if not Path(reference).is_file():
                raise PixditError(
                    f"{key}.reference is not set and {reference} does not exist. Make it once with:\n"
                    f"    python scripts/make_fid_stats.py --shards {data_root} --resolution {resolution}\n"
                    f"  or set {key}.reference=cleanfid:ffhq_trainval70k (FFHQ at 256/1024 px), or {key}=null to "
                    f"turn FID off"
                )
        if not reference and set(self.metrics) != {"is"}:
            raise PixditError(
                f"{key}.reference is not set: use cleanfid:ffhq_trainval70k (FFHQ at 256 or 1024 px) or the .npz made "
                f"by `python scripts/make_fid_stats.py --shards DATA_DIR --resolution R` (or set {key}=null to turn "
                f"FID off)"
            )
        self._reference, self._resolution = reference, resolution
        # Loads the networks now too (a corrupt file fails here, not at the first evaluation).
        self.suite = self._build_suite(trainer.strategy.root_device)

    def _build_suite(self, device) -> MetricSuite:
        return build_suite(
            self.metrics,
            self._reference,
            resolution=self._resolution,
            device=device,
            inception_path=self.inception_path,
            cache_dir=self.cache_dir,
            inception_mode=self.inception_mode,
            dinov2_path=self.dinov2_path,
            cleanfid_stats_dir=self.cleanfid_stats_dir,
            download=self.download,
            prefix=self.config_key,
        )

    # ------------------------------------------------------------------ when to evaluate
    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if (
            self.enabled
            and self.every_n_train_steps
            and step > 0
            and step % self.every_n_train_steps == 0
            and step != self._last_step
        ):
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module) -> None:
        if self.enabled and self.at_end and trainer.global_step != self._last_step:
            self.evaluate(trainer, pl_module)

    # The step last evaluated travels in checkpoints: with gradient accumulation the first micro-batches after a
    # resume still see the checkpoint's global_step, which must not be evaluated (and logged) a second time.
    def state_dict(self) -> dict:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self._last_step = int(state_dict.get("last_step", -1))

    # ------------------------------------------------------------------ the evaluation
    def evaluate(self, trainer: Trainer, pl_module) -> dict:
        """Run one evaluation on every rank (collective) and log the result; returns the metrics."""
        self._last_step = trainer.global_step
        device = pl_module.device
        network = self.suite.inception or self.suite.dinov2
        if network.device != device:
            self.suite = self._build_suite(device)
        model = pl_module.ema.model if self.use_ema and hasattr(pl_module, "ema") else pl_module.model
        metrics = evaluate_generator(
            model,
            pl_module.flow,
            self.suite,
            num_samples=self.num_samples,
            image_size=pl_module.image_size,
            steps=self.steps,
            sampler=self.sampler,
            cfg_interval=self.cfg_interval,
            seed=self.seed,
            cfg_scale=self.cfg_scale,
            num_classes=pl_module.num_classes,
            batch_size=self.batch_size,
            device=device,
            compile=resolve_compile(self.compile, device.type),
            precision=resolve_precision(self.precision, device, trainer.precision),
            inception_splits=self.inception_splits,
        )
        logged = {k: float(v) for k, v in metrics.items() if k != "num_samples" and v is not None}
        for name, value in logged.items():
            trainer.callback_metrics[name] = torch.tensor(value)  # visible to ModelCheckpoint(monitor="fid")
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=trainer.global_step)
            log.info(
                "step %d: %s (%d samples)",
                trainer.global_step,
                ", ".join(f"{k}={v:.4g}" for k, v in logged.items()),
                metrics["num_samples"],
            )
        self.last_metrics = {**metrics, "step": trainer.global_step}
        return metrics
