"""Token order: raster or Z-order (quadtree / Morton) permutations for any H x W token grid.

Sparse attention (LLSA, VSA, SLA) groups *consecutive* tokens into blocks. In raster order a block of 16 tokens is a
1x16 strip of pixels; in Z-order it is a 4x4 square patch, which is what makes block pooling meaningful. The model
reorders tokens once after the patch embedding and undoes it once before the output head (`pixdit.models.dit`);
``model.token_order: auto`` (the default) takes the order the attention backend needs (`resolve_token_order`).
Details: docs/algorithms.md ("Token order").

Conventions, for a grid of H rows and W columns, raster index r = y * W + x:

* ``perm[r]`` = sequence position of the token at raster index r  (raster -> sequence)
* ``inv[s]``  = raster index of the token at sequence position s    (sequence -> raster), ``inv[perm[r]] == r``
* model entry: ``seq = raster_tokens[:, inv]``; model exit: ``raster_tokens = seq[:, perm]``.

Z-order code: z(y, x) = sum_k (2 * bit_k(y) + bit_k(x)) * 4**k, the row bit more significant, so the quadrants
come top-left, top-right, bottom-left, bottom-right, recursively. For non-square or non-power-of-two grids the
sequence order is the stable argsort of z; if H and W are multiples of 2**j, every aligned 2**j x 2**j tile still
occupies 4**j consecutive positions (e.g. 16-token runs are 4x4 patches on a 48 x 80 grid).

    >>> from pixdit.tokens import token_permutation
    >>> perm, inv = token_permutation("zorder", 4, 4)
    >>> perm.tolist()
    [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]

Tests: ``.venv/bin/python -m pytest tests/test_tokens.py``.
"""

from __future__ import annotations

import functools

import torch

from pixdit.errors import PixditError

TOKEN_ORDERS = ("raster", "zorder")
MODEL_TOKEN_ORDERS = ("auto", *TOKEN_ORDERS)  # the model's setting: auto = what the attention backend needs


def check_token_order(token_order: str, allowed: tuple[str, ...] = TOKEN_ORDERS) -> None:
    if token_order not in allowed:
        raise PixditError(f"token_order={token_order!r} is not known; allowed values: {', '.join(allowed)}")


def resolve_token_order(token_order: str, needed: str | None, needed_by: str) -> str:
    """The order a model uses: ``auto`` -> ``needed`` (the order its attention backend ``needed_by`` requires), or
    raster when any order works (``needed=None``); an explicit order is kept, and must be the needed one."""
    check_token_order(token_order, MODEL_TOKEN_ORDERS)
    if token_order == "auto":
        return needed or "raster"
    if needed not in (None, token_order):
        raise PixditError(
            f"attention '{needed_by}' needs token_order={needed!r}, but the model has "
            f"token_order={token_order!r}; use model.token_order=auto (the default) or {needed}"
        )
    return token_order


def zorder_codes(height: int, width: int) -> torch.Tensor:
    """Morton code z(y, x) of every token, in raster order: int64 tensor [height * width] (not necessarily dense)."""
    num_bits = max(1, (max(height, width) - 1).bit_length())
    # Always on the CPU (the tables are cached and shared), whatever torch.set_default_device says.
    y = torch.arange(height, dtype=torch.int64, device="cpu")[:, None]
    x = torch.arange(width, dtype=torch.int64, device="cpu")[None, :]
    codes = torch.zeros(height, width, dtype=torch.int64, device="cpu")
    for bit in range(num_bits):
        digit = 2 * ((y >> bit) & 1) + ((x >> bit) & 1)  # row bit is the more significant one
        codes += digit << (2 * bit)
    return codes.flatten()


@functools.lru_cache(maxsize=64)
def _permutation(token_order: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.device("cpu"):  # cached: must not inherit a caller's default device (e.g. a model built on "meta")
        return _make_permutation(token_order, height, width)


def _make_permutation(token_order: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = height * width
    if token_order == "raster":
        identity = torch.arange(num_tokens, dtype=torch.int64, device="cpu")
        return identity, identity
    inv = torch.argsort(zorder_codes(height, width), stable=True)
    perm = torch.empty_like(inv)
    perm[inv] = torch.arange(num_tokens, dtype=torch.int64, device="cpu")
    return perm, inv


def token_permutation(token_order: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inv)`` int64 CPU tensors of length height * width for the given order (cached per grid).

    The cached tensors are shared: clone them before writing into them.
    """
    check_token_order(token_order)
    if height < 1 or width < 1:
        raise PixditError(f"token grid must be at least 1 x 1, got {height} x {width}")
    return _permutation(token_order, int(height), int(width))


def token_coordinates(token_order: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column (int64 [height * width]) of the token at each sequence position; RoPE uses these."""
    _, inv = token_permutation(token_order, height, width)
    return inv // width, inv % width
