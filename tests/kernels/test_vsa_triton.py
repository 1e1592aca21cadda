"""VSA's Triton path: under TRITON_INTERPRET=1 on CPU (fp32, tiny sizes) against the fp64 dense oracle, and on the GPU
(``-m gpu``, bf16/fp16 at real sizes) against the exact fp32 PyTorch path.

    .venv/bin/python -m pytest tests/kernels/test_vsa_triton.py  # CPU: interpreter (see tests/kernels/conftest.py)
    python -m pytest tests/kernels/test_vsa_triton.py -m gpu  # CUDA machine
"""

import pytest
import torch
import torch.nn.functional as F

from pixdit.kernels import vsa_attention, vsa_select
from pixdit.kernels.blocks import block_mean, block_means
from pixdit.kernels.reference import vsa_reference
from pixdit.kernels.vsa import _add_coarse

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(q, k, v, gate, upstream, **kwargs):
    inputs = [q, k, v] + ([gate] if gate is not None else [])
    out = vsa_attention(q, k, v, gate=gate, **kwargs)
    return [out.detach()] + list(torch.autograd.grad(out, inputs, upstream))


def _inputs(b, h, n, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, device=device).to(dtype).requires_grad_() for _ in range(5)]


@interpreter_only
@pytest.mark.parametrize(
    "b,h,n,d,block_size,topk",
    # 300 tokens: 19 tiles, so the key-major backward splits its lists and the pooled adjoint of k, v is added after
    # the split sums; the other shapes take the in-kernel add (partial last tiles: 70, 130, 300 tokens)
    [(2, 1, 70, 32, 16, 2), (1, 2, 130, 64, 64, 1), (1, 1, 64, 128, 32, 2), (1, 1, 300, 16, 16, 3)],
)
def test_interpreted_triton_matches_oracle(b, h, n, d, block_size, topk):
    q, k, v, gate, upstream = _inputs(b, h, n, d)
    got = _run(q, k, v, gate, upstream.detach(), block_size=block_size, topk=topk, impl="triton")
    tile_idx = vsa_select(q, k, block_size=block_size, topk=topk, impl="triton")  # the same selection path
    qd, kd, vd, gd = (x.detach().double().requires_grad_() for x in (q, k, v, gate))
    ref = vsa_reference(qd, kd, vd, block_size, topk, gate=gd, tile_idx=tile_idx)
    want = [ref.detach()] + list(torch.autograd.grad(ref, [qd, kd, vd, gd], upstream.detach().double()))
    for name, a, r in zip(("out", "dq", "dk", "dv", "dgate"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), r, atol=1e-4, rtol=1e-4, msg=name)


@interpreter_only
def test_interpreted_triton_all_tiles_is_full_attention_and_deterministic():
    q, k, v, _, upstream = _inputs(1, 2, 48, 32, seed=1)
    zero_gate = torch.zeros_like(q).requires_grad_()
    a = _run(q, k, v, zero_gate, upstream.detach(), block_size=16, topk=3, impl="triton")
    b = _run(q, k, v, zero_gate, upstream.detach(), block_size=16, topk=3, impl="triton")
    full = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(a[0], full.detach(), atol=1e-5, rtol=1e-5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@interpreter_only
@pytest.mark.parametrize("gated,fine_gate", [(True, False), (False, True)])
def test_interpreted_output_is_tokens_major_and_takes_its_gradient_in_any_layout(gated, fine_gate):
    """The Triton path returns a transposed view of a tokens-major [b, n, h, d] tensor, as LLSA does (a model's
    projection reads it without a copy); its gradient arriving in that layout (the model's case) or as a plain
    [b, h, n, d] tensor gives the same gradients, bit for bit, those of q, k, v and of both gates included."""
    q, k, v, gate, upstream = _inputs(1, 2, 70, 16, seed=3)
    gate_fine = torch.randn_like(q).requires_grad_() if fine_gate else None
    extra = ([gate] if gated else []) + ([gate_fine] if fine_gate else [])

    def run(go):
        out = vsa_attention(q, k, v, 16, topk=2, gate=gate if gated else None, gate_fine=gate_fine, impl="triton")
        return [out.detach()] + list(torch.autograd.grad(out, [q, k, v] + extra, go))

    want = run(upstream.detach())
    assert want[0].shape == (1, 2, 70, 16) and want[0].transpose(1, 2).is_contiguous()
    tokens_major = upstream.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert all(torch.equal(a, b) for a, b in zip(run(tokens_major), want))


def _combine_case(b, h, n, d, c, gated, dtype, device, seed=0):
    """The gated combination ``O_fine + gate * O_coarse`` (tile broadcast) against the same expression in fp64
    PyTorch: output and the gradients of all three inputs. The gate is a head-split view of a ``[b, n, h, d]``
    projection (not contiguous), as the model passes it."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = -(-n // c)
    fine = torch.randn(b, h, n, d, generator=g, device=device).to(dtype).requires_grad_()
    coarse = torch.randn(b, h, t, d, generator=g, device=device).to(dtype).requires_grad_()
    gate = torch.randn(b, n, h, d, generator=g, device=device).to(dtype).transpose(1, 2) if gated else None
    inputs = [fine, coarse] + ([gate.requires_grad_()] if gated else [])
    upstream = torch.randn(b, h, n, d, generator=g, device=device).to(dtype)
    out = _add_coarse(fine, coarse, gate, c)
    got = [out] + list(torch.autograd.grad(out, inputs, upstream))
    exact = [x.detach().double().requires_grad_() for x in inputs]
    broadcast = exact[1].repeat_interleave(c, dim=2)[:, :, :n]
    ref = exact[0] + (broadcast * exact[2] if gated else broadcast)
    want = [ref] + list(torch.autograd.grad(ref, exact, upstream.double()))
    for name, a, r in zip(("out", "d_fine", "d_coarse", "d_gate"), got, want):
        assert a.dtype == dtype and a.shape == r.shape, name
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a.double(), r, atol=tol, rtol=tol, msg=name)


@interpreter_only
@pytest.mark.parametrize(
    "n,d,c,gated", [(70, 32, 16, True), (130, 16, 64, True), (64, 64, 32, False), (5, 16, 16, True)]
)
def test_interpreted_gated_combination(n, d, c, gated):
    _combine_case(2, 3, n, d, c, gated, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_gated_combination(dtype, mark):
    _combine_case(2, 6, 65536 - 7, 64, 16, True, dtype, "cuda")
    _combine_case(1, 2, 4096, 128, 32, False, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,h,n,d,block_size,topk",
    [(2, 3, 16384, 64, 16, 20), (2, 3, 16384, 64, 64, 8), (1, 2, 4096, 128, 16, 32), (2, 2, 4096 - 5, 32, 16, 16)],
)
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_triton_matches_exact_path(dtype, b, h, n, d, block_size, topk, mark):
    q, k, v, gate, upstream = _inputs(b, h, n, d, dtype, "cuda")
    tile_idx = vsa_select(q, k, block_size=block_size, topk=topk)  # one selection for both paths
    got = _run(q, k, v, gate, upstream.detach(), block_size=block_size, tile_idx=tile_idx, impl="triton")
    exact = [x.detach().float().requires_grad_() for x in (q, k, v, gate)]
    want = _run(*exact, upstream.detach().float(), block_size=block_size, tile_idx=tile_idx, impl="torch")
    for name, a, r in zip(("out", "dq", "dk", "dv", "dgate"), got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, r) < TOL[dtype], (name, _rel(a, r))


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_deterministic_bitwise(mark):
    q, k, v, gate, upstream = _inputs(2, 3, 16384, 64, torch.bfloat16, "cuda", seed=3)
    a = _run(q, k, v, gate, upstream.detach(), block_size=16, topk=20)
    b = _run(q, k, v, gate, upstream.detach(), block_size=16, topk=20)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_under_autocast_at_the_two_pass_size(mark):
    # 4,096 tiles (256^2 tokens): the selection takes the two-pass route, whose scores must stay fp32 under a training
    # step's autocast; fp32 inputs are pooled in fp32 and then attended in bf16
    q, k, v, gate, upstream = _inputs(1, 2, 65536, 64, torch.float32, "cuda", seed=5)
    want_idx = vsa_select(q, k, block_size=16, topk=32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.equal(vsa_select(q, k, block_size=16, topk=32), want_idx)
        got = _run(q, k, v, gate, upstream.detach(), block_size=16, topk=32)
    same = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v, gate)]
    want = _run(*same, upstream.detach().to(torch.bfloat16), block_size=16, tile_idx=want_idx)
    for name, a, r in zip(("out", "dq", "dk", "dv", "dgate"), got, want):
        assert torch.isfinite(a).all(), name
        assert _rel(a, r) < TOL[torch.bfloat16], (name, _rel(a, r))


# --------------------------------------------------------------------------- tile means given by the caller
def _stacked_means(xs, block_size):
    return torch.stack([block_mean(x.detach(), block_size) for x in xs])


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreter_only)])
def test_given_means_are_the_ones_computed_here(impl):
    """means= (what the model's qk_norm_rope prologue hands over) replaces the pooling wherever no gradient flows
    through it: given the means of q, k, v as the path pools them (the Triton path with its kernel), output and
    gradients are bitwise those without it. 100 tokens: the last of 7 tiles is partial."""
    q, k, v, gate, upstream = _inputs(1, 2, 100, 32, seed=7)
    means = block_means([q, k, v], 16) if impl == "triton" else _stacked_means((q, k, v), 16)
    given = _run(q, k, v, gate, upstream.detach(), block_size=16, topk=3, impl=impl, means=means)
    computed = _run(q, k, v, gate, upstream.detach(), block_size=16, topk=3, impl=impl)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dgate"), given, computed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=interpreter_only)])
def test_given_means_are_used(impl):
    """The means are read, not recomputed: other tensors' means change the selection (vsa_select reads them too)
    and on the Triton path the coarse stage, which the PyTorch path keeps differentiable through its own pooling."""
    q, k, v, gate, _ = _inputs(1, 2, 100, 32, seed=8)
    other = _stacked_means(_inputs(1, 2, 100, 32, seed=9)[:3], 16)
    run = lambda **kw: vsa_attention(q, k, v, 16, gate=gate, impl=impl, **kw).detach()  # noqa: E731
    chosen = vsa_select(q, k, 16, topk=3, impl=impl, means=other)
    assert not torch.equal(chosen, vsa_select(q, k, 16, topk=3, impl=impl))
    with_other = run(topk=3, means=other)
    assert not torch.equal(with_other, run(topk=3))
    if impl == "torch":  # the selection only
        assert torch.equal(with_other, run(tile_idx=chosen))
    else:  # the selection and the coarse stage's pooled tokens
        assert not torch.equal(with_other, run(tile_idx=chosen))
        assert torch.equal(with_other, run(tile_idx=chosen, means=other))
