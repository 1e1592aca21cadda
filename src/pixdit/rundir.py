"""Run directories: one process at a time, never silently reused, and a record of how each run ended.

* ``RunDirectory``: a Hydra callback (listed under ``hydra.callbacks`` in configs/train.yaml). Before Hydra writes
  anything into a run's directory (``on_run_start``; for a sweep ``on_multirun_start`` for the sweep directory and
  ``on_job_start`` for each job's) it calls ``claim_run_directory``, which
    - takes the directory's lock (``pixdit.files.exclusive_lock`` on ``<run dir>/.pixdit.lock``, held until the run
      ends; the kernel drops it if the process dies): a second pixdit-train into the same directory stops with one
      message naming the first (pid, host, start time, command);
    - refuses a fresh run (no ``ckpt_path``, or ``auto`` where there is no checkpoint) into a directory that holds
      an earlier run's results, naming the two ways out (``ckpt_path=last`` to resume that run, another
      ``hydra.run.dir``), unless ``overwrite=true``, which deletes those results first (only what a run writes:
      checkpoints/, samples/, metrics.csv, ...; nothing else).
  Only the first process of a job does this (``pixdit.runtime.is_rank_zero``): the other ranks of a multi-GPU run
  write into the directory the first one holds.
* ``write_status(run_dir, status, ...)``: ``<run dir>/status.json`` = {"status": "ok" | "failed" | "preempted" |
  "interrupted", "global_step", "error", ...}, written atomically by pixdit-train when a run ends, however it ends;
  scripts/summarize_sweep.py reads it (a run without one is still running or was killed).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pixdit.errors import PixditError
from pixdit.files import exclusive_lock, write_json
from pixdit.runtime import is_rank_zero

LOCK_NAME = ".pixdit.lock"
STATUS_NAME = "status.json"
# What a run writes into its directory besides Hydra's .hydra/ and job log: an earlier run's results, which a fresh
# run would mix with its own (and overwrite=true deletes). Patterns for Path.glob.
RESULTS = (
    "checkpoints",
    "samples",
    "metrics.csv",
    "hparams.yaml",
    "resumed_*",
    "tensorboard",
    "wandb",
    "eval",
    STATUS_NAME,
)


def is_fresh_run(ckpt_path: str | None, run_dir: str | Path) -> bool:
    """Whether a run with this ``ckpt_path`` starts from scratch in ``run_dir``: no ``ckpt_path``, or ``auto`` (resume
    when the run directory has a checkpoint: what a requeued job passes) in a directory without one."""
    if ckpt_path is None:
        return True
    return ckpt_path == "auto" and not any((Path(run_dir) / "checkpoints").glob("*.ckpt"))


def earlier_results(run_dir: str | Path) -> list[Path]:
    """The results of an earlier run in ``run_dir`` (see RESULTS); [] for a new, empty or only-configured directory
    (a run that stopped at a config mistake leaves only .hydra/, its log and a "failed" status.json)."""
    run_dir = Path(run_dir)
    found = sorted({path for pattern in RESULTS for path in run_dir.glob(pattern)})
    status = run_dir / STATUS_NAME
    if found == [status] and _read_status(status).get("global_step") in (None, 0):
        return []  # nothing was trained there
    return found


def claim_run_directory(
    run_dir: str | Path, fresh: bool, overwrite: bool = False, setting: str = "hydra.run.dir"
) -> contextlib.ExitStack:
    """Lock ``run_dir`` for this process and, for a ``fresh`` run (not a resume), check that no earlier run's results
    are there (see the module doc; ``setting`` names the option that chose the directory). Returns the lock's
    ExitStack: closing it (or the process ending) releases the directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    held = contextlib.ExitStack()
    held.enter_context(
        exclusive_lock(
            run_dir / LOCK_NAME,
            what=f"the run directory {run_dir}",
            fix=f"wait for that run to end, or give this one another {setting}=DIR",
        )
    )
    try:
        results = earlier_results(run_dir) if fresh else []
        if results and not overwrite:
            names = ", ".join(p.name for p in results[:6]) + (", ..." if len(results) > 6 else "")
            raise PixditError(
                f"the run directory {run_dir} already holds a run ({names}). To continue that run add "
                f"ckpt_path=last; to start a new one use another {setting}=DIR (or leave it out for a "
                f"new timestamped directory); overwrite=true deletes that run's results first"
            )
        for path in results:  # overwrite=true
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except BaseException:
        held.close()
        raise
    return held


def write_status(run_dir: str | Path, status: str, error: BaseException | None = None, **extra: Any) -> Path:
    """``<run_dir>/status.json`` = {"status": status, **extra, ["error", "traceback"]}, written atomically."""
    record = {"status": status, **extra}
    if error is not None:
        record["error"] = f"{type(error).__name__}: {error}"
        record["traceback"] = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
    path = Path(run_dir) / STATUS_NAME
    write_json(path, record, indent=2)
    return path


def _read_status(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


class RunDirectory(Callback):
    """The Hydra side of ``claim_run_directory`` (see the module doc): claims each run's directory before Hydra
    writes into it, and keeps the lock until the run ends. A refusal is one message and exit status 2."""

    def __init__(self) -> None:
        self._held: contextlib.ExitStack | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if is_rank_zero():
            # hydra.run.dir's ${now:...} is resolved once per process (cached): this is the directory Hydra will use.
            run_dir = str(config.hydra.run.dir)
            self._claim(
                run_dir,
                fresh=is_fresh_run(OmegaConf.select(config, "ckpt_path"), run_dir),
                overwrite=bool(OmegaConf.select(config, "overwrite")),
            )

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._release()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep into a directory that already holds runs: the same check as for one run, for every job folder."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not is_rank_zero() or OmegaConf.select(config, "ckpt_path") is not None or not sweep_dir.is_dir():
            return
        for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()):
            try:
                claim_run_directory(
                    job_dir,
                    fresh=True,
                    overwrite=bool(OmegaConf.select(config, "overwrite")),
                    setting="hydra.sweep.dir",
                ).close()
            except PixditError as error:
                self._fail(str(error))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN and is_rank_zero():
            # the sweep directory was checked in on_multirun_start; each job takes its own folder's lock
            self._claim(str(config.hydra.runtime.output_dir), fresh=False, overwrite=False)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            self._release()

    def _claim(self, run_dir: str, fresh: bool, overwrite: bool) -> None:
        try:
            self._held = claim_run_directory(run_dir, fresh, overwrite)
        except PixditError as error:
            self._fail(str(error))

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    @staticmethod
    def _fail(message: str) -> None:
        # Hydra would print a callback's exception with its traceback: one message and exit status 2 instead.
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
