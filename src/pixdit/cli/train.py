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
pixdit-evaluate and init_from read), samples/step_N.png. User mistakes (unknown option or key, missing data,
a size the attention cannot handle) print one message and exit with status 2.

Resuming (`ckpt_path=last` or a .ckpt path) restores exactly: the model, the EMA (weights and update count), AdamW's
state, the LR schedule, the step / epoch / batch counters, the data position (ShardDataModule.state_dict: same
samples in the same order when world size, workers and batch size are unchanged; otherwise the same number of images,
with a warning), and randomness: the training noise, timesteps and label dropout are drawn from a stream keyed by
(seed, rank, step), and the global torch / CUDA / numpy / python RNG states are saved and restored (rank 0's).
Not restored: a validation or sampling pass that was interrupted (it simply runs again at its next step), the
perf monitor's timing window, torch.compile's caches (it recompiles). Metrics after a resume go to
<run dir>/resumed_N/metrics.csv (Lightning's CSV logger would otherwise delete the earlier metrics.csv).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pixdit.cli import fail
from pixdit.config import construct, plain, register_resolvers
from pixdit.errors import PixditError
from pixdit.runtime import resolve_compile

CONFIG_MODULE = "pixdit.configs"
log = logging.getLogger("pixdit")


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
    fixed = {"csv": dict(save_dir=str(run_dir), name="", version=csv_version),
             "tensorboard": dict(save_dir=str(run_dir), name="tensorboard", version=""),
             "wandb": dict(save_dir=str(run_dir))}
    loggers = []
    for name, options in (plain(cfg) or {}).items():
        if name not in logger_classes:
            raise PixditError(f"logger {name!r} is not known; available: {', '.join(logger_classes)}")
        if name == "wandb" and importlib.util.find_spec("wandb") is None:
            raise PixditError("logger=wandb needs the wandb package: pip install wandb")
        loggers.append(construct(logger_classes[name], options, f"logger.{name}", **fixed[name]))
    return loggers


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """``last`` -> <run dir>/checkpoints/last.ckpt; any other value must be an existing file."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        path = run_dir / "checkpoints" / "last.ckpt"
        if not path.is_file():
            earlier = sorted(run_dir.parent.glob("*/checkpoints/last.ckpt"))
            hint = (f"; the latest run of this name with one is {earlier[-1].parent.parent}: add "
                    f"hydra.run.dir={earlier[-1].parent.parent}") if earlier else ""
            raise PixditError(f"ckpt_path=last: no checkpoint at {path} (resume a run by passing its directory as "
                              f"hydra.run.dir=<run dir>){hint}")
        return str(path)
    if not Path(ckpt_path).is_file():
        raise PixditError(f"ckpt_path={ckpt_path!r}: no such file (use a .ckpt path or ckpt_path=last)")
    return ckpt_path


def train(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Fit one run into ``run_dir``; returns the trainer's final metrics (floats) and the output paths."""
    import lightning as L
    import torch

    from pixdit.callbacks import AtomicCheckpointIO, SampleGrid, build_callbacks
    from pixdit.data.datamodule import ShardDataModule
    from pixdit.memory import check_training_memory, explain_out_of_memory
    from pixdit.module import DiffusionModule, check_seed

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Lightning warnings that are wrong for pixdit: the EMA copy is in eval mode on purpose, and the data module
    # restores the exact data position itself (ShardDataModule.state_dict), so mid-epoch checkpoints do resume exactly.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
    L.seed_everything(check_seed(cfg.seed), workers=True, verbose=False)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for fp32 matmuls on Ampere+ GPUs (bf16 autocast unaffected);
    torch.backends.cudnn.allow_tf32 = True        # CUDA-only flags: CPU numerics stay untouched

    datamodule = construct(ShardDataModule, plain(cfg.data), "data")
    use_compile = resolve_compile(cfg.compile, str(cfg.trainer.get("accelerator", "auto")))
    module = DiffusionModule.from_config(cfg, datamodule.resolution, compile=use_compile)
    if module.num_classes and module.num_classes != datamodule.num_classes:
        raise PixditError(f"model.num_classes={module.num_classes} but the data at {datamodule.root} has "
                          f"{datamodule.num_classes or 'no'} class labels (data.labelled={datamodule.labelled}); "
                          f"use labelled data with as many classes, or model.num_classes=0")
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    if cfg.init_from is not None:
        if ckpt_path is not None:
            log.info("init_from=%s is ignored: resuming from %s restores everything", cfg.init_from, ckpt_path)
        else:
            log.info(module.init_from(cfg.init_from, use_ema=cfg.init_from_ema))

    callbacks = build_callbacks(cfg.callbacks, run_dir)
    loggers = build_loggers(cfg.logger, run_dir, resuming=ckpt_path is not None)
    trainer = construct(L.Trainer, cfg.trainer, "trainer", callbacks=callbacks, logger=loggers,
                        plugins=[AtomicCheckpointIO()], default_root_dir=str(run_dir))
    log.info("run directory: %s", run_dir.resolve())
    # Before the first step: a configuration that cannot fit the GPU is one message naming the knobs to turn, and so is
    # an out-of-memory error during training (pixdit.memory).
    memory = check_training_memory(trainer, module.model, datamodule.batch_size)
    with explain_out_of_memory(module.model, memory, trainer):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    # Lightning validates every val_check_interval steps; when that does not divide max_steps the run would end with
    # an earlier step's validation loss, which sweep summaries report as the final one: validate the last step too.
    if not trainer.interrupted and trainer.limit_val_batches and module.validated_at_step != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)

    result = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    result["global_step"] = trainer.global_step
    result["run_dir"] = str(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    result["checkpoint"] = str(last) if last.is_file() else None
    grids = [c.last_path for c in callbacks if isinstance(c, SampleGrid) and c.last_path is not None]
    result["samples"] = str(grids[0]) if grids else None
    if trainer.is_global_zero:
        log.info("done after %d steps: checkpoint %s, samples %s", trainer.global_step, result["checkpoint"],
                 result["samples"])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning leaves the DDP process group open after fit. Left to the interpreter's exit, gloo's worker threads
        # can abort the process ("terminate called without an active exception", exit status -6) after a good run.
        torch.distributed.destroy_process_group()
    return result


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="train", version_base="1.3")
def run(cfg: DictConfig) -> None:
    """One Hydra job (a run, or one run of a ``-m`` sweep): train into Hydra's output directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except PixditError as error:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # a sweep goes on: Hydra records this run as failed (status.json, pixdit.sweep) and runs the rest
        fail(str(error))


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
                message = (f"unknown config key '{key}'. Keys at {where}: {', '.join(str(k) for k in node.keys())}. "
                           f"(To add a new key on purpose: +{key}=...)")
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
