"""The DiT block's joint: gated residual add + LayerNorm + adaLN modulation, whose backward computes the per-sample
shift, scale and gate gradients in the pass that computes the LayerNorm's gradient.

    from pixdit.kernels.adaln_joint import adaln_joint
    x_new, h = adaln_joint(x, branch, gate, shift, scale, eps)
    # x_new = x + gate * branch   (x itself with branch None: the joint before the attention)
    # h = LayerNorm(x_new) * (1 + scale) + shift      (no affine; computed in fp32, h in x's dtype)
    # x, branch: [b, n, d]; gate, shift, scale: [b, d]

Why (docs/kernel_notes.md v39): under torch.compile, Inductor computes d shift, d scale and d gate of each joint in
reduction passes of their own that read dh, the block's input and the branch once more after the LayerNorm's
backward pass read them (~0.8 GB per joint at 262,144 tokens of 384; the d shift / d scale pass ran at ~2 TB/s), and
its mix-order reductions cannot join them (they sum over the tokens of each sample, the middle of [b, n, d]). Here
the forward is plain PyTorch (Inductor traces and fuses it as before); the backward is one Triton pass: it recomputes
x_new and the row statistics, writes dx (and the branch's gradient) and adds the rows' dh, dh x^ and dx_new branch
into per-program sums, which a fixed-order sum over each sample's programs turns into the three per-sample gradients
(deterministic, no atomics).

The backward's grid is sized to the GPU, not to the tokens: ``programs_per_sample`` programs per sample, about
``PROGRAMS_PER_SM`` per multiprocessor in all, each walking every P-th step of its sample's rows (P = programs per
sample; neighbouring programs read neighbouring rows at the same time). So the programs are equal and come in whole
waves for most launches: with one program per 128 rows, 2,048 programs at 262,144 tokens would run as ~3.1 waves of
~660 (5 resident per multiprocessor) on an H200, the last one a tenth full. Any token count works (rows past the
end are masked), and the per-program sums stay small (14.6 MB at DiT-S on 132 multiprocessors).

CPU tensors (and ``impl="torch"``) run ``adaln_joint_backward_torch``, the same math in PyTorch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import AUTOTUNE, autotuned, use_triton
from .ops import custom_op, next_power_of_2

__all__ = ["adaln_joint", "adaln_joint_backward_torch", "backward_launches", "joint_backward"]

# The backward's programs per multiprocessor: whole waves for 2, 3, 4, 6 or 8 resident programs (the launches of
# backward_launches hold 2-8); with 5 or 7, 96% or 86% of the waves' slots are busy
PROGRAMS_PER_SM = 24
INTERPRETER_PROGRAMS = 6  # the backward's programs per call off the GPU (tests: several programs, interleaved steps)
# The backward reads the forward's LayerNorm statistics (each row's fp32 mean and 1 / std, 8 bytes a row, saved by
# the forward) instead of recomputing them, and takes its two remaining row sums in one paired reduction: two row
# reductions of four go, as in Inductor's LayerNorm backward, which runs at 3.4-3.7 TB/s against this kernel's
# 2.65-3.10 (docs/kernel_notes.md v42, v44). Off until measured on a GPU.
BACKWARD_FROM_STATS = False


def programs_per_sample(batch: int, tokens: int, device: torch.device) -> int:
    """The backward's programs per sample: ~PROGRAMS_PER_SM per multiprocessor in all (at least one per sample, at
    most one per row). A function of the shape and the device only, so results are deterministic on one GPU model."""
    if device.type == "cuda":
        total = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        total = INTERPRETER_PROGRAMS
    return max(1, min(tokens, total // batch))


def adaln_joint_forward(x, branch, gate, shift, scale, eps, with_stats: bool = False):
    """The forward in PyTorch ops, the DiT block's eager path (x_new rounded to x's dtype; the LayerNorm, in fp32
    under autocast, rounded once to x's dtype: an fp32 copy would double the memory of every modulated activation
    saved for the backward; the modulation one addcmul, no [b, n, d] temporary). ``with_stats``: also the
    LayerNorm's fp32 row mean and 1 / std (``[b, n, 1]`` each), computed in fp32 whatever autocast says."""
    x_new = x if branch is None else torch.addcmul(x, gate[:, None], branch)
    if with_stats:
        normed, mean, rstd = torch.native_layer_norm(x_new.float(), x_new.shape[-1:], None, None, eps)
    else:
        normed = F.layer_norm(x_new, x_new.shape[-1:], eps=eps)
    h = torch.addcmul(shift[:, None], normed.to(x_new.dtype), 1 + scale[:, None])
    return (x_new, h, mean, rstd) if with_stats else (x_new, h)


def adaln_joint_backward_torch(dh, dx_new, x, branch, gate, scale, eps):
    """(dx, d branch or None, [b, 3, d] fp32 sums: d shift, d scale, d gate) in PyTorch: the CPU path. dx_new: the
    gradient of x_new from its other uses (or None)."""
    xn = x.float() if branch is None else (x.float() + gate.float()[:, None] * branch.float()).to(x.dtype).float()
    mean = xn.mean(-1, keepdim=True)
    centred = xn - mean
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    xhat = centred * rstd
    dh32 = dh.float()
    g = dh32 * (1 + scale.float()[:, None])
    dxn = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dx_new is not None:
        dxn = dxn + dx_new.float()
    sums = [dh32.sum(1), (dh32 * xhat).sum(1)]
    dbranch = None
    if branch is not None:
        dbranch = (gate.float()[:, None] * dxn).to(branch.dtype)
        sums.append((dxn * branch.float()).sum(1))
    else:
        sums.append(torch.zeros_like(sums[0]))
    return dxn.to(x.dtype), dbranch, torch.stack(sums, 1)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _joint_bwd_kernel(
    dh_ptr,
    dres_ptr,
    x_ptr,
    branch_ptr,
    gate_ptr,
    scale_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dbranch_ptr,
    partial_ptr,
    n,
    dim,
    programs,
    eps,
    HAS_BRANCH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    HAS_STATS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # ``programs`` per sample; this one walks steps slot, slot + programs, ... of BLOCK_ROWS rows of its sample
    pid = tl.program_id(0)
    sample, slot = pid // programs, pid % programs
    n_steps = tl.cdiv(tl.cdiv(n, BLOCK_ROWS), programs)
    col = tl.arange(0, DIM_PAD)
    col_ok = col < dim
    scale = tl.load(scale_ptr + sample * dim + col, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_BRANCH:
        gate = tl.load(gate_ptr + sample * dim + col, mask=col_ok, other=0.0).to(tl.float32)
    # summed across rows once, after the walk (a row sum per step is a cross-warp reduction with a barrier)
    sum_dh = tl.zeros([BLOCK_ROWS, DIM_PAD], dtype=tl.float32)
    sum_dh_xhat = tl.zeros([BLOCK_ROWS, DIM_PAD], dtype=tl.float32)
    sum_dxn_branch = tl.zeros([BLOCK_ROWS, DIM_PAD], dtype=tl.float32)
    for step in tl.range(0, n_steps, num_stages=NUM_STAGES):
        row = (step * programs + slot) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        # rows past the sample's end load zeros: their dx, d branch are not stored and they add 0 to every sum
        ok = (row < n)[:, None] & col_ok[None, :]
        offset = (sample.to(tl.int64) * n + row)[:, None] * dim + col[None, :]
        xn = tl.load(x_ptr + offset, mask=ok, other=0.0).to(tl.float32)
        if HAS_BRANCH:
            branch = tl.load(branch_ptr + offset, mask=ok, other=0.0).to(tl.float32)
            xn = (
                (xn + gate[None, :] * branch).to(x_ptr.dtype.element_ty).to(tl.float32)
            )  # x_new as the forward rounded it
        if HAS_STATS:  # the forward's (BACKWARD_FROM_STATS)
            stats_offset = sample.to(tl.int64) * n + row
            mean = tl.load(mean_ptr + stats_offset, mask=row < n, other=0.0)
            rstd = tl.load(rstd_ptr + stats_offset, mask=row < n, other=0.0)
        else:
            mean = tl.sum(xn, axis=1) / dim
        centred = tl.where(col_ok[None, :], xn - mean[:, None], 0.0)
        if not HAS_STATS:
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / dim + eps)
        xhat = centred * rstd[:, None]
        dh = tl.load(dh_ptr + offset, mask=ok, other=0.0).to(tl.float32)
        g = dh * (1.0 + scale[None, :])
        if HAS_STATS:  # both row sums in one reduction: one exchange between the warps instead of two
            sum_g, sum_gx = tl.reduce((g, g * xhat), 1, _add_pairs)
            mean_g, mean_gx = sum_g / dim, sum_gx / dim
        else:
            mean_g = tl.sum(g, axis=1) / dim
            mean_gx = tl.sum(g * xhat, axis=1) / dim
        dxn = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
        if HAS_DRES:
            dxn += tl.load(dres_ptr + offset, mask=ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offset, dxn.to(dx_ptr.dtype.element_ty), mask=ok)
        sum_dh += dh
        sum_dh_xhat += dh * xhat
        if HAS_BRANCH:
            tl.store(dbranch_ptr + offset, (gate[None, :] * dxn).to(dbranch_ptr.dtype.element_ty), mask=ok)
            sum_dxn_branch += dxn * branch
    base = partial_ptr + pid * 3 * dim
    tl.store(base + col, tl.sum(sum_dh, axis=0), mask=col_ok)
    tl.store(base + dim + col, tl.sum(sum_dh_xhat, axis=0), mask=col_ok)
    tl.store(base + 2 * dim + col, tl.sum(sum_dxn_branch, axis=0), mask=col_ok)


ROW_STEPS = (1, 2, 4, 8, 16, 32)  # rows per step of the backward's walk
# (warps, rows per step, stages) of every launch tried; backward_launches keeps those that suit a width
_LAUNCH_GRID = tuple(itertools.product((4, 8), ROW_STEPS, (2, 3)))


def _elements_per_thread(block_rows: int, dim: int, warps: int) -> int:
    return block_rows * next_power_of_2(dim) // (32 * warps)


def backward_launches(dim: int) -> list[dict]:
    """The backward kernel's launch configurations for rows of ``dim``: rows per step, warps, pipeline stages (the
    walk's loads issued that many steps ahead; only ``tl.range``'s stages pipeline a loop without dots). Each holds
    2-8 elements of a row tile per thread (at least one row a step): compiled for sm_90 (the compile report's
    ``--kernels joint``), 8 rows of 512 columns on 4 warps (32 a thread) took 255 registers and spilled, 2 rows took
    106 and did not."""
    return [
        {"BLOCK_ROWS": rows, "NUM_STAGES": stages, "num_warps": warps}
        for warps, rows, stages in _LAUNCH_GRID
        if 2 <= _elements_per_thread(rows, dim, warps) <= 8 or (rows == 1 and _elements_per_thread(1, dim, warps) > 8)
    ]


def fixed_launch(dim: int) -> dict:
    """The launch without autotuning: 8 elements a thread, on 4 warps up to 1,024 columns."""
    warps = 4 if next_power_of_2(dim) <= 1024 else 8
    rows = max(1, min(ROW_STEPS[-1], 8 * 32 * warps // next_power_of_2(dim)))
    return {"BLOCK_ROWS": rows, "NUM_STAGES": 2, "num_warps": warps}


def _prune(configs, named_args, **kwargs):
    dim = named_args["dim"]
    allowed = [(c["BLOCK_ROWS"], c["NUM_STAGES"], c["num_warps"]) for c in backward_launches(dim)]
    return [c for c in configs if (c.kwargs["BLOCK_ROWS"], c.kwargs["NUM_STAGES"], c.num_warps) in allowed]


_CONFIGS = [
    triton.Config({"BLOCK_ROWS": rows, "NUM_STAGES": stages}, num_warps=warps) for warps, rows, stages in _LAUNCH_GRID
]
_joint_bwd = autotuned(_joint_bwd_kernel, ["dim", "HAS_BRANCH", "HAS_DRES", "HAS_STATS"], _CONFIGS, prune=_prune)


def _backward_out(x: torch.Tensor, has_branch: bool):
    """dx, d branch (x's shape and dtype; an empty tensor without a branch) and the per-program fp32 sums
    ``[programs, 3, d]``."""
    b, n, dim = x.shape
    programs = b * programs_per_sample(b, n, x.device)
    dbranch = torch.empty_like(x) if has_branch else x.new_empty(0)
    return torch.empty_like(x), dbranch, x.new_empty((programs, 3, dim), dtype=torch.float32)


def joint_backward(dh, dres, x, branch, gate, scale, eps: float, launch: dict | None = None, mean=None, rstd=None):
    """The Triton backward (the custom op's launcher): dx, d branch and the per-program sums of ``_backward_out``.
    ``launch``: one of ``backward_launches(dim)``; None = autotuned over them on the GPU (common.AUTOTUNE), else
    ``fixed_launch(dim)``. dres, branch and gate may be None (not read). ``mean``, ``rstd``: the forward's LayerNorm
    statistics (fp32 ``[b, n, 1]``, ``adaln_joint_forward(..., with_stats=True)``), read instead of recomputed."""
    dx, dbranch, partial = _backward_out(x, branch is not None)
    b, n, dim = x.shape
    kernel = _joint_bwd_kernel if launch is not None or not AUTOTUNE else _joint_bwd
    launch = launch if launch is not None else ({} if AUTOTUNE else fixed_launch(dim))
    kernel[(partial.shape[0],)](
        dh,
        dres if dres is not None else dh,  # not read without HAS_DRES
        x,
        branch if branch is not None else x,  # not read without HAS_BRANCH
        gate if gate is not None else scale,  # not read without HAS_BRANCH
        scale,
        mean if mean is not None else scale,  # not read without HAS_STATS
        rstd if rstd is not None else scale,
        dx,
        dbranch if branch is not None else dx,
        partial,
        n,
        dim,
        partial.shape[0] // b,
        eps,
        HAS_BRANCH=branch is not None,
        HAS_DRES=dres is not None,
        HAS_STATS=mean is not None,
        DIM_PAD=next_power_of_2(dim),
        **launch,
    )
    return dx, dbranch, partial


@custom_op("adaln_joint_backward")
def _adaln_joint_backward_op(
    dh: torch.Tensor,
    dres: torch.Tensor | None,
    x: torch.Tensor,
    branch: torch.Tensor | None,
    gate: torch.Tensor | None,
    scale: torch.Tensor,
    eps: float,
    mean: torch.Tensor | None = None,
    rstd: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return joint_backward(dh, dres, x, branch, gate, scale, eps, mean=mean, rstd=rstd)


@_adaln_joint_backward_op.register_fake
def _(dh, dres, x, branch, gate, scale, eps, mean=None, rstd=None):
    return _backward_out(x, branch is not None)


class _AdaLNJoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, branch, gate, shift, scale, eps, triton_path):
        ctx.eps, ctx.triton_path, ctx.has_branch = eps, triton_path, branch is not None
        ctx.dtypes = tuple(t.dtype if t is not None else None for t in (gate, shift, scale))
        x_new, h, *stats = adaln_joint_forward(
            x, branch, gate, shift, scale, eps, with_stats=triton_path and BACKWARD_FROM_STATS
        )
        ctx.save_for_backward(x, branch, gate, scale, *stats)
        return x_new if branch is not None else x_new.clone(), h  # x_new is its own tensor, as autograd needs

    @staticmethod
    def backward(ctx, dx_new, dh):
        x, branch, gate, scale, *stats = ctx.saved_tensors
        b, n, dim = x.shape
        dh = dh.contiguous()
        dx_new = dx_new.contiguous() if dx_new is not None else None
        if ctx.triton_path:
            dx, dbranch, partial = _adaln_joint_backward_op(dh, dx_new, x, branch, gate, scale, ctx.eps, *stats)
            sums = partial.view(b, -1, 3, dim).sum(1)  # fixed order: deterministic
            dbranch = dbranch if ctx.has_branch else None
        else:
            dx, dbranch, sums = adaln_joint_backward_torch(dh, dx_new, x, branch, gate, scale, ctx.eps)
        gate_dtype, shift_dtype, scale_dtype = ctx.dtypes
        dgate = sums[:, 2].to(gate_dtype) if ctx.has_branch else None
        return dx, dbranch, dgate, sums[:, 0].to(shift_dtype), sums[:, 1].to(scale_dtype), None, None


def adaln_joint(x, branch, gate, shift, scale, eps: float, impl: str = "auto"):
    """(x_new, h) of the module docstring; differentiable in all tensors."""
    if x.ndim != 3 or (branch is not None and branch.shape != x.shape):
        raise ValueError(
            f"adaln_joint: x must be [batch, tokens, dim] and branch None or of x's shape, got x {tuple(x.shape)} "
            f"and branch {None if branch is None else tuple(branch.shape)}"
        )
    b, n, dim = x.shape
    for name, t in (("gate", gate), ("shift", shift), ("scale", scale)):
        if t is not None and tuple(t.shape) != (b, dim):
            raise ValueError(f"adaln_joint: {name} must be [batch, dim] = ({b}, {dim}), got {tuple(t.shape)}")
    if (branch is None) != (gate is None):
        raise ValueError("adaln_joint: branch and gate come together (both None before the attention)")
    triton_path = use_triton(x, impl)
    x, scale = x.contiguous(), scale.contiguous()  # the modulation's chunks are strided views
    branch = branch.contiguous() if branch is not None else None
    gate = gate.contiguous() if gate is not None else None
    return _AdaLNJoint.apply(x, branch, gate, shift, scale, eps, triton_path)
