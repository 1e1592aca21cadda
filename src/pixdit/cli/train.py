"""``pixdit-train`` (= ``python train.py``): compose the Hydra config, build data / model / callbacks / loggers /
trainer, fit.

    python train.py experiment=quickstart                          # bundled demo data, ~5 min on a laptop CPU
    python train.py experiment=ffhq256_llsa                        # the paper's 256^2 LLSA run (needs FFHQ shards)
    python train.py experiment=quickstart trainer.max_steps=100 attention=full model=dit_t
    python train.py experiment=quickstart hydra.run.dir=outputs/quickstart/<time> ckpt_path=last   # resume exactly
    python train.py experiment=ffhq128_llsa init_from=outputs/ffhq32_full/<time>/checkpoints/last.ckpt
    python train.py -m experiment=ffhq128_llsa attention.topk=4,8,16                  # a sweep (Hydra multirun)
    python train.py experiment=quickstart --cfg job                 # print the composed config, do nothing
    pixdit-train experiment=quickstart data.root=/abs/data/quickstart   # the same, installed, from any directory

The configs are the package ``pixdit.configs`` (configs/ in the repository), loaded with Hydra's
``pkg://pixdit.configs``, so a ``pip install``ed pixdit finds them from any working directory.

A run writes into its directory (default outputs/<name>/<time>, or hydra.run.dir=...): .hydra/ (the config),
metrics.csv, checkpoints/{step=N,last}.ckpt (+ {step=N,last}.ema.pt: the EMA weights and model config alone, what
pixdit-evaluate and init_from read), samples/step_N.png, status.json (how the run ended: ok, failed, preempted,
interrupted; scripts/summarize_sweep.py reads it). User mistakes (unknown option or key, missing data, a size the
attention cannot handle, a damaged checkpoint) print one message and exit with status 2.

A run directory belongs to one run (pixdit.rundir): a second pixdit-train into it while the first runs is refused,
naming the first; a new run (no ckpt_path) into a directory that holds a run is refused unless overwrite=true.
Faults while training (docs/reliability.md): a NaN / inf loss or gradient norm stops the run with one message naming
the last good checkpoint (exit 2, nothing written after it); SIGTERM (preemption, `kill`) saves the current step and
exits with status 143 (resume it with ckpt_path=last); Ctrl-C stops after the current batch, a second Ctrl-C at once
(exit 1, status "interrupted").

Resuming (`ckpt_path=last` or a .ckpt path) restores exactly: the model, the EMA (weights and update count), AdamW's
state, the LR schedule, the step / epoch / batch counters, the data position (ShardDataModule.state_dict: same
samples in the same order when world size, workers and batch size are unchanged; otherwise the same number of images,
with a warning), and randomness: the training noise, timesteps and label dropout are drawn from a stream keyed by
(seed, rank, step), and the global torch / CUDA / numpy / python RNG states are saved and restored (rank 0's).
Not restored: a validation or sampling pass that was interrupted (it simply runs again at its next step), the
perf monitor's timing window, torch.compile's caches (it recompiles). A damaged last.ckpt (a copy cut short) is
passed over for the run's newest intact checkpoint, with a warning. Metrics after a resume go to
<run dir>/resumed_N/metrics.csv (Lightning's CSV logger would otherwise delete the earlier metrics.csv).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pixdit.checkpoint import check_same_model, newest_intact_checkpoint, read_checkpoint
from pixdit.cli import fail
from pixdit.config import check_top_level_keys, construct, plain, register_resolvers
from pixdit.errors import PixditError
from pixdit.files import remove_stale_temporaries
from pixdit.rundir import is_fresh_run
from pixdit.runtime import is_rank_zero, resolve_compile, set_compile_memory_budget

CONFIG_MODULE = "pixdit.configs"
PREEMPTED_EXIT_STATUS = 128 + 15  # what a shell reports for a process ended by SIGTERM: schedulers read it so
log = logging.getLogger("pixdit")


class Preempted(Exception):
    """``train`` stopped on SIGTERM after saving the current step (pixdit-train then exits with status 143)."""

    def __init__(self, step: int, checkpoint: Path | None):
        self.step, self.checkpoint = step, checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint (callbacks.checkpoint is off)"
        super().__init__(
            f"stopped by SIGTERM at step {step}: {saved}; resume with ckpt_path=last and the same hydra.run.dir"
        )


def build_loggers(cfg, run_dir: Path, resuming: bool = False) -> list:
    """``cfg.logger``: one entry per logger (configs/logger/{csv,tensorboard,wandb}.yaml), all writing into the run.

    The CSV logger writes <run dir>/metrics.csv; a resumed run writes <run dir>/resumed_N/metrics.csv instead, because
    Lightning's CSV logger deletes an existing metrics.csv (the metrics before the resume would be lost).
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    logger_classes = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}  # config name -> class
    run_dir = Path(run_dir)
    csv_version = ""
    if resuming and (run_dir / "metrics.csv").exists():
        csv_version = f"resumed_{len(list(run_dir.glob('resumed_*'))) + 1}"
    # Where each logger writes is pixdit's choice (the run directory), not a config option.
    fixed = {
        "csv": dict(save_dir=str(run_dir), name="", version=csv_version),
        "tensorboard": dict(save_dir=str(run_dir), name="tensorboard", version=""),
        "wandb": dict(save_dir=str(run_dir)),
    }
    loggers = []
    for name, options in (plain(cfg) or {}).items():
        if name not in logger_classes:
            raise PixditError(f"logger {name!r} is not known; available: {', '.join(logger_classes)}")
        if name == "wandb" and importlib.util.find_spec("wandb") is None:
            raise PixditError("logger=wandb needs the wandb package: pip install wandb")
        loggers.append(construct(logger_classes[name], options, f"logger.{name}", **fixed[name]))
    return loggers


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """The checkpoint to resume from, checked to be whole and readable (``pixdit.checkpoint.read_checkpoint``).

    ``last`` -> <run dir>/checkpoints/last.ckpt; when that file is missing or damaged, the run's newest intact
    checkpoint, with a warning. ``auto`` -> as ``last`` when the run directory has a checkpoint, else None (a new run):
    the setting for a job that a scheduler requeues with the same command. Any other value must be a readable
    checkpoint file; for a damaged one the message names the newest intact checkpoint next to it."""
    run_dir = Path(run_dir)
    if is_fresh_run(ckpt_path, run_dir):
        return None
    if ckpt_path == "auto":
        ckpt_path = "last"
    if ckpt_path == "last":
        path = run_dir / "checkpoints" / "last.ckpt"
        problem = None
        if path.is_file():
            try:
                read_checkpoint(path)
                return str(path)
            except PixditError as error:
                problem = error
        fallback = newest_intact_checkpoint(path.parent, exclude=(path,))
        if fallback is not None:
            reason = "cannot be read" if problem else "does not exist"
            log.warning(
                "ckpt_path=last: %s %s; resuming from the newest intact checkpoint of the run, %s (step %d)",
                path,
                reason,
                fallback[0],
                fallback[1],
            )
            return str(fallback[0])
        if problem is not None:
            raise PixditError(
                f"{problem}; the run has no other intact checkpoint in {path.parent}: restore the file "
                f"from a copy, or start a new run (another hydra.run.dir, init_from=<checkpoint>)"
            )
        siblings = [p for p in run_dir.parent.glob("*/checkpoints/last.ckpt") if p.parent.parent != run_dir]
        newest = max(siblings, key=lambda p: p.stat().st_mtime).parent.parent if siblings else None
        hint = (f"; the newest run of this name with one is {newest}: add hydra.run.dir={newest}") if newest else ""
        raise PixditError(
            f"ckpt_path=last: no checkpoint at {path} (resume a run by passing its directory as "
            f"hydra.run.dir=<run dir>){hint}"
        )
    path = Path(ckpt_path)
    if not path.is_file():
        raise PixditError(f"ckpt_path={ckpt_path!r}: no such file (use a .ckpt path or ckpt_path=last)")
    try:
        read_checkpoint(path)
    except PixditError as error:
        fallback = newest_intact_checkpoint(path.parent, exclude=(path,))
        hint = (
            (f"the newest intact checkpoint next to it is {fallback[0]} (step {fallback[1]}): ckpt_path={fallback[0]}")
            if fallback
            else "give another checkpoint of the run (or ckpt_path=last)"
        )
        raise PixditError(f"{error}; {hint}") from None
    return ckpt_path


def check_trainer_settings(options: dict) -> None:
    """The ``trainer`` settings that Lightning accepts but a pixdit run cannot use, or reports only mid-run with a
    traceback (a ZeroDivisionError for accumulate_grad_batches=0): one PixditError each, before anything is built."""

    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    max_steps = options.get("max_steps")
    if not whole(max_steps) or max_steps < 1:
        raise PixditError(
            f"trainer.max_steps={max_steps!r} must be a whole number >= 1: a pixdit run ends after that "
            f"many optimizer steps (Lightning's -1 would train forever)"
        )
    for name in ("accumulate_grad_batches", "log_every_n_steps"):
        value = options.get(name, 1)
        if not whole(value) or value < 1:
            raise PixditError(f"trainer.{name}={value!r} must be a whole number >= 1")
    interval = options.get("val_check_interval")
    if (
        isinstance(interval, (int, float))
        and not isinstance(interval, bool)
        and not (interval >= 1 if whole(interval) else 0 < interval <= 1)
    ):
        raise PixditError(
            f"trainer.val_check_interval={interval!r} must be a number of optimizer steps >= 1 (or a "
            f"fraction of an epoch in (0, 1]); to validate only at the end use a number >= "
            f"trainer.max_steps, to never validate trainer.limit_val_batches=0"
        )


def check_accelerator(options: dict) -> None:
    """trainer=gpu / ddp on a machine without a CUDA GPU: one message (Lightning: "No supported gpu backend")."""
    import torch

    accelerator = str(options.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise PixditError(
            f"trainer.accelerator={accelerator} (trainer=gpu / ddp) but PyTorch sees no CUDA GPU here; "
            f"use trainer=cpu, or trainer=auto (the GPU when there is one), or check the driver and "
            f"CUDA_VISIBLE_DEVICES"
        )


def train(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Fit one run into ``run_dir``; returns the trainer's final metrics (floats) and the output paths."""
    import lightning as L
    import torch
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from pixdit.callbacks import AtomicCheckpointIO, SampleGrid, StopOnCtrlC, build_callbacks
    from pixdit.data.datamodule import ShardDataModule
    from pixdit.memory import check_training_memory, explain_out_of_memory
    from pixdit.module import DiffusionModule, check_seed

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Lightning warnings that are wrong for pixdit: the EMA copy is in eval mode on purpose; the data module restores
    # the exact data position itself (ShardDataModule.state_dict), so mid-epoch checkpoints do resume exactly; the CSV
    # logger's log directory is the run directory, which holds .hydra/ but never an earlier metrics.csv (a resumed run
    # logs into resumed_N/, a new one only runs in a directory without an earlier run: pixdit.rundir); the checkpoint
    # directory of a moved or copied run differs from the one stored in its checkpoints, which only matters to
    # Lightning's record of earlier files for save_top_k.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
    warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    check_top_level_keys(cfg)
    check_trainer_settings(plain(cfg.trainer))
    L.seed_everything(check_seed(cfg.seed), workers=True, verbose=False)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for fp32 matmuls on Ampere+ GPUs (bf16 autocast unaffected);
    torch.backends.cudnn.allow_tf32 = True  # CUDA-only flags: CPU numerics stay untouched

    use_compile = resolve_compile(cfg.compile, str(cfg.trainer.get("accelerator", "auto")))
    memory_budget = set_compile_memory_budget(cfg.compile_memory_budget)
    if memory_budget < 1 and not use_compile:
        log.warning(
            "compile_memory_budget=%g has no effect: the model is not compiled (compile=%s)", memory_budget, cfg.compile
        )
    datamodule = construct(ShardDataModule, plain(cfg.data), "data")
    module = DiffusionModule.from_config(cfg, datamodule.resolution, compile=use_compile)
    if module.num_classes and module.num_classes != datamodule.num_classes:
        raise PixditError(
            f"model.num_classes={module.num_classes} but the data at {datamodule.root} has "
            f"{datamodule.num_classes or 'no'} class labels (data.labelled={datamodule.labelled}); "
            f"use labelled data with as many classes, or model.num_classes=0"
        )
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    if ckpt_path is not None:
        differ = check_same_model(ckpt_path, read_checkpoint(ckpt_path), module.state_dict(), dict(module.hparams))
        if differ:
            log.warning("resuming %s with settings that differ from its run's: %s", ckpt_path, ", ".join(differ))
    if cfg.init_from is not None:
        if ckpt_path is not None:
            log.info("init_from=%s is ignored: resuming from %s restores everything", cfg.init_from, ckpt_path)
        else:
            log.info(module.init_from(cfg.init_from, use_ema=cfg.init_from_ema))

    callbacks = [*build_callbacks(cfg.callbacks, run_dir), StopOnCtrlC()]
    loggers = build_loggers(cfg.logger, run_dir, resuming=ckpt_path is not None)
    check_accelerator(plain(cfg.trainer))
    try:
        trainer = construct(
            L.Trainer,
            cfg.trainer,
            "trainer",
            callbacks=callbacks,
            logger=loggers,
            plugins=[AtomicCheckpointIO()],
            default_root_dir=str(run_dir),
        )
    except MisconfigurationException as error:
        raise PixditError(f"trainer: {error}") from None
    if is_rank_zero():
        # writes of a killed process (their files are never read); this process owns the run directory now
        for path in remove_stale_temporaries(run_dir / "checkpoints"):
            log.info("removed %s, left by an interrupted checkpoint write", path)
    log.info("run directory: %s", run_dir.resolve())
    # Before the first step: a configuration that cannot fit the GPU is one message naming the knobs to turn, and so is
    # an out-of-memory error during training (pixdit.memory).
    memory = check_training_memory(trainer, module.model, datamodule.batch_size)
    try:
        with explain_out_of_memory(module.model, memory, trainer):
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        # Lightning validates every val_check_interval steps; when that does not divide max_steps the run would end
        # with an earlier step's validation loss, which sweep summaries report as the final one: validate it too.
        if not trainer.interrupted and trainer.limit_val_batches and module.validated_at_step != trainer.global_step:
            trainer.validate(module, datamodule=datamodule, verbose=False)
    except SIGTERMException:  # StepCheckpoint saved the current step (or Lightning stopped without one)
        found = newest_intact_checkpoint(run_dir / "checkpoints")
        raise Preempted(trainer.global_step, found[0] if found else None) from None

    result = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    result["global_step"] = trainer.global_step
    result["run_dir"] = str(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    result["checkpoint"] = str(last) if last.is_file() else None
    grids = [c.last_path for c in callbacks if isinstance(c, SampleGrid) and c.last_path is not None]
    result["samples"] = str(grids[0]) if grids else None
    if trainer.is_global_zero:
        log.info(
            "done after %d steps: checkpoint %s, samples %s",
            trainer.global_step,
            result["checkpoint"],
            result["samples"],
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning leaves the DDP process group open after fit. Left to the interpreter's exit, gloo's worker threads
        # can abort the process ("terminate called without an active exception", exit status -6) after a good run.
        torch.distributed.destroy_process_group()
    return result


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
    """One Hydra job (a run, or one run of a ``-m`` sweep): train into Hydra's output directory, and record how it
    ended in <run dir>/status.json (pixdit.rundir.write_status; the first process of a multi-GPU run writes it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from pixdit.rundir import write_status

    hydra_config = HydraConfig.get()
    run_dir = hydra_config.runtime.output_dir
    started = time.time()

    def record(status: str, error: BaseException | None = None, **extra) -> None:
        if is_rank_zero():
            write_status(
                run_dir,
                status,
                error,
                overrides=list(hydra_config.overrides.task),
                seconds=round(time.time() - started, 1),
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                **extra,
            )

    try:
        result = train(cfg, run_dir)
    except Preempted as stop:
        record("preempted", global_step=stop.step, checkpoint=str(stop.checkpoint) if stop.checkpoint else None)
        print(f"pixdit-train: {stop}", file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_STATUS)
    except PixditError as error:
        record("failed", error)
        if hydra_config.mode == RunMode.MULTIRUN:
            raise  # a sweep goes on: Hydra records this run as failed and runs the rest
        fail(str(error))
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C: Lightning stops the fit and exits with status 1
        record("interrupted", exit_status=getattr(stop, "code", None))
        raise
    except BaseException as error:  # a bug: its traceback is kept
        record("failed", error)
        raise
    record("ok", global_step=result["global_step"], checkpoint=result["checkpoint"])


def check_overrides(overrides: list[str]) -> None:
    """Compose the config once before Hydra runs it, to turn composition mistakes into one message with choices."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(a in ("-m", "--multirun") or a.startswith("-") for a in overrides):
        return  # flags (--cfg, --help, -m sweeps): Hydra handles them and reports its own errors
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        try:
            compose(config_name="train", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            fail(explain_config_error(error, overrides))


def explain_config_error(error: Exception, overrides: list[str]) -> str:
    """Hydra's message, plus the keys that do exist where the user named one that does not."""
    from hydra import compose

    message = str(error).strip().split("\nConfig search path:")[0].strip()  # the search path is noise to a user
    full_key = getattr(error, "full_key", None) or getattr(getattr(error, "__cause__", None), "full_key", None)
    if full_key and "not in struct" in message or "Could not override" in message:
        key = full_key or message.split("'")[1]
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        rest = [o for o in overrides if not o.split("=")[0].lstrip("+~").startswith(key)]
        try:
            cfg = compose(config_name="train", overrides=rest)
            node = OmegaConf.select(cfg, parent) if parent else cfg
            renamed = renamed_option(cfg, parent, key.rsplit(".", 1)[-1])
            if renamed:
                message = f"{key} was renamed: use {parent}.{renamed}"
            elif isinstance(node, DictConfig):
                where = f"'{parent}'" if parent else "the top level"
                message = (
                    f"unknown config key '{key}'. Keys at {where}: {', '.join(str(k) for k in node.keys())}. "
                    f"(To add a new key on purpose: +{key}=...)"
                )
        except Exception:  # the original message is still right; the key list is a bonus
            pass
    return message


def renamed_option(cfg: DictConfig, section: str, option: str) -> str | None:
    """What replaced `option` of a config section built by a class with ``renamed_options`` (the callbacks, the
    attention backend), or None: the command line's old key gets the same answer as config.construct gives."""
    from pixdit.attention import attention_class
    from pixdit.callbacks import CALLBACKS

    if section == "attention" and OmegaConf.select(cfg, "attention.name"):
        cls = attention_class(str(cfg.attention.name))
    elif section.startswith("callbacks."):
        cls = CALLBACKS.get(section.split(".", 1)[1])
    else:
        return None
    return getattr(cls, "renamed_options", {}).get(option)


def main() -> None:
    """The ``pixdit-train`` command: the command line is Hydra's (overrides, ``-m``, ``--cfg job``, ...)."""
    register_resolvers()
    check_overrides(sys.argv[1:])
    run()


if __name__ == "__main__":
    main()
