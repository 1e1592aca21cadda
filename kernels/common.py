"""What every kernel entry point shares: the accepted inputs, the Triton-or-PyTorch choice, the block layout and the
rule that turns ``topk`` / ``topk_ratio`` into a number of blocks.

    from .common import check_qkv, use_triton, resolve_topk, num_blocks
    triton_path = use_triton(q, impl)                         # impl: "auto" | "triton" | "torch"
    check_qkv(q, k, v, name="vsa_attention")                  # ValueError / TypeError naming the argument
    kk = resolve_topk(num_blocks(n, 16), topk, topk_ratio)    # K >= 1, clamped to the number of blocks

Both paths accept the same inputs (fp16, bf16 or fp32; head dims 16, 32, 64, 128), so a setting that runs on the CPU
runs on the GPU too. The conventions behind them are in docs/algorithms.md ("Conventions shared by the three sparse
methods").
"""

from __future__ import annotations

import math
import os

import torch
import triton

from . import topk as shared_topk
from .ops import INTERPRET  # (defined with the launch helpers, below every other module)

__all__ = [
    "HEAD_DIMS",
    "DTYPES",
    "BLOCK_SIZES",
    "INTERPRET",
    "AUTOTUNE",
    "autotuned",
    "KeptPicks",
    "use_triton",
    "autocast_inputs",
    "check_qkv",
    "check_block_size",
    "check_selection",
    "num_blocks",
    "pad_to_blocks",
    "topk_from_fraction",
    "resolve_topk",
    "select_topk_blocks",
]

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZES = (16, 32, 64)  # VSA's and SLA's block sizes
IMPLS = ("auto", "triton", "torch")

# On the GPU the attention kernels are autotuned over a few warp/stage counts (keyed by their tile shapes: a few
# seconds of compiling per new shape). PIXDIT_KERNELS_AUTOTUNE=0 (set by tests/kernels/conftest.py) and the
# interpreter (CPU tests) launch them directly with one fixed configuration. Results are bitwise reproducible within
# a process either way; across processes only with autotuning off (the timing-picked config may differ).
AUTOTUNE = not INTERPRET and os.environ.get("PIXDIT_KERNELS_AUTOTUNE", "1") not in ("", "0")


def autotuned(kernel, key: list[str], configs: list, prune=None):
    """``kernel`` autotuned over ``configs`` (keyed by the argument names ``key``) when AUTOTUNE is on, else as is
    (its launcher then passes the fixed ``num_warps`` / ``num_stages``). ``prune(configs, named_args, **kwargs)``:
    Triton's ``early_config_prune``, the configurations worth timing for one launch's arguments."""
    if not AUTOTUNE:
        return kernel
    prune_by = {"early_config_prune": prune} if prune is not None else None
    return KeptPicks(triton.autotune(configs=configs, key=key, prune_configs_by=prune_by)(kernel), key)


_ABSENT = object()  # a key argument the launch left at its default (Triton's key then leaves it out)


class KeptPicks:
    """A Triton autotuner (``triton.autotune(...)(kernel)``) that keeps the configuration it picked for each key and
    launches the kernel with it directly on later calls: ``kernel[grid](...)`` as before.

    Why not Triton's ``Autotuner.run`` on every launch: before it looks up its cache it builds a dict of all the
    kernel's arguments (~50 for the attention kernels), filters it by membership in a list of their names and
    formats a dtype string per tensor, ~10-20 µs of Python per launch, and an eager LLSA forward + backward makes
    seven autotuned launches. The key kept here holds the same information as Triton's (the key arguments' values
    and the dtype of every tensor argument, in order), so a kept pick is the configuration Triton's cache holds for
    that launch: results stay as reproducible as with Triton's own lookup. A new key goes through ``Autotuner.run``
    (which prunes, times the configurations and launches) and its pick is kept afterwards."""

    def __init__(self, tuner, key: list[str]):
        self.tuner = tuner
        self.fn = tuner  # as Triton's wrappers do: ``.fn`` leads to the JITFunction and on to the Python function
        positions = {name: i for i, name in enumerate(tuner.arg_names)}
        self._key = [(name, positions[name]) for name in key]
        self._picks: dict[tuple, dict] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        values = tuple(
            kwargs[name] if name in kwargs else args[i] if i < len(args) else _ABSENT for name, i in self._key
        )
        key = (
            values,
            tuple(a.dtype for a in args if hasattr(a, "dtype")),  # Triton's rule (and faster than isinstance)
            tuple(a.dtype for a in kwargs.values() if hasattr(a, "dtype")),
        )
        pick = self._picks.get(key)
        if pick is None or warmup:
            ret = self.tuner.run(*args, grid=grid, warmup=warmup, **kwargs)
            config = self.tuner.best_config
            if not warmup and config.pre_hook is None:  # a pre-hook runs on every launch: left to Triton's run
                self._picks[key] = config.all_kwargs()
            return ret
        return self.tuner.fn.run(*args, grid=grid, warmup=False, **kwargs, **pick)

    def __getattr__(self, name):  # the autotuner's own attributes (configs, cache, keys, ...)
        if name == "tuner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.tuner, name)


# ------------------------------------------------------------------------------------------- Triton or PyTorch
def use_triton(x: torch.Tensor, impl: str) -> bool:
    """Whether ``impl`` runs the Triton kernels for ``x``: "auto" = for CUDA tensors, "triton" = always (CPU tensors
    only under TRITON_INTERPRET=1), "torch" = never (the exact PyTorch path)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    triton_path = impl == "triton" or (impl == "auto" and x.is_cuda)
    if triton_path and not x.is_cuda and not INTERPRET:
        raise ValueError(
            "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before "
            "pixdit.kernels is imported (or use impl='torch' / 'auto')"
        )
    return triton_path


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under CUDA autocast, fp32 inputs are cast to the autocast dtype (what SDPA does), so an fp32 qk-norm/RoPE
    output does not silently run the slow exact-fp32 kernels."""
    t = tensors[0]
    if not t.is_cuda or t.dtype != torch.float32:
        return tensors
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return tuple(x.to(dtype) for x in tensors)
    return tensors


# ---------------------------------------------------------------------------------------------- argument checks
def check_qkv(q, k, v, *, name: str, self_attention: bool = True, scale=None) -> None:
    """q ``[b, h, Nq, d]``, k and v ``[b, h, Nk, d]`` (``Nq == Nk`` when ``self_attention``): tensors of one
    supported dtype on one device, ``d`` in HEAD_DIMS, at least one token; ``scale`` None or a positive number."""
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: {arg} must be [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise TypeError(f"{name}: {arg} must be float16, bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    same = (
        q.shape == k.shape == v.shape
        if self_attention
        else (k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[-1] == k.shape[-1])
    )
    if not same:
        what = "the same shape (self-attention)" if self_attention else "matching batch, heads and head_dim"
        raise ValueError(f"{name}: q, k, v must have {what}, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"{name}: the token dimension of q, k, v is empty")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name}: head_dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise ValueError(f"{name}: scale must be a positive float or None (head_dim ** -0.5), got {scale!r}")


def check_block_size(block_size) -> None:
    """VSA's tiles and SLA's blocks: 16, 32 or 64 consecutive tokens (LLSA's rule is its own: ``llsa_check``)."""
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")


def check_selection(idx, q: torch.Tensor, block_size: int, name: str) -> None:
    """A precomputed block selection must be an int tensor ``[b, h, T, K]`` of ids in ``[0, T)`` on q's device."""
    b, h, n, _ = q.shape
    t = num_blocks(n, block_size)
    if (
        not isinstance(idx, torch.Tensor)
        or idx.dtype not in (torch.int32, torch.int64)
        or idx.dim() != 4
        or tuple(idx.shape[:3]) != (b, h, t)
        or idx.device != q.device
    ):
        raise ValueError(
            f"{name} must be an int32/int64 tensor [{b}, {h}, {t}, K] on {q.device} "
            f"(as returned by the matching *_select), got "
            f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}"
        )


def check_means(means, q: torch.Tensor, block_size: int, name: str) -> torch.Tensor:
    """Precomputed block means (``qk_norm_rope(..., pool_block=block_size)``'s): fp32 ``[3, b, h, T, d]`` on q's
    device, q's, k's and v's stacked. Returned without gradient."""
    b, h, n, d = q.shape
    want = (3, b, h, num_blocks(n, block_size), d)
    if not isinstance(means, torch.Tensor) or tuple(means.shape) != want or means.dtype != torch.float32:
        got = f"{tuple(means.shape)} {means.dtype}" if isinstance(means, torch.Tensor) else type(means).__name__
        raise ValueError(
            f"{name}: means must be the stacked fp32 block means of q, k, v, shape {want} on {q.device}, got {got}; "
            f"pass means=None to compute them here"
        )
    if means.device != q.device:
        raise ValueError(f"{name}: means must be on q's device {q.device}, got {means.device}")
    return means.detach()


# ------------------------------------------------------------------------------------------------ block layout
def num_blocks(num_tokens: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` consecutive tokens (the last one may be partial). Written as a plain
    ceiling division: under torch.compile with dynamic shapes, ``-(-n // b)`` made the sympy evaluation of SLA's
    negligible count fail."""
    return (num_tokens + block_size - 1) // block_size


def pad_to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, h, N, d] -> [b, h, T, block_size, d]``, the partial last block zero-padded."""
    b, h, n, d = x.shape
    t = num_blocks(n, block_size)
    if t * block_size != n:
        x = torch.nn.functional.pad(x, (0, 0, 0, t * block_size - n))
    return x.reshape(b, h, t, block_size, d)


# ------------------------------------------------------------------------------------------------- the K rule
def topk_from_fraction(fraction: float, num_tiles: int) -> int:
    """``clamp(ceil(fraction * num_tiles), 1, num_tiles)``; the product is rounded to 6 decimals before the ceil, so
    that float noise such as ``0.3 * 10 = 3.0000000000000004`` does not add a block."""
    return min(max(math.ceil(round(fraction * num_tiles, 6)), 1), num_tiles)


def resolve_topk(num_tiles: int, topk, topk_ratio) -> int:
    """The number of selected blocks from exactly one of ``topk`` (an int >= 1, clamped to the number of blocks) or
    ``topk_ratio`` (the share of blocks kept, in [0, 1]); K >= 1 always."""
    if (topk is None) == (topk_ratio is None):
        raise ValueError(
            f"give exactly one of topk (int >= 1) or topk_ratio (float in [0, 1]); "
            f"got topk={topk!r}, topk_ratio={topk_ratio!r}"
        )
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an int >= 1 (it is clamped to the number of blocks), got {topk!r}")
        return min(topk, num_tiles)
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not 0.0 <= topk_ratio <= 1.0:
        raise ValueError(f"topk_ratio must be a float in [0, 1] (the share of blocks kept), got {topk_ratio!r}")
    return topk_from_fraction(topk_ratio, num_tiles)


def select_topk_blocks(
    q_pool: torch.Tensor, k_pool: torch.Tensor, topk: int, scale: float = 1.0, use_triton_topk: bool = False
) -> torch.Tensor:
    """Per query block, the ``topk`` key blocks with the largest ``scale * q_pool . k_pool`` (fp32, TF32 off): int32
    ``[b, h, T, K]``, best first, ties toward the smaller id (``blocks.topk_desc`` semantics). No grad.

    ``use_triton_topk``: the shared Triton selection ``topk.pooled_topk`` (at most 256 MiB of scores at once);
    otherwise its PyTorch form (chunked fp32 scores + ``topk_desc_fast``).
    """
    with torch.no_grad():
        # the scale goes on the [T, d] operand, not on the [T, T] scores (one pass less over the big matrix)
        q_rows = scale * q_pool.float() if scale != 1.0 else q_pool.float()
        return shared_topk.pooled_topk(q_rows, k_pool.float(), topk, impl="triton" if use_triton_topk else "torch")
