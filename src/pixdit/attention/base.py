"""The interface every attention backend implements, the name registry, and `build_attention`.

Every attention layer of the DiT owns one backend, built from `configs/attention/<name>.yaml`:

    name: full        # selects the registered class
    kernel: sdpa      # every other key is a constructor option of that class

    >>> from pixdit.attention import build_attention
    >>> backend = build_attention({"name": "full", "kernel": "sdpa"}, dim=384, num_heads=6)
    >>> out = backend(q, k, v, grid_hw=(64, 64), hidden=h)    # q, k, v: [batch, heads, tokens, head_dim]

A new method is one module in this package with one class (`@register_attention("mine")`, a subclass of
`AttentionBackend`), imported by `pixdit/attention/__init__.py`, plus one config file.

Per-layer schedule: `dense_blocks: [0, 11]` in the attention config keeps full attention in those blocks of the model
and the configured backend in the others (`block_attention_configs`; it is the model's setting, not a backend option).
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

# The attention config's key for the per-layer schedule: read by the model (block_attention_configs), never passed to
# a backend's constructor.
DENSE_BLOCKS_KEY = "dense_blocks"


class AttentionBackend(nn.Module):
    """One attention layer's q, k, v -> output map. Subclasses take ``(dim, num_heads, **options)``.

    ``token_order``: the order the backend needs the tokens in ("zorder" for the block-sparse methods, whose blocks of
    consecutive tokens must be square patches); None = any order (``model.token_order: auto`` then picks raster).
    ``renamed_options``: old config keys -> what replaced them; building with an old key is an error naming the new
    one (``config.construct`` checks it).
    """

    name: str = ""
    token_order: str | None = None
    renamed_options: dict[str, str] = {}
    head_dims: tuple[int, ...] | None = None  # the head dims the backend's kernels take (None: any)
    pool_block: int | None = None  # see forward's ``means``
    reads_v_view: bool = False  # see forward's ``v``

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise PixditError(f"hidden size {dim} is not divisible by num_heads={num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        if self.head_dims is not None:
            check_head_dim(self.name, dim, num_heads, self.head_dims)

    def reset_parameters(self) -> None:
        """Initialise the backend's own parameters (VSA's gates, SLA's projection). Subclasses with parameters call it
        at the end of ``__init__``; the model calls it again after its own initialisation (which re-initialises every
        ``nn.Linear``), so the methods keep the initialisation they require."""

    def check_grid(self, grid_hw: tuple[int, int]) -> None:
        """Raise PixditError (naming the grid and the violated number) if this backend cannot handle the token grid."""

    def tokens_per_query(self, num_tokens: int) -> float:
        """Keys each query attends to, in FLOP terms: one attention layer's forward costs
        ``4 * num_tokens * tokens_per_query * dim`` FLOPs per image (QK^T and PV; MFU counts this). Dense: all of
        them; the sparse backends count what they compute (selected blocks, pooled levels, coarse or linear stages)."""
        return float(num_tokens)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, grid_hw: tuple[int, int], hidden: torch.Tensor
    ) -> torch.Tensor:
        """q, k, v: [batch, heads, tokens, head_dim] after qk-norm and RoPE, in the model's token order.
        hidden: [batch, tokens, dim], the modulated hidden states that fed the qkv projection.
        A backend whose ``pool_block`` is set also takes ``means=``: the fp32 means of every ``pool_block``
        consecutive tokens of q, k and v stacked, [3, batch, heads, tokens / pool_block, head_dim], without gradient
        (what ``pixdit.kernels.qk_norm_rope(..., pool_block=...)`` returns), or None (pool them yourself; always None
        where tokens is not a multiple of ``pool_block``).
        A backend whose ``reads_v_view`` is set is given, when no gradient is needed (sampling), a v that is a
        strided view of the qkv projection's output (``qk_norm_rope(..., v_view=True)``), which it reads without a
        copy; otherwise v is contiguous.
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


def _as_mapping(cfg: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """An attention config as a plain dict with a `name` (None = full attention, a bare string = that name)."""
    if cfg is None:
        return {"name": "full"}
    if isinstance(cfg, str):
        return {"name": cfg}
    cfg = plain(cfg)
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise PixditError(f"attention config must be a mapping with a 'name' key, got {cfg!r}")
    return dict(cfg)


def attention_options(cfg: Mapping[str, Any] | str | None) -> tuple[str, dict[str, Any]]:
    """Split an attention config into (name, constructor options). Accepts a dict, an OmegaConf node or a bare name.
    The per-layer schedule (`dense_blocks`) is the model's, not an option: see block_attention_configs."""
    cfg = _as_mapping(cfg)
    options = {key: value for key, value in cfg.items() if key not in ("name", DENSE_BLOCKS_KEY)}
    return str(cfg["name"]), options


def block_attention_configs(cfg: Mapping[str, Any] | str | None, depth: int) -> list[dict[str, Any]]:
    """The attention config of each block of a model with `depth` blocks.

    `dense_blocks: [i, j, ...]` (block indices 0 .. depth - 1) gives those blocks full attention (`full` with its
    default options) and every other block the configured backend, e.g. ``attention=llsa attention.dense_blocks=[0,11]``
    for a 12-block model; empty or null: the configured backend everywhere (with `attention=full` the list changes
    nothing). A bad list is a PixditError naming the key and the model's depth, raised before anything is built.
    """
    cfg = _as_mapping(cfg)
    name, options = attention_options(cfg)
    dense = _dense_block_indices(cfg.get(DENSE_BLOCKS_KEY), depth)
    configured = {"name": name, **options}
    dense_config = configured if name == "full" else {"name": "full"}
    return [dense_config if index in dense else configured for index in range(depth)]


def _dense_block_indices(value: Any, depth: int) -> set[int]:
    if value is None:
        return set()
    key = f"attention.{DENSE_BLOCKS_KEY}"
    allowed = (
        f"a list of block indices, integers from 0 to {depth - 1} (the model has depth {depth}), e.g. "
        f"{key}=[0,{depth - 1}] (or [] for none)"
    )
    if not isinstance(value, (list, tuple)):
        raise PixditError(f"{key}={value!r} must be {allowed}")
    # bool is an int subclass, but `true` is a typo here, not block 1.
    bad = [index for index in value if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < depth]
    if bad:
        raise PixditError(
            f"{key}={list(value)}: {', '.join(map(repr, bad))} "
            f"{'is not a block index' if len(bad) == 1 else 'are not block indices'}; "
            f"allowed: {allowed}"
        )
    if len(set(value)) != len(value):
        raise PixditError(f"{key}={list(value)} lists a block twice; allowed: {allowed}")
    return set(value)


def build_attention(cfg: Mapping[str, Any] | str | None, dim: int, num_heads: int) -> AttentionBackend:
    """Build one backend from its config (``name`` selects the class, the other keys are its options; the model's
    per-layer schedule ``dense_blocks`` is not one of them and is not read here)."""
    name, options = attention_options(cfg)
    return construct(attention_class(name), options, "attention", dim=dim, num_heads=num_heads)


def check_head_dim(backend_name: str, dim: int, num_heads: int, allowed: tuple[int, ...]) -> None:
    """PixditError at build time when hidden size / heads is not a head dim the backend's kernels take, naming the
    number of heads that would fit (the parameters do not depend on it: qkv is hidden x 3 hidden either way)."""
    head_dim = dim // num_heads
    if head_dim in allowed:
        return
    fitting = [d for d in allowed if dim % d == 0]
    if fitting:
        nearest = min(fitting, key=lambda d: abs(d - head_dim))
        fix = f"model.num_heads={dim // nearest} (head dim {nearest}, the same parameters)"
    else:
        fix = "a hidden size that is a multiple of one of them"
    raise PixditError(
        f"attention={backend_name} needs a head dim in {allowed} (its Triton kernels), but hidden size "
        f"{dim} / num_heads {num_heads} = {head_dim}; use {fix}, or attention=full"
    )


def check_kernel_options(backend_name: str, head_dim: int, block_size, call: Callable[[torch.Tensor], Any]) -> None:
    """Validate a backend's options once at build time by running its kernel on a tiny CPU input (the kernels own
    the rules: allowed block sizes, head dims, K, scopes...); their ValueError/TypeError becomes a PixditError."""
    x = torch.zeros(1, 1, block_size if isinstance(block_size, int) and block_size > 0 else 1, head_dim, device="cpu")
    try:
        call(x)
    except (ValueError, TypeError) as error:
        raise PixditError(f"attention={backend_name}: {error}") from None


def check_one_of_topk(backend_name: str, topk, topk_ratio) -> None:
    """K comes from ``topk`` or from ``topk_ratio``, never both. The backend's config file and the experiments set
    ``topk``, so a user who passes only ``attention.topk_ratio`` gets both: say which override also goes on the
    command line."""
    if topk is not None and topk_ratio is not None:
        raise PixditError(
            f"attention={backend_name}: topk={topk!r} and topk_ratio={topk_ratio!r} are both set, and K comes from "
            f"one of them. configs/attention/{backend_name}.yaml and the experiments set topk, so to use the ratio "
            f"pass attention.topk=null too (or drop attention.topk_ratio)"
        )


def uninitialized_linear(in_features: int, out_features: int) -> nn.Linear:
    """An ``nn.Linear`` for a backend's ``reset_parameters`` to fill. ``skip_init`` skips nn.Linear's own random
    init, so building it draws nothing from the random stream (the rest of the model initialises as without it)."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, device=torch.get_default_device())
