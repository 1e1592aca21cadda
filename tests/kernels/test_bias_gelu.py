"""bias_gelu (the MLP's fc1 bias + tanh GELU, the bias gradient in the backward's pass) against an fp64 oracle
written here from the GELU's definition, 0.5 x (1 + tanh(z)), z = sqrt(2 / pi) (x + 0.044715 x^3), differentiated
by autograd. On CPU the Triton kernel runs in the interpreter (tests/kernels/conftest.py).

    .venv/bin/python -m pytest tests/kernels/test_bias_gelu.py
    python -m pytest tests/kernels/test_bias_gelu.py -m gpu      # CUDA machine
"""

import math

import pytest
import torch

from pixdit.kernels import bias_gelu
from pixdit.kernels.bias_gelu import ROWS_PER_PROGRAM

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-6}


def oracle(u, bias):
    """fp64 GELU of u + bias, with 0.5 (1 + tanh z) as 1 / (1 + exp(-2z)) (the same number): even fp64's
    1 + tanh(z) cancels to 0 below x = -7.14."""
    x = u.double() + bias.double()
    return x / (1 + torch.exp(-2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def make_inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(shape, generator=g) * 3).to(device, dtype).requires_grad_()  # tails down to about -12
    bias = torch.randn(shape[-1], generator=g).to(device).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return u, bias, dy


def compare(shape, dtype, device, impl):
    u, bias, dy = make_inputs(shape, dtype, device)
    g = bias_gelu(u, bias, impl=impl)
    du, dbias = torch.autograd.grad(g, (u, bias), dy)
    leaves = [u.detach().double().requires_grad_(), bias.detach().double().requires_grad_()]
    want = oracle(*leaves)
    want_du, want_dbias = torch.autograd.grad(want, leaves, dy.double())
    assert g.dtype == du.dtype == dtype and dbias.dtype == torch.float32
    for name, got, ref in (("g", g, want), ("du", du, want_du), ("dbias", dbias, want_dbias)):
        assert got.shape == ref.shape, name
        error = ((got.double() - ref).norm() / ref.norm()).item()
        assert error < TOL[dtype], f"{name}: relative error {error:.2e} (tolerance {TOL[dtype]:.0e})"
    return g, du, dbias


# rows: one partial program; two programs, the second partial; columns: below one block, above one block
SHAPES = [(3, 37, 200), (1, ROWS_PER_PROGRAM + 88, 64), (2, 5, 7)]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_fp64_oracle(shape, dtype, impl):
    if impl == "triton" and CUDA:
        pytest.skip("interpreter test (the GPU twin is below)")
    compare(shape, dtype, "cpu", impl)


def test_triton_and_torch_backwards_agree():
    """The interpreter's kernel and the PyTorch path compute the same fp32 expression; the bias gradient's sums of
    600 rows differ in their order (per-program partial sums against one reduction)."""
    if CUDA:
        pytest.skip("interpreter test")
    (g, du, dbias), (g_ref, du_ref, dbias_ref) = [
        compare((2, 300, 200), torch.float32, "cpu", i) for i in ("triton", "torch")
    ]
    assert torch.equal(g, g_ref)  # the same forward (PyTorch either way)
    torch.testing.assert_close(du, du_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dbias, dbias_ref, rtol=1e-5, atol=2e-5)


def test_bad_input_names_the_argument():
    u = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_gelu(u, torch.zeros(7))
    with pytest.raises(ValueError, match="dtype must be float16, bfloat16 or float32"):
        bias_gelu(u.to(torch.int32), torch.zeros(8))


def test_compiles_without_graph_breaks_and_matches_eager():
    """Dynamo traces the forward (the bias add and the sigmoid-form GELU, no tanh), the backward's kernel stays one
    opaque op; values and gradients equal eager mode's."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    u, bias, dy = make_inputs((2, 300, 200), torch.float32, "cpu")
    impl = "torch" if CUDA else "triton"
    eager = bias_gelu(u, bias, impl=impl)
    eager_grads = torch.autograd.grad(eager, (u, bias), dy)
    compiled = torch.compile(lambda a, b: bias_gelu(a, b, impl=impl), backend=capture, fullgraph=True)
    out = compiled(u, bias)
    grads = torch.autograd.grad(out, (u, bias), dy)
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    # the forward is traced into the autograd Function's subgraph
    subgraphs = [sub for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)]
    targets = {str(node.target) for gm in subgraphs for node in gm.graph.nodes if node.op == "call_function"}
    assert any("sigmoid" in t for t in targets), targets
    assert not any("tanh" in t or "gelu" in t.replace("bias_gelu_backward", "") for t in targets), targets
    aot = torch.compile(lambda a, b: bias_gelu(a, b, impl=impl), backend="aot_eager", fullgraph=True)
    out = aot(u, bias)
    assert torch.equal(out, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (u, bias), dy), eager_grads))


def test_sigmoid_form_is_accurate_in_the_negative_tail():
    """In fp32 the tanh form's 1 + tanh(z) cancels (0 below x = -5.06); the sigmoid form stays within 1e-5 of the
    fp64 GELU on [-8, 8], and its bf16 values are the correctly rounded ones but for ties."""
    x = torch.linspace(-8, 8, 4001)[:, None]
    zero = torch.zeros(1)
    exact = oracle(x, zero)
    got = bias_gelu(x, zero, impl="torch")
    assert ((got.double() - exact).abs() <= 1e-5 * exact.abs()).all()
    xb = x.bfloat16()
    assert (bias_gelu(xb, zero, impl="torch") == oracle(xb, zero).bfloat16()).float().mean() > 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 4099, 1536), *SHAPES])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_matches_the_fp64_oracle_and_is_deterministic(shape, dtype, mark):
    _, du, dbias = compare(shape, dtype, "cuda", "auto")
    _, du2, dbias2 = compare(shape, dtype, "cuda", "auto")
    assert torch.equal(du, du2) and torch.equal(dbias, dbias2)
