"""The interface every attention backend implements, the name registry, and `build_attention`.

Every attention layer of the DiT owns one backend, built from `configs/attention/<name>.yaml`:

    name: full        # selects the registered class
    kernel: sdpa      # every other key is a constructor option of that class

    >>> from pixdit.attention import build_attention
    >>> backend = build_attention({"name": "full", "kernel": "sdpa"}, dim=384, num_heads=6)
    >>> out = backend(q, k, v, grid_hw=(64, 64), hidden=h)    # q, k, v: [batch, heads, tokens, head_dim]

A new method is one module in this package with one class (`@register_attention("mine")`, a subclass of
`AttentionBackend`), imported by `pixdit/attention/__init__.py`, plus one config file.
Tests: ``.venv/bin/python -m pytest tests/test_attention.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pixdit.config import construct, plain
from pixdit.errors import PixditError

_BACKENDS: dict[str, type[AttentionBackend]] = {}


class AttentionBackend(nn.Module):
    """One attention layer's q, k, v -> output map. Subclasses take ``(dim, num_heads, **options)``.

    ``token_order``: the order the backend needs the tokens in ("zorder" for the block-sparse methods, whose blocks of
    consecutive tokens must be square patches); None = any order (``model.token_order: auto`` then picks raster).
    ``renamed_options``: old config keys -> what replaced them; building with an old key is an error naming the new
    one.
    """

    name: str = ""
    token_order: str | None = None
    renamed_options: dict[str, str] = {}

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise PixditError(f"hidden size {dim} is not divisible by num_heads={num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads

    def reset_parameters(self) -> None:
        """Initialise the backend's own parameters (VSA's gates, SLA's projection). Subclasses with parameters call it
        at the end of ``__init__``; the model calls it again after its own initialisation (which re-initialises every
        ``nn.Linear``), so the methods keep the initialisation they require."""

    def check_grid(self, grid_hw: tuple[int, int]) -> None:
        """Raise PixditError (naming the grid and the violated number) if this backend cannot handle the token grid."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, grid_hw: tuple[int, int],
                hidden: torch.Tensor) -> torch.Tensor:
        """q, k, v: [batch, heads, tokens, head_dim] after qk-norm and RoPE, in the model's token order.
        hidden: [batch, tokens, dim], the modulated hidden states that fed the qkv projection.
        Returns [batch, heads, tokens, head_dim]."""
        raise NotImplementedError


def register_attention(name: str):
    """Class decorator: make an AttentionBackend subclass buildable as ``attention.name=<name>``."""

    def decorator(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is registered twice ({_BACKENDS[name]} and {cls})")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorator


def attention_names() -> list[str]:
    return sorted(_BACKENDS)


def attention_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise PixditError(f"attention name={name!r} is not known; available: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


def attention_options(cfg: Mapping[str, Any] | str | None) -> tuple[str, dict[str, Any]]:
    """Split an attention config into (name, constructor options). Accepts a dict, an OmegaConf node or a bare name."""
    if cfg is None:
        return "full", {}
    if isinstance(cfg, str):
        return cfg, {}
    cfg = plain(cfg)
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise PixditError(f"attention config must be a mapping with a 'name' key, got {cfg!r}")
    options = {key: value for key, value in cfg.items() if key != "name"}
    return str(cfg["name"]), options


def build_attention(cfg: Mapping[str, Any] | str | None, dim: int, num_heads: int) -> AttentionBackend:
    """Build one backend from its config (``name`` selects the class, the other keys are its options)."""
    name, options = attention_options(cfg)
    cls = attention_class(name)
    for old in options:
        if old in cls.renamed_options:
            raise PixditError(f"attention.{old} (attention={name}) was renamed: "
                              f"use attention.{cls.renamed_options[old]}")
    return construct(cls, options, "attention", dim=dim, num_heads=num_heads)


def check_kernel_options(backend_name: str, head_dim: int, block_size, call: Callable[[torch.Tensor], Any]) -> None:
    """Validate a backend's options once at build time by running its kernel on a tiny CPU input (the kernels own
    the rules: allowed block sizes, head dims, K, scopes...); their ValueError/TypeError becomes a PixditError."""
    x = torch.zeros(1, 1, block_size if isinstance(block_size, int) and block_size > 0 else 1, head_dim,
                    device="cpu")
    try:
        call(x)
    except (ValueError, TypeError) as error:
        raise PixditError(f"attention={backend_name}: {error}") from None


def uninitialized_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` for a backend's ``reset_parameters`` to fill. ``skip_init`` skips nn.Linear's own random
    init, so building it draws nothing from the random stream (the rest of the model initialises as without it)."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, device=torch.get_default_device())
