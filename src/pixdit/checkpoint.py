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
  Weights that hold NaN or inf (a run that had diverged) are refused.
* Resuming (pixdit-train's ``ckpt_path``): ``read_checkpoint`` checks that a file is a whole, readable checkpoint
  without reading its tensors (memory-mapped), ``newest_intact_checkpoint`` finds the newest one of a run to fall back
  on, and ``check_same_model`` says which model / attention setting differs when the weights cannot be loaded.
* ``nonfinite_tensors``: the floating-point entries of a state dict that hold NaN or inf; the checkpoint writer
  (``pixdit.callbacks.AtomicCheckpointIO``) refuses to write such weights over a good checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
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


CHECKPOINT_SUFFIX = ".ckpt"


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
    weights = {k[len(EMA_PREFIX) :]: v for k, v in state.items() if k.startswith(EMA_PREFIX)}
    if not weights or "model" not in hyper or "image_size" not in hyper:
        return None
    return {
        "format": EMA_FORMAT,
        "version": EMA_VERSION,
        "global_step": int(checkpoint.get("global_step", -1)),
        "config": {
            "model": hyper["model"],
            "attention": hyper.get("attention") or {"name": "full"},
            "flow": hyper.get("flow") or {},
            "image_size": [int(s) for s in hyper["image_size"]],
        },
        "state_dict": weights,
    }


@dataclass
class Weights:
    """Model weights read back from a checkpoint file (``load_weights``)."""

    state_dict: dict[str, torch.Tensor]  # the model's own parameter names (no "ema.model." / "model." prefix)
    source: str  # "ema" or "raw"
    path: Path  # the file they were read from
    global_step: int  # -1 when the file does not say
    config: dict | None  # model, attention, flow, image_size (None: no hyper-parameters in the file)


def load_weights(path: str | os.PathLike, use_ema: bool = True, key: str = "ckpt") -> Weights:
    """The EMA weights (``use_ema``; the raw ones if the file has no EMA) or the raw training weights of a run.

    ``path``: an EMA artifact ``X.ema.pt``, or a training checkpoint ``X.ckpt`` (its ``X.ema.pt`` is read instead
    when there is one and ``use_ema``). ``key`` names the config key in error messages.
    """
    path = Path(path)
    artifact = ema_path(path)
    if use_ema and artifact.is_file():
        stored = _load(artifact, key, path)
        if not isinstance(stored, dict) or stored.get("format") != EMA_FORMAT:
            raise PixditError(f"{key}={str(path)!r}: {artifact} is not a pixdit EMA artifact")
        return _finite(
            Weights(stored["state_dict"], "ema", artifact, int(stored["global_step"]), stored["config"]), key
        )
    if path == artifact:  # an EMA artifact that cannot serve: missing, or the raw weights were asked for
        if not path.is_file():
            raise PixditError(f"{key}={str(path)!r}: no such file")
        raise PixditError(
            f"{key}={str(path)!r} holds only the EMA weights; the raw weights are in the training "
            f"checkpoint {path.name.removesuffix(EMA_SUFFIX)}.ckpt next to it"
        )
    if not path.is_file():
        raise PixditError(
            f"{key}={str(path)!r}: no such checkpoint file (give a .ckpt or .ema.pt file, or a run "
            f"directory with checkpoints/last.ckpt)"
        )
    checkpoint = _load_checkpoint(path, key)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else {}
    prefix = EMA_PREFIX if use_ema and any(k.startswith(EMA_PREFIX) for k in state) else RAW_PREFIX
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not weights:
        raise PixditError(f"{key}={str(path)!r} holds no pixdit model weights (keys 'model.*' / 'ema.model.*')")
    artifact = ema_artifact(checkpoint)
    return _finite(
        Weights(
            weights,
            "ema" if prefix == EMA_PREFIX else "raw",
            path,
            int(checkpoint.get("global_step", -1)),
            artifact["config"] if artifact else None,
        ),
        key,
    )


def _finite(weights: Weights, key: str) -> Weights:
    bad = nonfinite_tensors(weights.state_dict)
    if bad:
        raise PixditError(
            f"{key}={str(weights.path)!r}: the {weights.source} weights hold NaN or inf values "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): the run had diverged when this "
            f"checkpoint was written; use an earlier checkpoint of the run"
        )
    return weights


ANOTHER_CHECKPOINT = "give another checkpoint of the run (<run dir>/checkpoints/step=N.ckpt)"


def _unreadable(
    path: Path, key: str, error: BaseException, named: Path | None = None, fix: str = ANOTHER_CHECKPOINT
) -> PixditError:
    reason = (str(error).strip().splitlines() or [""])[0].split(". ")[0][:120]  # torch's first sentence
    named = named or path
    where = "" if named == path else f" ({path} next to it)"
    return PixditError(
        f"{key}={str(named)!r}: cannot read the checkpoint{where}: it is cut short, damaged or not a "
        f"checkpoint ({type(error).__name__}: {reason}){'; ' + fix if fix else ''}"
    )


def _load(path: Path, key: str, named: Path | None = None):
    """``torch.load(weights_only=True)``; a file that cannot be read is one PixditError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a damaged file; all mean the same here
        raise _unreadable(path, key, error, named) from None


def _load_checkpoint(path: Path, key: str) -> dict:
    """A full training checkpoint: ``weights_only=True`` (pixdit's checkpoints hold tensors and plain values only);
    a file that needs pickle's full power (made by an older version) is loaded anyway, with a warning."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_error = error
    except Exception as error:  # noqa: BLE001 - cut short, not a zip / pickle at all: unreadable either way
        raise _unreadable(path, key, error) from None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - not an older pickle either: the first error says more
        raise _unreadable(path, key, first_error) from None
    warnings.warn(
        f"{path} cannot be loaded with weights_only=True ({str(first_error).splitlines()[0]}); loaded it "
        f"with weights_only=False, which runs code stored in the file: only do this for files you trust",
        stacklevel=3,
    )
    return checkpoint


def nonfinite_tensors(state_dict: dict) -> list[str]:
    """Names of the floating-point tensors of ``state_dict`` that hold a NaN or an inf (one device sync)."""
    names = [
        name for name, value in state_dict.items() if isinstance(value, torch.Tensor) and value.is_floating_point()
    ]
    if not names:
        return []
    finite = torch.stack([torch.isfinite(state_dict[name]).all().cpu() for name in names])
    return [name for name, ok in zip(names, finite.tolist()) if not ok]


# ------------------------------------------------------------------------------------------------- resuming
def read_checkpoint(path: str | os.PathLike, key: str = "ckpt_path") -> dict:
    """The contents of a training checkpoint, with the tensors memory-mapped (``torch.load(mmap=True)``): the archive
    and every record but the tensor bytes are read, so a file cut short, damaged or not a checkpoint at all is found
    in a fraction of a second even for a large run. Such a file is one PixditError naming ``key``."""
    path = Path(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - see _load
        raise _unreadable(path, key, error, fix="") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        raise PixditError(
            f"{key}={str(path)!r} is not a training checkpoint of pixdit-train (no state_dict / "
            f"global_step); resume from <run dir>/checkpoints/last.ckpt or step=N.ckpt"
        )
    return checkpoint


def newest_intact_checkpoint(directory: str | os.PathLike, exclude: tuple[Path, ...] = ()) -> tuple[Path, int] | None:
    """The readable training checkpoint (``*.ckpt``) of ``directory`` with the highest step, and that step; None if
    there is none. Checkpoints are ordered by the step stored in them, not by name or time (a copied run directory
    has new modification times)."""
    found = []
    for path in Path(directory).glob(f"*{CHECKPOINT_SUFFIX}"):
        if path in exclude:
            continue
        try:
            step = int(read_checkpoint(path)["global_step"])
        except PixditError:
            continue
        # step=N.ckpt before last.ckpt at the same step: the step file is never overwritten later.
        found.append((step, re.fullmatch(r"step=\d+\.ckpt", path.name) is not None, path))
    if not found:
        return None
    step, _, path = max(found)
    return path, step


def check_same_model(
    path: str | os.PathLike, checkpoint: dict, own_state: dict, own_hparams: dict, key: str = "ckpt_path"
) -> list[str]:
    """Check that a run may resume from ``checkpoint`` (read_checkpoint of ``path``): ``own_state`` / ``own_hparams``
    are the state_dict and hyper-parameters of the module about to load it. Another model or attention (``name``), or
    weights that do not fit, are one PixditError naming the settings that differ. Returns the other model / attention /
    image-size settings that differ (e.g. attention.topk; allowed, and worth a warning)."""
    hyper = checkpoint.get("hyper_parameters") or {}
    differ = []
    for section in ("model", "attention"):
        old, new = hyper.get(section) or {}, own_hparams.get(section) or {}
        differ += [
            f"{section}.{k}={_shown(new.get(k))} (checkpoint: {_shown(old.get(k))})"
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)
        ]
    if hyper.get("image_size") is not None and list(hyper["image_size"]) != list(own_hparams.get("image_size") or []):
        differ.append(
            f"image size {list(own_hparams.get('image_size') or [])} (checkpoint: {list(hyper['image_size'])})"
        )
    saved = checkpoint["state_dict"]
    unfit = [
        f"{k}: {tuple(saved[k].shape)} in the checkpoint vs {tuple(v.shape)} here"
        for k, v in own_state.items()
        if k in saved and hasattr(v, "shape") and tuple(saved[k].shape) != tuple(v.shape)
    ]
    unfit += [f"{k} is not in the checkpoint" for k in own_state if k not in saved]
    unfit += [f"{k} is not in this model" for k in saved if k not in own_state]
    renamed = [d for d in differ if d.startswith(("model.name=", "attention.name="))]
    if unfit or renamed:
        named = renamed or differ[:6]
        raise PixditError(
            f"{key}={str(path)!r} is a run of another model: this run has "
            f"{', '.join(named) or 'other weights'}{' (' + '; '.join(unfit[:3]) + ')' if unfit else ''}. "
            f"Resume with the run's own model and attention settings (its .hydra/config.yaml), or start "
            f"a new run from its weights with init_from={path}"
        )
    return differ


def _shown(value) -> str:
    return "unset" if value is None else repr(value)
