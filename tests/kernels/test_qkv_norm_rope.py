"""qkv_norm_rope (the qkv projection with qk-norm, RoPE, the head layout and the block means in its epilogue) against
an fp64 oracle written here: the projection rounded once to the inputs' dtype (as the kernel and cuBLAS round it),
then RMS norm x / sqrt(mean(x^2) + eps) * w and RoPE as a complex rotation of each pair (x[2j] + i x[2j+1]), in
fp64. On CPU the kernel runs in the interpreter (tests/kernels/conftest.py).

    .venv/bin/python -m pytest tests/kernels/test_qkv_norm_rope.py
    python -m pytest tests/kernels/test_qkv_norm_rope.py -m gpu      # CUDA machine
"""

import pytest
import torch

from pixdit.kernels import qkv_norm_rope as module
from pixdit.kernels.qkv_norm_rope import qkv_norm_rope, qkv_norm_rope_fits, qkv_norm_rope_products

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
# the outputs are one rounding of an fp64 value whose input (qkv) may sit one rounding away from the oracle's
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_inputs(b, n, heads, d, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dim = heads * d
    x = torch.randn(b, n, dim, generator=g).to(device, dtype)
    weight = (torch.randn(3 * dim, dim, generator=g) / dim**0.5).to(device)  # fp32 master weights, as in a model
    bias = (torch.randn(3 * dim, generator=g) * 0.5).to(device)
    q_weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device)
    k_weight = (1 + 0.5 * torch.randn(d, generator=g)).to(device)
    angles = (torch.rand(n, d // 2, generator=g) * 100).to(device)
    return x, weight, bias, q_weight, k_weight, angles


def oracle(x, weight, bias, q_weight, k_weight, angles, heads, eps, pool_block):
    """fp64 q, k, v ``[b, heads, n, d]`` and the block means ``[3, b, heads, n / pool_block, d]``."""
    b, n, dim = x.shape
    d = dim // heads
    dt = x.dtype
    qkv = (x.double() @ weight.to(dt).double().T + bias.to(dt).double()).to(dt).double()  # rounded once
    q, k, v = qkv.view(b, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    rotation = torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())

    def norm_rope(t, w):
        t = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2)).contiguous()) * rotation).flatten(-2)

    q, k = norm_rope(q, q_weight), norm_rope(k, k_weight)
    if pool_block is None:
        return q, k, v, None
    means = torch.stack([t.unflatten(2, (n // pool_block, pool_block)).mean(3) for t in (q, k, v)])
    return q, k, v, means


def compare(b, n, heads, d, dtype, device, pool_block, impl="auto", eps=1e-5):
    x, weight, bias, q_weight, k_weight, angles = make_inputs(b, n, heads, d, dtype, device)
    with torch.no_grad():
        outs = qkv_norm_rope(
            x, weight, bias, q_weight, k_weight, angles.cos(), angles.sin(), heads, eps, pool_block, impl=impl
        )
    want = oracle(x.cpu(), weight.cpu(), bias.cpu(), q_weight.cpu(), k_weight.cpu(), angles.cpu(), heads, eps,
                  pool_block)  # fmt: skip
    assert len(outs) == (3 if pool_block is None else 4)
    tol = TOL[dtype]
    for name, got, ref in zip("qkv", outs[:3], want[:3]):
        assert got.shape == (b, heads, n, d) and got.dtype == dtype, name
        scale = ref.abs().max().item()
        torch.testing.assert_close(got.cpu().double(), ref, atol=tol * scale, rtol=tol, msg=name)
    if pool_block is not None:
        assert outs[3].shape == (3, b, heads, n // pool_block, d) and outs[3].dtype == torch.float32
        torch.testing.assert_close(outs[3].cpu().double(), want[3], atol=tol * want[3].abs().max().item(), rtol=tol)


@interpreter_only
@pytest.mark.parametrize(
    "b,n,heads,d,pool_block",
    [
        (2, 64, 3, 64, 16),  # 64-row tiles; 576 channels: tiles of 128 straddle q / k and v ends in padding
        (1, 128, 4, 32, None),  # 128-row tiles, four heads per tile, no means
        (1, 64, 2, 128, 64),  # one head per tile, one block per tile
    ],
)
@pytest.mark.parametrize("tma", [False, True], ids=["pointer loads", "TMA loads"])
def test_interpreted_triton_matches_oracle(b, n, heads, d, pool_block, tma, monkeypatch):
    monkeypatch.setattr(module, "TMA_LOADS", tma)
    compare(b, n, heads, d, torch.float16, "cpu", pool_block, impl="triton")


@interpreter_only
@pytest.mark.parametrize("tma", [False, True], ids=["pointer loads", "TMA loads"])
def test_interpreted_products_are_the_projection(tma, monkeypatch):
    """The benchmarks' products-only launch (the GEMM without the epilogue) computes F.linear, rounded once."""
    monkeypatch.setattr(module, "TMA_LOADS", tma)
    x, weight, bias, *_ = make_inputs(2, 64, 3, 64, torch.float16, "cpu")
    got = qkv_norm_rope_products(x, weight.half(), bias.half())
    want = (x.double() @ weight.half().double().T + bias.half().double()).half()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_torch_path_matches_oracle():
    compare(2, 48, 3, 16, torch.float16, "cpu", 16, impl="torch")  # shapes the kernel does not take: the ref runs


def test_fits_names_the_kernel_shapes():
    x = torch.empty(2, 256, 384)
    assert qkv_norm_rope_fits(x, 6, 16) and qkv_norm_rope_fits(x, 6, None)
    assert not qkv_norm_rope_fits(x, 4, 16)  # head_dim 96: not a power of two
    assert not qkv_norm_rope_fits(torch.empty(2, 250, 384), 6, None)  # tokens not a multiple of 64
    assert not qkv_norm_rope_fits(x, 6, 128)  # blocks larger than a 64-row tile may be
    assert not qkv_norm_rope_fits(torch.empty(2, 256, 1152), 16, 16)  # head_dim 72 (DiT-XL)


def test_bad_inputs_name_the_parameter():
    x, weight, bias, q_weight, k_weight, angles = make_inputs(1, 64, 2, 32, torch.float16, "cpu")
    cos, sin = angles.cos(), angles.sin()
    with pytest.raises(ValueError, match="weight must be"):
        qkv_norm_rope(x, weight[:, :10], bias, q_weight, k_weight, cos, sin, 2)
    with pytest.raises(ValueError, match="cos must have shape"):
        qkv_norm_rope(x, weight, bias, q_weight, k_weight, cos[:10], sin, 2)
    with pytest.raises(ValueError, match="no backward"):  # a forward only: refuse what would need gradients
        qkv_norm_rope(x, weight.requires_grad_(), bias, q_weight, k_weight, cos, sin, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="tokens a multiple of 64"):
        qkv_norm_rope(x[:, :40], weight, bias, q_weight, k_weight, cos[:40], sin[:40], 2, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,n,heads,d,pool_block", [(2, 4096, 6, 64, 16), (1, 1088, 3, 64, None), (2, 1024, 4, 128, 64), (1, 256, 8, 32, 16)]
)
def test_gpu_matches_oracle(b, n, heads, d, pool_block, dtype):
    compare(b, n, heads, d, dtype, "cuda", pool_block)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("b,n,heads,d,pool_block", [(2, 4096, 6, 64, 16), (1, 1088, 3, 64, None)])
def test_gpu_tma_loads_match_oracle(b, n, heads, d, pool_block, monkeypatch):
    monkeypatch.setattr(module, "TMA_LOADS", True)
    compare(b, n, heads, d, torch.bfloat16, "cuda", pool_block)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_compiled_equals_eager_and_autocast():
    """Through torch.compile (the custom op) the same bits as eager; fp32 x under bf16 autocast runs in bf16."""
    x, weight, bias, q_weight, k_weight, angles = make_inputs(2, 4096, 6, 64, torch.bfloat16, "cuda")
    cos, sin = angles.cos(), angles.sin()

    def call(x):
        return qkv_norm_rope(x, weight, bias, q_weight, k_weight, cos, sin, 6, 1e-5, 16)

    with torch.no_grad():
        eager = call(x)
        compiled = torch.compile(call, fullgraph=True)(x)
        with torch.autocast("cuda", torch.bfloat16):
            cast = call(x.float())
    for a, c, e in zip(eager, compiled, cast):
        assert torch.equal(a, c) and torch.equal(a, e)
