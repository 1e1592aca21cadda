"""Attention backends: the interface every attention method implements, the name registry, and `full` attention.

Every attention layer of the DiT owns one backend, built from `configs/attention/<name>.yaml`:

    name: full      # selects the registered class below
    impl: sdpa      # every other key is a constructor option of that class

    >>> from pixdit.attention import build_attention
    >>> backend = build_attention({"name": "full", "impl": "sdpa"}, dim=384, num_heads=6)
    >>> out = backend(q, k, v, grid_hw=(64, 64), hidden=h)    # q, k, v: [batch, heads, tokens, head_dim]

A new method is one class (`@register_attention("mine")`, subclass of `AttentionBackend`) plus one config file.
The sparse methods (llsa, vsa, sla) live in `pixdit.attention_sparse`.
Tests: ``.venv/bin/python -m pytest tests/test_attention.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pixdit.errors import PixditError

_BACKENDS: dict[str, type[AttentionBackend]] = {}


class AttentionBackend(nn.Module):
    """One attention layer's q, k, v -> output map. Subclasses take ``(dim, num_heads, **options)``.

    ``token_order``: the order the backend needs the tokens in ("zorder" for the block-sparse methods, whose blocks of
    consecutive tokens must be square patches); None means any order works. The model checks it at build time.
    """

    name: str = ""
    token_order: str | None = None

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise PixditError(f"hidden size {dim} is not divisible by num_heads={num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads

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
    _import_sparse_backends()
    return sorted(_BACKENDS)


def _import_sparse_backends() -> None:
    # attention_sparse imports this module, so it is imported here, on first use, to fill the registry.
    import pixdit.attention_sparse  # noqa: F401


def attention_options(cfg: Mapping[str, Any] | str | None) -> tuple[str, dict[str, Any]]:
    """Split an attention config into (name, constructor options). Accepts a dict, an OmegaConf node or a bare name."""
    if cfg is None:
        return "full", {}
    if isinstance(cfg, str):
        return cfg, {}
    try:  # an OmegaConf DictConfig: resolve interpolations and turn ListConfigs into lists
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency, but the model itself does not need it
        pass
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise PixditError(f"attention config must be a mapping with a 'name' key, got {cfg!r}")
    options = {key: value for key, value in cfg.items() if key != "name"}
    return str(cfg["name"]), options


def build_attention(cfg: Mapping[str, Any] | str | None, dim: int, num_heads: int) -> AttentionBackend:
    """Build one backend from its config (``name`` selects the class, the other keys are its options)."""
    name, options = attention_options(cfg)
    _import_sparse_backends()
    if name not in _BACKENDS:
        raise PixditError(f"attention name={name!r} is not known; available: {', '.join(sorted(_BACKENDS))}")
    cls = _BACKENDS[name]
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "dim", "num_heads")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise PixditError(f"attention '{name}' got unknown option(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(['name'] + allowed)}")
    return cls(dim, num_heads, **options)


FULL_ATTENTION_IMPLS = ("sdpa", "triton")


@register_attention("full")
class FullAttention(AttentionBackend):
    """Dense softmax attention over all tokens (scale 1/sqrt(head_dim)), in any token order.

    impl: "sdpa"   torch.nn.functional.scaled_dot_product_attention (FlashAttention / cuDNN / efficient on GPU)
          "triton" pixdit.kernels.flash_attention (our Triton kernel)
    """

    def __init__(self, dim: int, num_heads: int, impl: str = "sdpa"):
        super().__init__(dim, num_heads)
        if impl not in FULL_ATTENTION_IMPLS:
            raise PixditError(f"attention.impl={impl!r} is not known; "
                              f"allowed values: {', '.join(FULL_ATTENTION_IMPLS)}")
        self.impl = impl
        self._flash_attention = _import_flash_attention() if impl == "triton" else None

    def forward(self, q, k, v, *, grid_hw, hidden):
        if self._flash_attention is not None:
            return self._flash_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


def _import_flash_attention():
    try:
        from pixdit.kernels import flash_attention
    except ImportError as error:
        raise PixditError(f"attention.impl=triton needs pixdit.kernels.flash_attention, which is not available "
                          f"({error}); use attention.impl=sdpa") from None
    return flash_attention
