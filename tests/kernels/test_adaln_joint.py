"""adaln_joint (gated residual + LayerNorm + adaLN modulation; per-sample shift / scale / gate gradients in the
backward's pass) against an fp64 oracle written here from its definition, differentiated by autograd. On CPU the
Triton kernel runs in the interpreter (tests/kernels/conftest.py)."""

import pytest
import torch

from pixdit.kernels import adaln_joint as joint_module
from pixdit.kernels.adaln_joint import (
    INTERPRETER_PROGRAMS,
    adaln_joint,
    adaln_joint_backward_torch,
    adaln_joint_forward,
    backward_launches,
    joint_backward,
)

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def oracle(x, branch, gate, shift, scale, eps):
    x_new = x if branch is None else x + gate[:, None] * branch
    mean = x_new.mean(-1, keepdim=True)
    var = (x_new - mean).square().mean(-1, keepdim=True)
    return x_new, (x_new - mean) / torch.sqrt(var + eps) * (1 + scale[:, None]) + shift[:, None]


def make_inputs(b, n, dim, dtype, device, with_branch, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * s + shift).to(device, dtype).requires_grad_()

    x = t(b, n, dim, s=2.0, shift=0.5)
    branch, gate = (t(b, n, dim), t(b, dim, s=0.5)) if with_branch else (None, None)
    return x, branch, gate, t(b, dim, s=0.3), t(b, dim, s=0.3)


def compare(b, n, dim, dtype, device, impl, with_branch, eps=1e-5):
    x, branch, gate, shift, scale = make_inputs(b, n, dim, dtype, device, with_branch)
    leaves = [t for t in (x, branch, gate, shift, scale) if t is not None]
    x_new, h = adaln_joint(x, branch, gate, shift, scale, eps, impl=impl)
    g = torch.Generator().manual_seed(1)
    up = [torch.randn(t.shape, generator=g).to(device, dtype) for t in (x_new, h)]
    grads = torch.autograd.grad((x_new, h), leaves, up)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    rx = next(it)
    rb, rg = (next(it), next(it)) if with_branch else (None, None)
    rs, rc = next(it), next(it)
    want = oracle(rx, rb, rg, rs, rc, eps)
    want_grads = torch.autograd.grad(want, ref_leaves, [u.double() for u in up])
    names = ["x_new", "h", "dx"] + (["dbranch", "dgate"] if with_branch else []) + ["dshift", "dscale"]
    for name, got, ref in zip(names, (x_new, h, *grads), (*want, *want_grads), strict=True):
        assert got.dtype == dtype and got.shape == ref.shape, name
        error = ((got.double() - ref).norm() / ref.norm()).item()
        assert error < TOL[dtype], f"{name}: relative error {error:.2e} (tolerance {TOL[dtype]:.0e})"
    return (x_new, h, *grads)


# (batch, tokens, dim): a padded dim, the batch's programs walking several steps each with a partial last one; a
# power-of-two dim; more programs per sample than steps (programs with no row to walk add zeros)
CASES = [(2, 200, 48), (1, 128, 64), (1, 3, 32)]


@pytest.mark.parametrize("with_branch", [True, False])
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_fp64_oracle(case, dtype, impl, with_branch):
    if impl == "triton" and CUDA:
        pytest.skip("interpreter test (the GPU twin is below)")
    compare(*case, dtype, "cpu", impl, with_branch)


def reads_the_forwards_statistics(monkeypatch) -> list[bool]:
    """Turns BACKWARD_FROM_STATS on; returns the list into which each backward launch appends whether it was given
    the forward's statistics."""
    monkeypatch.setattr(joint_module, "BACKWARD_FROM_STATS", True)
    given, launcher = [], joint_module.joint_backward
    monkeypatch.setattr(
        joint_module, "joint_backward", lambda *a, **kw: given.append(kw.get("mean") is not None) or launcher(*a, **kw)
    )
    return given


@pytest.mark.parametrize("with_branch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_backward_from_the_forwards_statistics_matches_the_fp64_oracle(case, dtype, with_branch, monkeypatch):
    """BACKWARD_FROM_STATS: the forward keeps the LayerNorm's fp32 row mean and 1 / std, the backward reads them
    (and pairs its two row sums); the statistics' use pinned."""
    if CUDA:
        pytest.skip("interpreter test (the GPU twin is below)")
    given = reads_the_forwards_statistics(monkeypatch)
    compare(*case, dtype, "cpu", "triton", with_branch)
    assert given == [True]


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("with_branch", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_matches_the_fp64_oracle_and_is_deterministic(dtype, with_branch, stats, mark, monkeypatch):
    given = reads_the_forwards_statistics(monkeypatch) if stats else []
    first = compare(4, 4096, 384, dtype, "cuda", "auto", with_branch)
    assert given == [stats] * stats
    second = compare(4, 4096, 384, dtype, "cuda", "auto", with_branch)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    compare(3, 1000, 1152, dtype, "cuda", "auto", with_branch)  # DiT-XL's width, tokens of no power of two


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("with_branch", [True, False])
def test_every_launch_the_autotuner_may_pick_gives_the_same_gradients(with_branch, stats):
    """Each of backward_launches (rows per step x warps x stages) against the PyTorch backward: a launch whose walk
    skipped or repeated rows, or summed a step twice, would differ; with the forward's statistics read too."""
    if CUDA:
        pytest.skip("interpreter test (on the GPU, the autotuned launch runs in the oracle test)")
    b, n, dim = 2, 200, 48
    x, branch, gate, _, scale = (
        t.detach() if t is not None else None for t in make_inputs(b, n, dim, torch.float32, "cpu", with_branch)
    )
    g = torch.Generator().manual_seed(2)
    dh, dres = torch.randn(b, n, dim, generator=g), torch.randn(b, n, dim, generator=g)
    want_dx, want_dbranch, want_sums = adaln_joint_backward_torch(dh, dres, x, branch, gate, scale, 1e-5)
    launches = backward_launches(dim)
    assert len({(c["BLOCK_ROWS"], c["num_warps"]) for c in launches}) >= 4, launches
    mean = rstd = None
    if stats:
        _, _, mean, rstd = adaln_joint_forward(x, branch, gate, scale, scale, 1e-5, with_stats=True)
    # the interpreter runs a program the same way at any warps and pipelining stages: one launch per rows per step
    # covers every distinct walk
    for launch in {c["BLOCK_ROWS"]: c for c in launches}.values():
        dx, dbranch, partial = joint_backward(dh, dres, x, branch, gate, scale, 1e-5, launch, mean, rstd)
        assert partial.shape == (INTERPRETER_PROGRAMS, 3, dim)  # 3 programs per sample, 2 samples
        sums = partial.view(b, -1, 3, dim).sum(1)
        torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5, msg=f"dx at {launch}")
        torch.testing.assert_close(sums, want_sums, rtol=1e-5, atol=1e-4, msg=f"sums at {launch}")
        if with_branch:
            torch.testing.assert_close(dbranch, want_dbranch, rtol=1e-5, atol=1e-5, msg=f"d branch at {launch}")
