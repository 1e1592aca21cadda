"""Attention variants as typed on a benchmark's command line: ``NAME[:KEY=VALUE,...]``, e.g. ``llsa:num_levels=2``.

    from pixdit.attention.variants import parse_variant
    variant = parse_variant("llsa:num_levels=2,topk=16")   # .attention: the config section, .token_order

The options start from ``configs/attention/NAME.yaml`` (the package ``pixdit.configs``) and are checked by building
the backend once, so an unknown key or a bad value stops a benchmark before anything is timed, with a message that
names the variant. Used by ``scripts/bench_train.py`` and ``scripts/bench_sampling.py``.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import yaml

from pixdit.attention.base import build_attention
from pixdit.errors import PixditError

__all__ = [
    "Variant",
    "add_block_means_option",
    "block_means_settings",
    "parse_variant",
    "read_options",
    "split_options",
    "switch_settings",
]

PROBE_DIMS = dict(dim=128, num_heads=2)  # the variants' options are checked on a backend of this size


@dataclass
class Variant:
    label: str  # as typed on the command line, e.g. "llsa:num_levels=2"
    attention: dict  # the attention config section: {"name": ..., options...}
    token_order: str  # what the backend needs ("zorder" for the block-sparse methods), else "raster"
    block_means: bool = False  # the backend takes block means of q, k, v from the model (AttentionBackend.pool_block)
    v_view: bool = False  # in sampling, the backend reads v as a view of qkv (AttentionBackend.reads_v_view)


def split_options(text: str) -> list[str]:
    """'a=1,b=[8,4]' -> ['a=1', 'b=[8,4]']: commas inside brackets belong to a list value."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def read_options(spec: str, what: str, example: str) -> tuple[str, dict]:
    """``NAME[:KEY=VALUE,...]`` -> (NAME, {KEY: VALUE}) with the values read as YAML; ``what`` names the flag."""
    name, _, text = spec.partition(":")
    options = {}
    for item in split_options(text):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise PixditError(f"{what} {spec}: '{item}' is not KEY=VALUE (e.g. {example})")
        options[key.strip()] = yaml.safe_load(value)
    return name, options


def parse_variant(spec: str) -> Variant:
    """``NAME[:KEY=VALUE,...]`` -> Variant, checked by building the backend once (``build_attention``)."""
    name, options = read_options(spec, "--attention", "llsa:num_levels=2,topk=16")
    config_file = importlib.resources.files("pixdit.configs").joinpath("attention", f"{name}.yaml")
    attention = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {"name": name}
    attention.update(options)
    try:
        backend = build_attention(attention, **PROBE_DIMS)
    except PixditError as error:
        raise PixditError(f"--attention {spec}: {error}") from None
    return Variant(
        spec, attention, backend.token_order or "raster", backend.pool_block is not None, backend.reads_v_view
    )


def add_block_means_option(parser) -> None:
    """The bench scripts' ``--means prologue|backend|both``: where a backend that takes block means of q, k, v
    (``Variant.block_means``) gets them (``pixdit.models.dit.Attention.fuse_block_means``), or both as an A/B."""
    parser.add_argument(
        "--means",
        default="prologue",
        choices=["prologue", "backend", "both"],
        help="the block means of q, k, v of LLSA, VSA and SLA (blocks of 16): from the qk-norm + RoPE kernel, pooled "
        "by the attention backend itself, or both, one row each (an A/B in one process)",
    )


def switch_settings(choice: str, values: tuple[str, str], applies: bool) -> list[str]:
    """The settings of an A/B switch of the bench scripts (e.g. ``--means prologue|backend|both``) that a variant runs
    with: both ``values`` for ``both`` where the switch ``applies`` to its backend, else one (it would change
    nothing)."""
    settings = list(values) if choice == "both" else [choice]
    return settings if applies else settings[:1]


def block_means_settings(choice: str, variant: Variant) -> list[str]:
    """The ``--means`` settings ``variant`` runs with (``switch_settings``; the switch applies where its backend
    takes block means)."""
    return switch_settings(choice, ("prologue", "backend"), variant.block_means)
