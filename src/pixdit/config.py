"""Small helpers that turn config sections into objects with clear errors for user mistakes.

* ``construct(cls, options, "callbacks.checkpoint", dirpath=...)`` calls ``cls(**options, **fixed)`` after checking
  every option name against ``cls``'s signature: an unknown key raises ``PixditError`` naming the config section and
  listing the allowed keys (instead of a bare ``TypeError`` deep inside a library), and so does a word given where
  the default is a number or a flag (``data.batch_size=abc``), and so does an old name of a renamed option (a class's
  ``renamed_options``: old key -> its replacement), naming the new key.
* ``check_top_level_keys(cfg)``: a run's config may hold only the top-level keys of configs/train.yaml (and its
  config groups); one added on the command line (``+foo=1``) would be silently ignored, so it is an error. (Keys
  inside a section are checked by ``construct`` when that section is built.)
* ``register_resolvers()`` adds ``${auto_precision:}`` for configs: ``bf16-mixed`` when a CUDA GPU is present,
  ``32-true`` otherwise (configs/trainer/auto.yaml uses it so ``experiment=quickstart`` runs on either).
"""

from __future__ import annotations

import functools
import importlib.resources
import inspect
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pixdit.errors import PixditError


def plain(options: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (resolved); anything else unchanged."""
    if isinstance(options, (DictConfig, ListConfig)):
        return OmegaConf.to_container(options, resolve=True)
    return options


def allowed_keys(cls) -> list[str]:
    params = inspect.signature(cls).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_renamed(cls, options, where: str) -> None:
    """An option that ``cls`` renamed (its ``renamed_options``: old key -> replacement) -> PixditError naming the new
    key (``where`` is the config section, e.g. ``callbacks.samples``)."""
    renamed = getattr(cls, "renamed_options", {})
    for old in options:
        if old in renamed:
            raise PixditError(f"{where}.{old} was renamed: use {where}.{renamed[old]}")


def construct(cls, options, where: str, **fixed):
    """``cls(**options, **fixed)``; unknown option names -> PixditError naming ``where`` and the allowed keys."""
    options = plain(options) or {}
    if not isinstance(options, dict):
        raise PixditError(f"{where} must be a mapping of {cls.__name__} arguments, got {options!r}")
    check_renamed(cls, options, where)
    params = inspect.signature(cls).parameters.values()
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    allowed = [k for k in allowed_keys(cls) if k not in fixed]
    clash = sorted(set(options) & set(fixed))
    if clash:
        raise PixditError(f"{where}: {clash} is set by pixdit itself and cannot be configured")
    unknown = sorted(set(options) - set(allowed))
    if unknown and not takes_kwargs:
        raise PixditError(f"unknown key(s) {unknown} in {where}; allowed keys for {cls.__name__}: {', '.join(allowed)}")
    by_name = {p.name: p for p in params}
    for key, value in options.items():
        default = by_name[key].default if key in by_name else None
        # A word where the default is a number or a flag (data.batch_size=abc): say so here, not deep inside.
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            kind = "true/false" if isinstance(default, bool) else type(default).__name__
            raise PixditError(f"{where}.{key}={value!r} must be {kind} (default: {default!r})")
    return cls(**options, **fixed)


@functools.cache
def top_level_keys() -> frozenset[str]:
    """The top-level keys of pixdit-train's config: configs/train.yaml's own keys and its config groups (``experiment``
    is a group of overrides, not a key)."""
    root = OmegaConf.create(importlib.resources.files("pixdit.configs").joinpath("train.yaml").read_text())
    groups = {next(iter(entry)) for entry in root.defaults if isinstance(entry, DictConfig)}
    return frozenset((set(root) | groups) - {"defaults", "hydra", "experiment"})


def check_top_level_keys(cfg) -> None:
    """PixditError for a top-level key that pixdit-train does not read (see the module doc)."""
    known = top_level_keys()
    unknown = sorted(set(cfg) - known - {"hydra"})
    if unknown:
        raise PixditError(
            f"unknown config key(s) {', '.join(unknown)} (added with +KEY=...): nothing reads them. "
            f"Top-level keys: {', '.join(sorted(known))}; a section's own keys are listed when one is "
            f"unknown (e.g. +model.depth=2)"
        )


def auto_precision() -> str:
    import torch

    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("auto_precision"):
        OmegaConf.register_new_resolver("auto_precision", auto_precision)
