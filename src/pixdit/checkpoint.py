"""Checkpoint files: crash-safe writes, the EMA artifact next to every checkpoint, and loading model weights back.

* ``atomic_torch_save(obj, path)``: the object is streamed into a temporary file next to ``path`` and renamed over it
  (``pixdit.files.atomic_write``: fsync of the file and of the directory), so a kill at any moment leaves either the
  old checkpoint or the new one at ``path``, never a partial one. (Lightning's own writer first serialises the whole
  checkpoint into memory and does not fsync.)
* The EMA artifact: next to each training checkpoint ``step=N.ckpt`` / ``last.ckpt`` (``pixdit.callbacks.
  AtomicCheckpointIO`` writes both), ``step=N.ema.pt`` / ``last.ema.pt`` holds what sampling needs and nothing else:
  the EMA weights, the model / attention / flow config, the image size and the step (``ema_artifact``). A few
  percent of the checkpoint's size (no raw weights, no optimizer state) and plain tensors and values, so it loads with
  ``torch.load(weights_only=True)``.
* ``load_weights(path, use_ema)``: the weights that pixdit-evaluate and ``init_from`` use, from the EMA artifact when
  there is one, else from a full training checkpoint (older runs), loaded with ``weights_only=True`` where possible.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pixdit.errors import PixditError
from pixdit.files import atomic_write

EMA_SUFFIX = ".ema.pt"
EMA_FORMAT = "pixdit-ema"
EMA_VERSION = 1
EMA_PREFIX, RAW_PREFIX = "ema.model.", "model."  # DiffusionModule's state_dict keys of the two copies of the model


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    with atomic_write(path) as f:
        torch.save(obj, f)


def ema_path(checkpoint_path: str | os.PathLike) -> Path:
    """``<dir>/step=N.ckpt`` -> ``<dir>/step=N.ema.pt`` (an artifact path is returned unchanged)."""
    path = Path(checkpoint_path)
    if path.name.endswith(EMA_SUFFIX):
        return path
    return path.with_name(path.name.removesuffix(".ckpt") + EMA_SUFFIX)


def ema_artifact(checkpoint: dict) -> dict | None:
    """The EMA artifact of a DiffusionModule training checkpoint (a Lightning checkpoint dict); None for a checkpoint
    without EMA weights or without the module's hyper-parameters."""
    state = checkpoint.get("state_dict") or {}
    hyper = checkpoint.get("hyper_parameters") or {}
    weights = {k[len(EMA_PREFIX):]: v for k, v in state.items() if k.startswith(EMA_PREFIX)}
    if not weights or "model" not in hyper or "image_size" not in hyper:
        return None
    return {"format": EMA_FORMAT, "version": EMA_VERSION, "global_step": int(checkpoint.get("global_step", -1)),
            "config": {"model": hyper["model"], "attention": hyper.get("attention") or {"name": "full"},
                       "flow": hyper.get("flow") or {}, "image_size": [int(s) for s in hyper["image_size"]]},
            "state_dict": weights}


@dataclass
class Weights:
    """Model weights read back from a checkpoint file (``load_weights``)."""

    state_dict: dict[str, torch.Tensor]  # the model's own parameter names (no "ema.model." / "model." prefix)
    source: str                          # "ema" or "raw"
    path: Path                           # the file they were read from
    global_step: int                     # -1 when the file does not say
    config: dict | None                  # model, attention, flow, image_size (None: no hyper-parameters in the file)


def load_weights(path: str | os.PathLike, use_ema: bool = True, key: str = "ckpt") -> Weights:
    """The EMA weights (``use_ema``; the raw ones if the file has no EMA) or the raw training weights of a run.

    ``path``: an EMA artifact ``X.ema.pt``, or a training checkpoint ``X.ckpt`` (its ``X.ema.pt`` is read instead
    when there is one and ``use_ema``). ``key`` names the config key in error messages.
    """
    path = Path(path)
    artifact = ema_path(path)
    if use_ema and artifact.is_file():
        stored = torch.load(artifact, map_location="cpu", weights_only=True)
        if stored.get("format") != EMA_FORMAT:
            raise PixditError(f"{key}={str(path)!r}: {artifact} is not a pixdit EMA artifact")
        return Weights(stored["state_dict"], "ema", artifact, int(stored["global_step"]), stored["config"])
    if path == artifact:  # an EMA artifact that cannot serve: missing, or the raw weights were asked for
        if not path.is_file():
            raise PixditError(f"{key}={str(path)!r}: no such file")
        raise PixditError(f"{key}={str(path)!r} holds only the EMA weights; the raw weights are in the training "
                          f"checkpoint {path.name.removesuffix(EMA_SUFFIX)}.ckpt next to it")
    if not path.is_file():
        raise PixditError(f"{key}={str(path)!r}: no such checkpoint file (give a .ckpt or .ema.pt file, or a run "
                          f"directory with checkpoints/last.ckpt)")
    checkpoint = _load_checkpoint(path)
    state = checkpoint.get("state_dict", checkpoint)
    prefix = EMA_PREFIX if use_ema and any(k.startswith(EMA_PREFIX) for k in state) else RAW_PREFIX
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise PixditError(f"{key}={str(path)!r} holds no pixdit model weights (keys 'model.*' / 'ema.model.*')")
    artifact = ema_artifact(checkpoint)
    return Weights(weights, "ema" if prefix == EMA_PREFIX else "raw", path, int(checkpoint.get("global_step", -1)),
                   artifact["config"] if artifact else None)


def _load_checkpoint(path: Path) -> dict:
    """A full training checkpoint: ``weights_only=True`` (pixdit's checkpoints hold tensors and plain values only);
    a file that needs pickle's full power (made by an older version) is loaded anyway, with a warning."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        warnings.warn(f"{path} cannot be loaded with weights_only=True ({str(error).splitlines()[0]}); loading it with "
                      f"weights_only=False, which runs code stored in the file: only do this for files you trust",
                      stacklevel=3)
        return torch.load(path, map_location="cpu", weights_only=False)
