"""Bias + tanh GELU whose backward computes the bias gradient in the same pass: the MLP's first activation for
training.

    from pixdit.kernels import bias_gelu
    g = bias_gelu(u, bias)      # u = x @ fc1.weight.T (no bias), [..., C]; bias: [C]
    # g = gelu_tanh(u + bias): computed in fp32, rounded once to u's dtype

The GELU is the tanh approximation written as ``x * sigmoid(2 z)``, ``z = sqrt(2 / pi) (x + 0.044715 x^3)``: the
same function as ``0.5 x (1 + tanh z)``, without the cancellation of ``1 + tanh z`` in the negative tail, and cheap
under torch.compile, which lowers ``tanh`` to libdevice's accurate tanh (dozens of instructions an element) and
``sigmoid`` to a fast exp (docs/kernel_notes.md v38).

Why a kernel for the backward: the gradient of a linear layer's bias is the sum over all tokens of the gradient of
its output. With the bias inside the matmul, torch.compile computes that sum in a reduction pass of its own, which
reads the 4x-wide gradient (or recomputes it from the GELU's two inputs) once more after the pass that wrote it: 0.8
GB per DiT-S block at 262,144 tokens. Here the bias joins the GELU, and the backward's one pass reads dy and u,
writes du, and adds its rows into per-program column sums, which a fixed-order sum turns into the bias gradient
(deterministic, no atomics). The forward stays plain PyTorch, so torch.compile fuses the bias add and the GELU into
one elementwise pass after the bias-free matmul.

CPU tensors (and ``impl="torch"``) run ``bias_gelu_backward_torch``, the same math in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import use_triton
from .ops import custom_op

__all__ = ["bias_gelu", "bias_gelu_backward_torch", "gelu_tanh_fp32"]

# 2 sqrt(2 / pi) and 2 sqrt(2 / pi) 0.044715: gelu_tanh(x) = x * sigmoid(x * (GELU_C1 + GELU_C3 * x^2))
GELU_C1 = 1.5957691216057308
GELU_C3 = 0.07135481627260025
ROWS_PER_PROGRAM = 512  # rows one backward program sums: 512 partial rows (3 MB of fp32 at C = 1,536) per 2^18 rows
BLOCK_ROWS = 32
BLOCK_COLS = 128


def gelu_tanh_fp32(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU of an fp32 tensor in its sigmoid form (the module docstring)."""
    return x * torch.sigmoid(x * (GELU_C1 + GELU_C3 * x * x))


def bias_gelu_backward_torch(
    dy: torch.Tensor, u: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(du in u's dtype, the bias gradient in fp32) of ``g = gelu_tanh(u + bias)``, in PyTorch: the CPU path."""
    x = u.float() + bias.float()
    s = torch.sigmoid(x * (GELU_C1 + GELU_C3 * x * x))
    du = dy.float() * (s + x * s * (1 - s) * (GELU_C1 + 3 * GELU_C3 * x * x))
    return du.to(u.dtype), du.reshape(-1, du.shape[-1]).sum(0)


@triton.jit
def _bias_gelu_bwd_kernel(
    dy_ptr,
    u_ptr,
    bias_ptr,
    du_ptr,
    partial_ptr,
    rows,
    cols,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    C1: tl.constexpr,
    C3: tl.constexpr,
):
    # program (i, j): rows [i * ROWS_PER_PROGRAM, +ROWS_PER_PROGRAM), columns [j * BLOCK_COLS, +BLOCK_COLS)
    row_start = tl.program_id(0) * ROWS_PER_PROGRAM
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = col < cols
    bias = tl.load(bias_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    # summed across rows once, after the walk: a row sum per step is a cross-warp reduction through shared memory
    # with a barrier, which kept each program's next loads from overlapping (2.8 TB/s instead of the ~4.3 of
    # Inductor's GELU backward: docs/kernel_notes.md v39)
    col_sum = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for step in range(0, ROWS_PER_PROGRAM, BLOCK_ROWS):
        row = row_start + step + tl.arange(0, BLOCK_ROWS)
        ok = (row < rows)[:, None] & col_ok[None, :]
        offset = row.to(tl.int64)[:, None] * cols + col[None, :]
        dy = tl.load(dy_ptr + offset, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(u_ptr + offset, mask=ok, other=0.0).to(tl.float32) + bias[None, :]
        x2 = x * x
        s = tl.sigmoid(x * (C1 + C3 * x2))
        du = dy * (s + x * s * (1.0 - s) * (C1 + 3.0 * C3 * x2))  # masked entries: dy = 0, so du = 0
        tl.store(du_ptr + offset, du.to(du_ptr.dtype.element_ty), mask=ok)
        col_sum += du
    tl.store(partial_ptr + tl.program_id(0) * cols + col, tl.sum(col_sum, axis=0), mask=col_ok)


def _backward_out(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """du (u's shape and dtype, contiguous) and the per-program fp32 column sums ``[programs, C]``."""
    cols = u.shape[-1]
    programs = triton.cdiv(u.numel() // cols, ROWS_PER_PROGRAM)
    return torch.empty(u.shape, device=u.device, dtype=u.dtype), u.new_empty((programs, cols), dtype=torch.float32)


# Returns ``_backward_out``'s two tensors, filled. dy and u: contiguous, the same shape.
@custom_op("bias_gelu_backward")
def _bias_gelu_backward_op(dy: torch.Tensor, u: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    du, partial = _backward_out(u)
    cols = u.shape[-1]
    grid = (partial.shape[0], triton.cdiv(cols, BLOCK_COLS))
    _bias_gelu_bwd_kernel[grid](
        dy,
        u,
        bias,
        du,
        partial,
        u.numel() // cols,
        cols,
        ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_COLS=BLOCK_COLS,
        C1=GELU_C1,
        C3=GELU_C3,
        num_warps=4,
    )
    return du, partial


@_bias_gelu_backward_op.register_fake
def _(dy, u, bias):
    return _backward_out(u)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, bias, triton_path):
        ctx.save_for_backward(u, bias)
        ctx.triton_path = triton_path
        return gelu_tanh_fp32(u.float() + bias.float()).to(u.dtype)

    @staticmethod
    def backward(ctx, dy):
        u, bias = ctx.saved_tensors
        dy = dy.to(u.dtype).contiguous()
        if ctx.triton_path:
            du, partial = _bias_gelu_backward_op(dy, u, bias)
            dbias = partial.sum(0)  # fixed reduction order: deterministic
        else:
            du, dbias = bias_gelu_backward_torch(dy, u, bias)
        return du, dbias.to(bias.dtype), None


def bias_gelu(u: torch.Tensor, bias: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``gelu_tanh(u + bias)`` in fp32, rounded once to u's dtype; differentiable in u and bias, whose gradient the
    backward's one pass computes (the module docstring).

    Args:
        u: ``[..., C]``, fp16 / bf16 / fp32, last dim contiguous (e.g. a linear layer's output without its bias).
        bias: ``[C]``; its gradient comes back in its dtype.
        impl: "auto" (the Triton backward on CUDA, PyTorch on CPU), "triton" (also under TRITON_INTERPRET=1),
            "torch".
    """
    if u.ndim < 1 or bias.shape != u.shape[-1:]:
        raise ValueError(
            f"bias_gelu: bias must have shape ({u.shape[-1] if u.ndim else '?'},) (u's last dim), got "
            f"u {tuple(u.shape)} and bias {tuple(bias.shape)}"
        )
    if u.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"bias_gelu: u's dtype must be float16, bfloat16 or float32, got {u.dtype}")
    return _BiasGelu.apply(u.contiguous(), bias, use_triton(u, impl))
