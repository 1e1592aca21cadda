"""Token order (pixdit.tokens): Z-order permutations against worked examples (docs/algorithms.md, "Token order") and
their block-locality guarantee. Run: .venv/bin/python -m pytest tests/test_tokens.py"""

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.tokens import token_coordinates, token_permutation, zorder_codes

GRIDS = [(1, 1), (4, 4), (8, 8), (16, 16), (64, 64), (4, 8), (8, 4), (48, 80), (3, 5), (7, 12), (32, 16), (1, 9)]


def morton_by_hand(y: int, x: int) -> int:
    """Independent oracle: interleave bits as a string, row bit first in each pair."""
    bits = 8
    ys, xs = format(y, f"0{bits}b"), format(x, f"0{bits}b")
    return int("".join(a + b for a, b in zip(ys, xs)), 2)


@pytest.mark.parametrize("order", ["raster", "zorder"])
@pytest.mark.parametrize("height,width", GRIDS)
def test_bijection_and_inverse_round_trip(order, height, width):
    perm, inv = token_permutation(order, height, width)
    n = height * width
    assert sorted(perm.tolist()) == list(range(n))
    assert sorted(inv.tolist()) == list(range(n))
    assert torch.equal(inv[perm], torch.arange(n))
    assert torch.equal(perm[inv], torch.arange(n))
    tokens = torch.randn(2, n, 3)
    assert torch.equal(tokens[:, inv][:, perm], tokens)


def test_raster_is_identity():
    perm, inv = token_permutation("raster", 5, 7)
    assert torch.equal(perm, torch.arange(35)) and torch.equal(inv, torch.arange(35))


def test_spec_worked_example_4x4():
    perm, inv = token_permutation("zorder", 4, 4)
    expected = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert perm.tolist() == expected
    assert inv.tolist() == expected  # an involution for 4x4
    assert zorder_codes(4, 4).view(4, 4).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_spec_worked_example_8x8():
    perm, inv = token_permutation("zorder", 8, 8)
    assert perm[:8].tolist() == [0, 1, 4, 5, 16, 17, 20, 21]
    assert inv[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_zorder_codes_match_bit_interleaving(n):
    expected = [morton_by_hand(y, x) for y in range(n) for x in range(n)]
    assert zorder_codes(n, n).tolist() == expected
    perm, _ = token_permutation("zorder", n, n)
    assert perm.tolist() == expected  # power-of-two square: the code *is* the sequence position


@pytest.mark.parametrize(
    "height,width,tile",
    [(16, 16, 4), (64, 64, 4), (64, 64, 16), (48, 80, 4), (32, 16, 4), (32, 64, 8), (12, 20, 4), (48, 80, 16)],
)
def test_aligned_runs_are_square_patches(height, width, tile):
    """Every aligned run of tile*tile tokens is one tile x tile pixel patch, on square and other grids."""
    if height % tile or width % tile:
        pytest.skip("grid not a multiple of the tile")
    rows, cols = token_coordinates("zorder", height, width)
    run = tile * tile
    for start in range(0, height * width, run):
        r, c = rows[start : start + run], cols[start : start + run]
        r0, c0 = int(r.min()), int(c.min())
        assert r0 % tile == 0 and c0 % tile == 0
        assert int(r.max()) == r0 + tile - 1 and int(c.max()) == c0 + tile - 1
        assert len(set(zip(r.tolist(), c.tolist()))) == run


def test_coordinates_follow_tokens():
    rows, cols = token_coordinates("zorder", 8, 8)
    _, inv = token_permutation("zorder", 8, 8)
    assert torch.equal(rows * 8 + cols, inv)
    rows, cols = token_coordinates("raster", 3, 5)
    assert rows.tolist() == [0] * 5 + [1] * 5 + [2] * 5 and cols.tolist() == list(range(5)) * 3


def test_cached_per_grid():
    assert token_permutation("zorder", 48, 80)[0] is token_permutation("zorder", 48, 80)[0]


def test_bad_order_names_allowed_values():
    with pytest.raises(PixditError, match="raster, zorder"):
        token_permutation("hilbert", 4, 4)
