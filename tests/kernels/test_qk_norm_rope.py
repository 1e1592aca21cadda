"""qk_norm_rope (qk-norm + 2-D RoPE + head layout) against an fp64 oracle written independently here: RMS norm as
x / sqrt(mean(x^2) + eps) * w, RoPE as multiplying each pair (x[2j] + i x[2j+1]) by exp(i angle). Forward and the
gradients of qkv and both weights. On CPU the Triton kernels run in the interpreter (tests/kernels/conftest.py).

    .venv/bin/python -m pytest tests/kernels/test_qk_norm_rope.py
    python -m pytest tests/kernels/test_qk_norm_rope.py -m gpu      # CUDA machine
"""

import pytest
import torch

from pixdit.kernels import qk_norm_rope
from pixdit.kernels.blocks import block_mean

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def oracle(qkv, num_heads, q_weight, k_weight, angles, eps):
    """fp64: q, k, v as [b, heads, n, d]."""
    b, n, width = qkv.shape
    d = width // (3 * num_heads)
    q, k, v = qkv.double().view(b, n, 3, num_heads, d).permute(2, 0, 3, 1, 4)  # [b, heads, n, d] each
    rotation = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())  # [n, d / 2]

    def norm_rope(x, weight):
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * rotation).flatten(-2)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v


def make_inputs(b, n, heads, d, dtype, device, seed=0, width_pad=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    width = 3 * heads * d
    # width_pad > 0: qkv is a slice of a wider tensor (token stride != width), as a fused bigger projection would give
    qkv = (torch.randn(b, n, width + width_pad, generator=g) * 2)[..., :width].to(device, dtype).requires_grad_()
    q_weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device).requires_grad_()
    k_weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device).requires_grad_()
    angles = torch.rand(n, d // 2, generator=g).to(device) * 100
    upstream = [torch.randn(b, heads, n, d, generator=g).to(device, dtype) for _ in range(3)]
    return qkv, q_weight, k_weight, angles, upstream


def compare(b, n, heads, d, dtype, device, impl, tol, width_pad=0, eps=1e-5, with_bias=False):
    """With ``with_bias``: an fp32 bias of qkv's channels (the projection's, left out of its matmul) and its gradient."""
    qkv, q_weight, k_weight, angles, upstream = make_inputs(b, n, heads, d, dtype, device, width_pad=width_pad)
    inputs = [qkv, q_weight, k_weight]
    bias = None
    if with_bias:
        g = torch.Generator().manual_seed(7)
        bias = torch.randn(3 * heads * d, generator=g).to(device).requires_grad_()
        inputs.append(bias)
    outs = qk_norm_rope(qkv, heads, q_weight, k_weight, angles.cos(), angles.sin(), eps=eps, impl=impl, bias=bias)
    grads = torch.autograd.grad(outs, inputs, upstream)
    leaves = [x.detach().double().requires_grad_() for x in inputs]
    biased = leaves[0] + leaves[3] if with_bias else leaves[0]
    want = oracle(biased, heads, leaves[1], leaves[2], angles, eps)
    want_grads = torch.autograd.grad(want, leaves, [u.double() for u in upstream])
    names = ("q", "k", "v", "dqkv", "dq_weight", "dk_weight", "dbias")
    for name, got, ref in zip(names, (*outs, *grads), (*want, *want_grads)):
        assert got.dtype == (dtype if name in ("q", "k", "v", "dqkv") else torch.float32), name
        assert got.shape == ref.shape, name
        error = ((got.double() - ref).norm() / ref.norm()).item()
        assert error < tol, f"{name}: relative error {error:.2e} (tolerance {tol:.0e})"
    return outs


@interpreter_only
@pytest.mark.parametrize(
    "b,n,heads,d,width_pad", [(2, 70, 3, 16, 0), (1, 33, 2, 64, 0), (3, 128, 1, 32, 8), (1, 20, 2, 24, 0)]
)  # 24: 12 pairs, padded to 16 in the kernel
def test_interpreted_triton_matches_oracle(b, n, heads, d, width_pad):
    outs = compare(b, n, heads, d, torch.float32, "cpu", "triton", 1e-5, width_pad=width_pad)
    assert all(o.is_contiguous() for o in outs)  # the layout the attention kernels flatten without a copy


@pytest.mark.parametrize("b,n,heads,d", [(2, 70, 3, 16), (1, 33, 2, 64)])
def test_torch_path_matches_oracle(b, n, heads, d):
    compare(b, n, heads, d, torch.float32, "cpu", "torch", 1e-6)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=interpreter_only), "torch"])
@pytest.mark.parametrize("b,n,heads,d", [(2, 70, 3, 16), (1, 20, 2, 24)])  # a partial last tile; head_dim padded
def test_bias_and_its_gradient_match_oracle(b, n, heads, d, impl):
    compare(b, n, heads, d, torch.float32, "cpu", impl, 1e-5, with_bias=True)


def test_bias_with_v_view_is_refused():
    qkv, q_weight, k_weight, angles, _ = make_inputs(1, 8, 2, 16, torch.float32, "cpu")
    args = (qkv, 2, q_weight, k_weight, angles.cos(), angles.sin())
    with pytest.raises(ValueError, match=r"bias must be None or of shape \(96,\) \(qkv's last dim\), and None with"):
        qk_norm_rope(*args, bias=torch.zeros(96), v_view=True)
    with pytest.raises(ValueError, match=r"bias must be None or of shape \(96,\).*got shape \(95,\)"):
        qk_norm_rope(*args, bias=torch.zeros(95))


@interpreter_only
def test_interpreted_triton_only_q_used():
    """A q, k or v that does not reach the loss has no gradient (None in backward): d(qkv) there is zero."""
    qkv, q_weight, k_weight, angles, _ = make_inputs(1, 40, 2, 16, torch.float32, "cpu")
    q, k, v = qk_norm_rope(qkv, 2, q_weight, k_weight, angles.cos(), angles.sin(), impl="triton")
    q.sum().backward()
    grad = qkv.grad.view(1, 40, 3, 2, 16)
    assert grad[:, :, 0].abs().sum() > 0 and grad[:, :, 1:].abs().sum() == 0
    assert q_weight.grad.abs().sum() > 0 and k_weight.grad.abs().sum() == 0


def check_pooled(b, n, heads, d, dtype, device, impl, pool_block):
    """With pool_block: q, k, v and every gradient are bitwise those without it, and the means are block_mean of the
    returned q, k, v (to fp32 rounding: the kernel sums a block in its own order)."""
    qkv, q_weight, k_weight, angles, upstream = make_inputs(b, n, heads, d, dtype, device)
    args = (qkv, heads, q_weight, k_weight, angles.cos(), angles.sin())
    *outs, means = qk_norm_rope(*args, impl=impl, pool_block=pool_block)
    plain = qk_norm_rope(*args, impl=impl)
    assert all(torch.equal(a, b) for a, b in zip(outs, plain))
    assert means.dtype == torch.float32 and not means.requires_grad
    want = torch.stack([block_mean(x.detach(), pool_block) for x in outs])
    assert means.shape == want.shape == (3, b, heads, n // pool_block, d)
    assert (means - want).abs().max() <= 1e-6 * want.abs().max()
    grads = torch.autograd.grad(outs, (qkv, q_weight, k_weight), upstream)
    assert all(
        torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(plain, (qkv, q_weight, k_weight), upstream))
    )


@interpreter_only
@pytest.mark.parametrize(
    "b,n,heads,d,pool_block,dtype",
    [
        (2, 80, 3, 16, 16, torch.float32),  # the last program's 64 rows hold one real block of 16
        (1, 256, 2, 32, 128, torch.float32),  # blocks longer than a program's 64 rows: 128-row programs
        (1, 96, 2, 24, 32, torch.bfloat16),  # head_dim padded to 32 in the kernel; means of the rounded outputs
    ],
)
def test_interpreted_triton_block_means(b, n, heads, d, pool_block, dtype):
    check_pooled(b, n, heads, d, dtype, "cpu", "triton", pool_block)


def test_torch_path_block_means():
    check_pooled(2, 64, 2, 16, torch.float32, "cpu", "torch", 16)


def check_v_view(b, n, heads, d, dtype, device, pool_block):
    """With v_view: v is qkv's v columns in place (no copy), and q, k, the means and every gradient are bitwise those
    of the call that writes v (v's gradient then reaches qkv through the view)."""
    qkv, q_weight, k_weight, angles, upstream = make_inputs(b, n, heads, d, dtype, device)
    args = (qkv, heads, q_weight, k_weight, angles.cos(), angles.sin())
    viewed = qk_norm_rope(*args, impl="triton", pool_block=pool_block, v_view=True)
    plain = qk_norm_rope(*args, impl="triton", pool_block=pool_block)
    v = viewed[2]
    assert v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() and not v.is_contiguous()
    assert v.shape == (b, heads, n, d)
    assert all(torch.equal(x, y) for x, y in zip(viewed, plain))  # q, k, v (and the means)
    leaves = (qkv, q_weight, k_weight)
    got = torch.autograd.grad(viewed[:3], leaves, upstream)
    want = torch.autograd.grad(plain[:3], leaves, upstream)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@interpreter_only
@pytest.mark.parametrize("pool_block", [None, 16])
def test_interpreted_triton_v_view(pool_block):
    check_v_view(2, 80, 3, 16, torch.float32, "cpu", pool_block)


def test_bad_inputs_name_the_parameter():
    qkv, q_weight, k_weight, angles, _ = make_inputs(1, 8, 2, 16, torch.float32, "cpu")
    cos, sin = angles.cos(), angles.sin()
    with pytest.raises(ValueError, match="qkv must be .batch, tokens, 3 . num_heads . head_dim. with num_heads=5"):
        qk_norm_rope(qkv, 5, q_weight, k_weight, cos, sin)
    with pytest.raises(ValueError, match=r"k_weight must have shape \(16,\)"):
        qk_norm_rope(qkv, 2, q_weight, k_weight[:8], cos, sin)
    with pytest.raises(ValueError, match=r"sin must have shape \(8, 8\) \(tokens, head_dim / 2\)"):
        qk_norm_rope(qkv, 2, q_weight, k_weight, cos, sin[:4])
    with pytest.raises(ValueError, match="head_dim must be even and at most 256"):
        qkv7 = torch.zeros(1, 8, 3 * 2 * 7)
        qk_norm_rope(qkv7, 2, torch.ones(7), torch.ones(7), torch.ones(8, 3), torch.ones(8, 3), impl="triton")
    for pool_block in (3, 0, 16, 256, True, 4.0):  # not a power of two; zero; 8 tokens; over 128; not an int
        with pytest.raises(
            ValueError,
            match=f"pool_block must be None or a power of two up to 128 that divides tokens=8, got {pool_block!r}",
        ):
            qk_norm_rope(qkv, 2, q_weight, k_weight, cos, sin, pool_block=pool_block)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,n,heads,d", [(4, 4096, 6, 64), (2, 1000, 3, 128), (1, 16384, 6, 64), (2, 1024, 16, 72)])
def test_gpu_matches_oracle(b, n, heads, d, dtype):
    compare(b, n, heads, d, dtype, "cuda", "triton", TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,n,heads,d", [(4, 4096, 6, 64), (2, 1000, 3, 128)])
def test_gpu_bias_matches_oracle(b, n, heads, d, dtype):
    compare(b, n, heads, d, dtype, "cuda", "triton", TOL[dtype], with_bias=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,pool_block", [(4096, 16), (1024, 128), (1040, 16)])
def test_gpu_block_means(n, pool_block, dtype):
    check_pooled(2, n, 6, 64, dtype, "cuda", "triton", pool_block)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pool_block", [None, 16])
def test_gpu_v_view(pool_block):
    check_v_view(2, 4096, 6, 64, torch.bfloat16, "cuda", pool_block)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_backward_is_deterministic():
    results = []
    for _ in range(2):
        qkv, q_weight, k_weight, angles, upstream = make_inputs(4, 4096, 6, 64, torch.bfloat16, "cuda")
        outs = qk_norm_rope(qkv, 6, q_weight, k_weight, angles.cos(), angles.sin())
        results.append(torch.autograd.grad(outs, (qkv, q_weight, k_weight), upstream))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_more_than_2_31_elements():
    """30 images of 256^2 tokens x 1152 channels: 2.26e9 elements in qkv, so offsets pass 2^31 (they wrapped to an
    illegal address when computed in int32). Every output element depends on its own token only, so the last image
    of the big batch must equal, bit for bit, the kernel run on a copy of that image alone (forward and d(qkv)); and
    that image matches the fp64 oracle."""
    b, n, heads, d = 30, 65536, 6, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, n, 3 * heads * d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    q_weight, k_weight = (1 + 0.5 * torch.randn(2, d, device="cuda", generator=g)).unbind(0)
    angles = torch.rand(n, d // 2, device="cuda", generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    upstream = [torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    outs = qk_norm_rope(qkv, heads, q_weight, k_weight, cos, sin, impl="triton")
    (dqkv,) = torch.autograd.grad(outs, (qkv,), upstream)
    got = [x[-1:].clone() for x in (*outs, dqkv)]
    del outs, dqkv
    last = qkv[-1:].detach().clone().requires_grad_()
    alone = qk_norm_rope(last, heads, q_weight, k_weight, cos, sin, impl="triton")
    (alone_dqkv,) = torch.autograd.grad(alone, (last,), [u[-1:] for u in upstream])
    for name, x, y in zip(("q", "k", "v", "dqkv"), got, (*alone, alone_dqkv)):
        assert torch.equal(x, y), f"{name}: the last image of the batch differs from the same image run alone"
    leaf = last.detach().double().requires_grad_()
    want = oracle(leaf, heads, q_weight, k_weight, angles, 1e-5)
    (want_dqkv,) = torch.autograd.grad(want, (leaf,), [u[-1:].double() for u in upstream])
    for name, x, ref in zip(("q", "k", "v", "dqkv"), got, (*want, want_dqkv)):
        error = ((x.double() - ref).norm() / ref.norm()).item()
        assert error < TOL[torch.bfloat16], f"{name}: relative error {error:.2e}"
