"""Sweeps (Hydra multirun) over attention settings: check every run before any starts, run one job per GPU.

    python train.py -m experiment=ffhq128_llsa attention.topk=4,8,16 attention.block_size=16,32 \\
        hydra/launcher=local_gpus                                # all local GPUs, one job per GPU at a time
    python train.py -m experiment=ffhq128_llsa attention.topk=4,8,16 hydra/launcher=slurm \\
        hydra.launcher.partition=<partition>                     # one SLURM job per run (configs/hydra/launcher/)
    python scripts/summarize_sweep.py multirun/ffhq128_llsa/<time> # table + plot (docs/scaling.md)

Everything that runs the jobs is Hydra's and submitit's; this module adds three small pieces:

* ``SweepCallback`` (a Hydra callback, listed under ``hydra.callbacks`` in configs/train.yaml)
    - ``on_multirun_start``: expands the sweep exactly as Hydra's BasicSweeper will, composes every job's config with
      Hydra's own loader, and builds each job's model on PyTorch's ``meta`` device (no memory, no data) through
      ``DiffusionModule.from_config`` - the same builder pixdit-train calls, so the same checks run (attention
      options, ``check_grid`` / the kernels' ``llsa_check``: B a power of two >= 16, B^L divides the token count...).
      It also checks that the launcher starts every process a run needs (``check_launch_layout``). If any job
      would fail there, nothing is launched and one message lists every bad combination.
    - ``on_job_end``: logs a failed run. Hydra catches a failing job's exception, runs the remaining jobs, and
      reports the first failure when all are done; each run records how it ended in ``<run dir>/status.json``
      (``pixdit.rundir.write_status``, written by pixdit-train) and the summary marks failed runs.
* ``LocalGPUPool``: hydra-submitit-launcher's local launcher, except that at most one job runs per GPU (or per
  ``gpus_per_job`` GPUs, one process each): submitit's local executor alone would start every job at once on the same
  GPUs. Hydra only instantiates launchers from the ``hydra_plugins`` namespace package, so the registered class is the
  one-line subclass ``hydra_plugins.pixdit_sweep.LocalGPUPoolLauncher`` (src/hydra_plugins/, installed with pixdit).

Guide: docs/scaling.md. Tests: ``.venv/bin/python -m pytest tests/test_sweep.py tests/test_sweep_summary.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pixdit.errors import PixditError
from pixdit.runtime import check_compile_memory_budget, is_rank_zero

try:  # only the local_gpus launcher needs it: single runs and the sweep's pre-flight check run without it
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher
except ImportError:
    LocalLauncher = None

log = logging.getLogger(__name__)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


# ----------------------------------------------------------------------------------------------- the grid
def expand_sweep(arguments: Sequence[str], sweeper_params: dict | None = None, config_loader=None) -> list[list[str]]:
    """Every job's overrides, in launch order, the way Hydra's BasicSweeper expands them (it is what we call).

    ``arguments``: the command-line overrides (``hydra.overrides.task``), e.g. ``["attention.topk=4,8"]``;
    ``sweeper_params``: ``hydra.sweeper.params`` (sweeps written in a config file).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{key}={value}" for key, value in (sweeper_params or {}).items()] + list(arguments)
    overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(params)
    return [job for batch in BasicSweeper.split_arguments(overrides, max_batch_size=None) for job in batch]


def varying(jobs: Sequence[Sequence[str]]) -> set[str]:
    """The overrides that are not the same in every job (what names a combination)."""
    return {o for job in jobs for o in job if not all(o in other for other in jobs)}


# ----------------------------------------------------------------------------------------------- one run's check
def image_size_of(cfg: DictConfig) -> int | tuple[int, int]:
    """The image size the run trains at: ``data.resolution``, or (null) the shards' own, read as the data module does."""
    size = OmegaConf.select(cfg, "data.resolution")
    if size is None:
        from pixdit.data.datamodule import ShardDataModule

        size = ShardDataModule(root=cfg.data.root).resolution
    return size if isinstance(size, int) else tuple(size)


def check_run_config(cfg: DictConfig) -> None:
    """Raise PixditError if this run's config has a key nothing reads (``+foo=1``), a compile_memory_budget out of
    range, or its model cannot be built:
    ``DiffusionModule.from_config`` as in pixdit-train, on the ``meta`` device, so every check the model, attention
    backend and kernels make runs, in ~0.1-1 s."""
    import torch

    from pixdit.config import check_top_level_keys
    from pixdit.module import DiffusionModule

    check_top_level_keys(cfg)
    check_compile_memory_budget(cfg.compile_memory_budget)
    with torch.device("meta"):
        # compile is lazy anyway; the compiled graph is not what we check
        DiffusionModule.from_config(cfg, image_size_of(cfg), compile=False)


def check_launch_layout(cfg: DictConfig) -> None:
    """Raise PixditError if the launcher would not start the processes a run with ``trainer.devices`` needs.

    In a sweep the launcher must start one process per device: Lightning's own DDP launcher re-runs the command line
    in each extra process, which inside ``train.py -m`` (basic launcher) or a submitit job re-runs the sweep or the
    job runner instead of one run. So: the basic launcher takes one-device runs; local_gpus starts
    ``gpus_per_job`` processes; slurm starts ``tasks_per_node`` per node (Lightning checks it equals trainer.devices).
    """
    launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default=""))
    devices = OmegaConf.select(cfg, "trainer.devices", default=1)
    num_nodes = OmegaConf.select(cfg, "trainer.num_nodes", default=1)
    if launcher.endswith(".LocalGPUPoolLauncher"):
        per_job = int(cfg.hydra.launcher.gpus_per_job)
        if (devices != per_job and not (devices == "auto" and per_job == 1)) or num_nodes != 1:
            raise PixditError(
                f"trainer.devices={devices}, trainer.num_nodes={num_nodes} but hydra/launcher=local_gpus "
                f"starts gpus_per_job={per_job} processes on this machine: set trainer.devices to "
                f"the same number (and trainer.num_nodes=1)"
            )
    elif launcher.endswith(".SlurmLauncher"):
        tasks, nodes = cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.nodes
        if devices not in (tasks, "auto") or num_nodes != nodes:
            raise PixditError(
                f"trainer.devices={devices}, trainer.num_nodes={num_nodes} must match the SLURM layout "
                f"hydra.launcher.tasks_per_node={tasks} (= gpus_per_node), hydra.launcher.nodes={nodes}"
            )
    elif devices != 1 or num_nodes != 1:
        raise PixditError(
            f"trainer.devices={devices}, trainer.num_nodes={num_nodes} in a sweep: Hydra's basic "
            f"launcher runs every run as one process; use trainer.devices=1, or hydra/launcher=local_gpus "
            f"hydra.launcher.gpus_per_job=N, or hydra/launcher=slurm"
        )


def find_invalid_runs(
    jobs: Sequence[Sequence[str]],
    compose: Callable[[list[str]], DictConfig],
    check: Callable[[DictConfig], None] = check_run_config,
) -> list[tuple[list[str], str]]:
    """``(overrides, reason)`` of every job whose config does not compose or whose check raises a user error."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pixdit.module import CONFIG_SECTIONS

    checked_sections = [*CONFIG_SECTIONS, "data"]  # what check_run_config reads (data: the image size)
    invalid, seen = [], {}
    for job in jobs:
        try:
            cfg = compose(list(job))
            # Runs that differ only in keys the check does not read (trainer, callbacks, ...) are checked once.
            key = OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, checked_sections), resolve=True)
            if key not in seen:
                try:
                    check(cfg)
                    seen[key] = None
                except PixditError as error:
                    seen[key] = str(error)
            reason = seen[key]
            if reason is None and OmegaConf.select(cfg, "hydra.launcher") is not None:
                check_launch_layout(cfg)
        except (HydraException, OmegaConfBaseException, PixditError) as error:
            reason = " ".join(str(error).split())
        if reason is not None:
            invalid.append((list(job), reason))
    return invalid


def format_invalid_runs(jobs: Sequence[Sequence[str]], invalid: list[tuple[list[str], str]]) -> str:
    swept = varying(jobs)
    lines = [f"{len(invalid)} of the {len(jobs)} runs of this sweep cannot start; nothing was launched:"]
    for job, reason in invalid:
        name = " ".join(o for o in job if o in swept) or " ".join(job)
        lines.append(f"  {name}: {reason}")
    lines.append("Remove these combinations (or fix the settings) and launch again.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- Hydra callback
class SweepCallback(Callback):
    """Checks a multirun before launching it; logs the runs that failed (see module doc)."""

    def __init__(self, check_before_launch: bool = True):
        self.check_before_launch = check_before_launch

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.check_before_launch:
            return
        if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
            log.warning(
                "sweep check skipped: it knows Hydra's basic sweeper only, not %s", config.hydra.sweeper._target_
            )
            return
        from hydra.core.global_hydra import GlobalHydra

        loader = GlobalHydra.instance().hydra.config_loader
        arguments = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        params = (
            OmegaConf.to_container(config.hydra.sweeper.params, resolve=False)
            if config.hydra.sweeper.get("params")
            else None
        )
        jobs = expand_sweep(arguments, params, loader)
        started = time.perf_counter()
        invalid = find_invalid_runs(jobs, lambda job: loader.load_sweep_config(config, job))
        log.info(
            "sweep check: %d runs composed and built on the meta device in %.1f s, %d invalid",
            len(jobs),
            time.perf_counter() - started,
            len(invalid),
        )
        if invalid:
            # One message, no traceback, exit status 2: the convention of train.py for user mistakes.
            print(f"error: {format_invalid_runs(jobs, invalid)}", file=sys.stderr)
            sys.exit(2)

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if job_return.status != JobStatus.COMPLETED and config.hydra.mode == RunMode.MULTIRUN and is_rank_zero():
            error = job_return._return_value  # the exception; `.return_value` would raise it
            log.error("run %s failed (%s); the sweep goes on", " ".join(job_return.overrides or []), error)


# ----------------------------------------------------------------------------------------------- GPU pool
def visible_gpus() -> list[int]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set (integers), else every device torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip()]
    import torch

    return list(range(torch.cuda.device_count()))


def gpu_slots(gpus: Sequence[int], gpus_per_job: int) -> list[tuple[int, ...]]:
    """Disjoint groups of ``gpus_per_job`` GPUs, one job each; ``[()]`` (one job at a time, CPU) without GPUs."""
    if gpus_per_job < 1:
        raise PixditError(f"hydra.launcher.gpus_per_job must be >= 1, got {gpus_per_job}")
    if not gpus:
        return [()]
    if gpus_per_job > len(gpus):
        raise PixditError(f"hydra.launcher.gpus_per_job={gpus_per_job} but only {len(gpus)} GPUs are visible: {gpus}")
    return [tuple(gpus[i : i + gpus_per_job]) for i in range(0, len(gpus) - gpus_per_job + 1, gpus_per_job)]


class LocalGPUPool(LocalLauncher or object):  # (object: the launcher package is missing, see __init__)
    """hydra-submitit-launcher's ``LocalLauncher`` with a GPU pool: each job gets its own ``gpus_per_job`` GPUs
    (CUDA_VISIBLE_DEVICES, set by submitit's local executor); the next job starts when a GPU group is free.

    gpus:         GPU ids to use (null = all visible); gpus_per_job: GPUs per run (1 = plain single-GPU runs)
    poll_s:       how often finished jobs are looked for
    other keys:   hydra-submitit-launcher's local options (timeout_min, submitit_folder, stderr_to_stdout, ...)
    """

    def __init__(
        self, gpus: Sequence[int] | None = None, gpus_per_job: int = 1, poll_s: float = 2.0, **params: Any
    ) -> None:
        if LocalLauncher is None:
            raise PixditError(
                "hydra/launcher=local_gpus needs the hydra-submitit-launcher package, which is not installed: "
                "pip install hydra-submitit-launcher (a dependency of pixdit), or launch with another hydra/launcher"
            )
        super().__init__(**params)
        self.gpus = None if gpus is None else [int(g) for g in gpus]
        self.gpus_per_job = int(gpus_per_job)
        self.poll_s = float(poll_s)

    def __call__(self, *args: Any, **kwargs: Any):
        """Runs in each process of a job. With several processes per job, tell Lightning it was started externally
        (its documented ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` environment), as srun does on SLURM."""
        import submitit

        job = submitit.JobEnvironment()
        if job.num_tasks > 1:
            os.environ.update(
                LOCAL_RANK=str(job.local_rank),
                NODE_RANK="0",
                WORLD_SIZE=str(job.num_tasks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(20000 + int(job.job_id) % 20000),
            )
        return super().__call__(*args, **kwargs)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides

        slots = gpu_slots(visible_gpus() if self.gpus is None else self.gpus, self.gpus_per_job)
        params = self.params
        executor = submitit.LocalExecutor(folder=params["submitit_folder"])
        # One process per GPU of a run (submitit tasks; see __call__ for how Lightning learns its rank).
        executor.update_parameters(
            timeout_min=params.get("timeout_min", 60),
            tasks_per_node=self.gpus_per_job,
            stderr_to_stdout=params.get("stderr_to_stdout", False),
        )
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(
            "local GPU pool: %d jobs, %d at a time on GPUs %s; sweep dir %s",
            len(job_overrides),
            len(slots),
            [list(s) for s in slots] if slots != [()] else "none (CPU)",
            self.config.hydra.sweep.dir,
        )

        pending = list(enumerate(job_overrides))
        running: dict[tuple[int, ...], tuple[int, Any]] = {}
        results: list[JobReturn | None] = [None] * len(job_overrides)
        try:
            while pending or running:
                for slot in slots:
                    if slot in running or not pending:
                        continue
                    i, overrides = pending.pop(0)
                    executor.update_parameters(gpus_per_node=len(slot), visible_gpus=slot)
                    job = executor.submit(
                        self,
                        list(overrides),
                        "hydra.sweep.dir",
                        initial_job_idx + i,
                        f"job_id_for_{initial_job_idx + i}",
                        Singleton.get_state(),
                    )
                    log.info(
                        "\t#%d on GPUs %s: %s", initial_job_idx + i, list(slot), " ".join(filter_overrides(overrides))
                    )
                    running[slot] = (i, job)
                time.sleep(self.poll_s)
                for slot, (i, job) in list(running.items()):
                    if job.done():
                        del running[slot]
                        try:
                            results[i] = job.results()[0]
                        except Exception as error:  # the worker died (killed, out of memory, timeout): record it
                            results[i] = JobReturn(
                                overrides=list(job_overrides[i]), status=JobStatus.FAILED, _return_value=error
                            )
                            log.error("job #%d died: %s", initial_job_idx + i, str(error).splitlines()[0])
        except BaseException:
            for _, job in running.values():
                job.cancel(check=False)
            raise
        return results
