"""qk-norm + 2-D RoPE + head layout in one pass: the DiT attention's prologue (spec llsa.md §8), forward and backward.

    from pixdit.kernels import qk_norm_rope
    q, k, v = qk_norm_rope(qkv, num_heads, q_weight, k_weight, cos, sin, eps=1e-5)
    # qkv: [batch, tokens, 3 * heads * head_dim], the qkv projection's output -> q, k, v: [batch, heads, tokens, head_dim]

Per token and head: ``q = rope(rms_norm(q_raw) * q_weight)``, the same for k with ``k_weight``, v unchanged, where
``rms_norm(x) = x / sqrt(mean(x^2) + eps)`` over head_dim and ``rope`` rotates the interleaved pairs
``(x[2j], x[2j+1])`` by the angle whose cos / sin are ``cos[token, j]`` / ``sin[token, j]``.

Why a kernel: in eager PyTorch this is ~15 memory-bound passes over [tokens, dim] tensors per layer (norms, fp32
casts, four multiplies and a stack per RoPE, the transposes to [batch, heads, tokens, head_dim] that the attention
kernels read); torch.compile fuses them but its kernel ran at about a quarter of the H200's bandwidth. Here the
forward reads qkv once and writes q, k, v once, contiguous in the layout the attention kernels flatten without a copy;
the backward reads the three gradients and qkv once and writes d(qkv) once. Math in fp32, one rounding at the store
(the PyTorch path rounds after the norm and again in RoPE, as the model did before this kernel). The weight gradients
are per-program partial sums added in a fixed order: deterministic, no atomics.

CPU tensors (and ``impl="torch"``) run ``qk_norm_rope_torch``, the plain PyTorch composition.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .block_sparse import _use_triton

__all__ = ["apply_rope", "qk_norm_rope", "qk_norm_rope_torch"]

ROWS_PER_PROGRAM = 64   # tokens per program; one (tokens, head) tile of q, k or v per program


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs: (a, b) -> (a cos - b sin, a sin + b cos). x: [..., tokens, heads, head_dim];
    cos / sin: [tokens, head_dim / 2]."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # broadcast over heads
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps=1e-5):
    """The PyTorch composition (CPU path and the model's behaviour before the kernel). Returns [b, heads, n, d] views."""
    b, n, width = qkv.shape
    head_dim = width // (3 * num_heads)
    q, k, v = qkv.view(b, n, 3, num_heads, head_dim).unbind(2)
    # Under CUDA autocast the norms may return fp32: cast back so q, k, v share one dtype.
    q = F.rms_norm(q, (head_dim,), q_weight.to(q.dtype), eps).to(v.dtype)
    k = F.rms_norm(k, (head_dim,), k_weight.to(k.dtype), eps).to(v.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@triton.jit
def _tile(qkv_ptr, bh, part, tile, num_heads, n, stride_b, stride_n,
          HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr):
    """Pointers to the even elements of one [ROWS, HEAD_DIM] tile in qkv ([b, n, 3, heads, d]) and in the
    [3, b, heads, n, d] layout (the odd elements are the next ones), the pair index, and the mask of real rows and
    pairs (PAIRS = head_dim / 2 rounded up to a power of two)."""
    b = bh // num_heads
    head = bh % num_heads
    rows = tile * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, PAIRS)
    mask = (rows < n)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    src = qkv_ptr + b * stride_b + rows[:, None] * stride_n + (part * num_heads + head) * HEAD_DIM + 2 * pairs[None, :]
    dst = (part * tl.num_programs(1) + bh).to(tl.int64) * n * HEAD_DIM + rows[:, None] * HEAD_DIM + 2 * pairs[None, :]
    return src, dst, rows, pairs, mask


@triton.jit
def _forward_kernel(QKV, W, COS, SIN, OUT, n, num_heads, stride_b, stride_n, eps,
                    HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr):
    tile, bh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)   # part: 0 = q, 1 = k, 2 = v
    src, dst, rows, pairs, mask = _tile(QKV, bh, part, tile, num_heads, n, stride_b, stride_n, HEAD_DIM, PAIRS, ROWS)
    pair_ok = pairs < HEAD_DIM // 2
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    if part < 2:
        inv_rms = tl.math.rsqrt((tl.sum(even * even, 1) + tl.sum(odd * odd, 1)) / HEAD_DIM + eps)[:, None]
        even = even * inv_rms * tl.load(W + part * HEAD_DIM + 2 * pairs, mask=pair_ok, other=0.0)[None, :]
        odd = odd * inv_rms * tl.load(W + part * HEAD_DIM + 2 * pairs + 1, mask=pair_ok, other=0.0)[None, :]
        angle = rows[:, None] * (HEAD_DIM // 2) + pairs[None, :]
        cos = tl.load(COS + angle, mask=mask, other=0.0)
        sin = tl.load(SIN + angle, mask=mask, other=0.0)
        even, odd = even * cos - odd * sin, even * sin + odd * cos
    tl.store(OUT + dst, even.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + dst + 1, odd.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(QKV, W, COS, SIN, DQ, DK, DV, DQKV, DW_PARTIAL, n, num_heads, stride_b, stride_n,
                     stride_db, stride_dn, eps, HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, ROWS: tl.constexpr):
    tile, bh, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src, dst, rows, pairs, mask = _tile(QKV, bh, part, tile, num_heads, n, stride_b, stride_n, HEAD_DIM, PAIRS, ROWS)
    pair_ok = pairs < HEAD_DIM // 2
    out_offset = dst - (part * tl.num_programs(1)).to(tl.int64) * n * HEAD_DIM   # [b, heads, n, d] of one part
    d_src = DQKV + (bh // num_heads) * stride_db + rows[:, None] * stride_dn \
        + (part * num_heads + bh % num_heads) * HEAD_DIM + 2 * pairs[None, :]
    if part == 2:
        dv_even = tl.load(DV + out_offset, mask=mask, other=0.0)   # v: only the layout changes
        dv_odd = tl.load(DV + out_offset + 1, mask=mask, other=0.0)
        tl.store(d_src, dv_even.to(DQKV.dtype.element_ty), mask=mask)
        tl.store(d_src + 1, dv_odd.to(DQKV.dtype.element_ty), mask=mask)
    else:
        if part == 0:
            g_even = tl.load(DQ + out_offset, mask=mask, other=0.0).to(tl.float32)
            g_odd = tl.load(DQ + out_offset + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            g_even = tl.load(DK + out_offset, mask=mask, other=0.0).to(tl.float32)
            g_odd = tl.load(DK + out_offset + 1, mask=mask, other=0.0).to(tl.float32)
        angle = rows[:, None] * (HEAD_DIM // 2) + pairs[None, :]
        cos = tl.load(COS + angle, mask=mask, other=0.0)
        sin = tl.load(SIN + angle, mask=mask, other=0.0)
        # RoPE's adjoint is the rotation by the opposite angle: the gradient w.r.t. the normalised, weighted y
        dy_even = g_even * cos + g_odd * sin
        dy_odd = g_odd * cos - g_even * sin
        x_even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x_odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt((tl.sum(x_even * x_even, 1) + tl.sum(x_odd * x_odd, 1)) / HEAD_DIM + eps)[:, None]
        xhat_even, xhat_odd = x_even * inv_rms, x_odd * inv_rms
        w_even = tl.load(W + part * HEAD_DIM + 2 * pairs, mask=pair_ok, other=0.0)[None, :]
        w_odd = tl.load(W + part * HEAD_DIM + 2 * pairs + 1, mask=pair_ok, other=0.0)[None, :]
        # d weight: this program's partial sum over its rows (masked rows load 0 and contribute 0)
        partial = DW_PARTIAL + ((part * tl.num_programs(1) + bh) * tl.num_programs(0) + tile) * HEAD_DIM + 2 * pairs
        tl.store(partial, tl.sum(dy_even * xhat_even, 0), mask=pair_ok)
        tl.store(partial + 1, tl.sum(dy_odd * xhat_odd, 0), mask=pair_ok)
        # d x = inv_rms * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dy * w
        dxhat_even, dxhat_odd = dy_even * w_even, dy_odd * w_odd
        mean_dot = ((tl.sum(dxhat_even * xhat_even, 1) + tl.sum(dxhat_odd * xhat_odd, 1)) / HEAD_DIM)[:, None]
        tl.store(d_src, (inv_rms * (dxhat_even - xhat_even * mean_dot)).to(DQKV.dtype.element_ty), mask=mask)
        tl.store(d_src + 1, (inv_rms * (dxhat_odd - xhat_odd * mean_dot)).to(DQKV.dtype.element_ty), mask=mask)


def _grid(b, n, num_heads):
    return (triton.cdiv(n, ROWS_PER_PROGRAM), b * num_heads, 3)


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, num_heads, eps):
        b, n, width = qkv.shape
        head_dim = width // (3 * num_heads)
        weights = torch.stack([q_weight, k_weight]).float().contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        out = torch.empty(3, b, num_heads, n, head_dim, device=qkv.device, dtype=qkv.dtype)
        _forward_kernel[_grid(b, n, num_heads)](qkv, weights, cos, sin, out, n, num_heads, qkv.stride(0),
                                                 qkv.stride(1), eps, HEAD_DIM=head_dim,
                                                 PAIRS=triton.next_power_of_2(head_dim // 2), ROWS=ROWS_PER_PROGRAM)
        ctx.save_for_backward(qkv, weights, cos, sin)
        ctx.num_heads, ctx.eps, ctx.weight_dtypes = num_heads, eps, (q_weight.dtype, k_weight.dtype)
        return out[0], out[1], out[2]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, weights, cos, sin = ctx.saved_tensors
        b, n, width = qkv.shape
        num_heads = ctx.num_heads
        head_dim = width // (3 * num_heads)
        grid = _grid(b, n, num_heads)
        zeros = None
        grads = []
        for g in (dq, dk, dv):   # a q/k/v that did not reach the loss has no gradient
            if g is None:
                zeros = zeros if zeros is not None else torch.zeros(b, num_heads, n, head_dim, device=qkv.device,
                                                                    dtype=qkv.dtype)
                g = zeros
            grads.append(g.contiguous())
        dqkv = torch.empty(b, n, width, device=qkv.device, dtype=qkv.dtype)
        dw_partial = torch.empty(2, b * num_heads, grid[0], head_dim, device=qkv.device, dtype=torch.float32)
        _backward_kernel[grid](qkv, weights, cos, sin, *grads, dqkv, dw_partial, n, num_heads, qkv.stride(0),
                               qkv.stride(1), dqkv.stride(0), dqkv.stride(1), ctx.eps, HEAD_DIM=head_dim,
                               PAIRS=triton.next_power_of_2(head_dim // 2), ROWS=ROWS_PER_PROGRAM)
        dw = dw_partial.sum(dim=(1, 2))   # fixed reduction order: deterministic
        (q_dtype, k_dtype) = ctx.weight_dtypes
        return dqkv, dw[0].to(q_dtype), dw[1].to(k_dtype), None, None, None, None


@torch.compiler.disable  # opaque to torch.compile (see pixdit.kernels)
def qk_norm_rope(qkv: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-5, impl: str = "auto"):
    """RMS qk-norm with per-channel weights, 2-D RoPE on q and k, and the head split, differentiable in qkv and
    both weights.

    Args:
        qkv: ``[batch, tokens, 3 * num_heads * head_dim]`` (q, k, v concatenated, each heads-major), last dim
            contiguous. Triton path: fp16/bf16/fp32, an even head_dim up to 256.
        q_weight, k_weight: ``[head_dim]`` norm weights (shared across heads).
        cos, sin: ``[tokens, head_dim / 2]`` rotation of each interleaved pair (fp32).
        eps: added to the mean square.
        impl: "auto" (Triton on CUDA, PyTorch on CPU), "triton" (also under TRITON_INTERPRET=1), "torch".
    Returns:
        q, k, v: ``[batch, num_heads, tokens, head_dim]`` in qkv's dtype (contiguous on the Triton path).
    """
    if qkv.ndim != 3 or num_heads < 1 or qkv.shape[-1] % (3 * num_heads):
        raise ValueError(f"qk_norm_rope: qkv must be [batch, tokens, 3 * num_heads * head_dim] with "
                         f"num_heads={num_heads}, got shape {tuple(qkv.shape)}")
    b, n, width = qkv.shape
    head_dim = width // (3 * num_heads)
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (head_dim,):
            raise ValueError(f"qk_norm_rope: {name} must have shape ({head_dim},) (head_dim), got {tuple(weight.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (n, head_dim // 2):
            raise ValueError(f"qk_norm_rope: {name} must have shape ({n}, {head_dim // 2}) (tokens, head_dim / 2), "
                             f"got {tuple(table.shape)}")
    if not _use_triton(qkv, impl):
        return qk_norm_rope_torch(qkv, num_heads, q_weight, k_weight, cos, sin, eps)
    if qkv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qk_norm_rope: qkv dtype must be float16, bfloat16 or float32, got {qkv.dtype}")
    if head_dim % 2 or head_dim > 256:
        raise ValueError(f"qk_norm_rope: head_dim must be even and at most 256 on the Triton path, got {head_dim}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _QKNormRope.apply(qkv, q_weight, k_weight, cos, sin, num_heads, float(eps))
