"""VSA and SLA with every tile selected (K = number of tiles) are full softmax attention: output and gradients
against a dense softmax oracle. CPU: Triton interpreter at a small size (tests/kernels/conftest.py); GPU (``-m gpu``):
4,096 tokens, 16-token tiles, K = 256, bf16.

    .venv/bin/python -m pytest tests/kernels/test_every_tile_selected.py -q
"""

import pytest
import torch

from pixdit.kernels import sla_attention, vsa_attention

CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(CUDA, reason="interpreter tests run on CPU-only machines")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def dense_softmax(q, k, v):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v.double()


def vsa_fine(q, k, v, n_tiles):
    # a zero gate leaves the fine stage alone (O_fine + 0 * O_coarse)
    return vsa_attention(q, k, v, block_size=16, topk=n_tiles, gate=torch.zeros_like(q), impl="triton")


def sla_sparse(q, k, v, n_tiles):
    o_sparse, o_linear = sla_attention(q, k, v, block_size=16, topk=n_tiles, impl="triton")
    assert (o_linear == 0).all()  # no non-critical tile left for the linear branch
    return o_sparse + o_linear


def outputs_and_grads(fn, q, k, v, upstream):
    out = fn(q, k, v)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), upstream))


@interpreter_only
@pytest.mark.parametrize("method", [vsa_fine, sla_sparse])
def test_every_tile_is_full_attention_cpu(method):
    g = torch.Generator().manual_seed(0)
    n = 70  # 5 tiles, the last one partial
    q, k, v, up = (torch.randn(1, 2, n, 32, generator=g) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got = outputs_and_grads(lambda *x: method(*x, n_tiles=5), q, k, v, up)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(dense_softmax, qd, kd, vd, up.double())
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("method", [vsa_fine, sla_sparse])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_every_tile_is_full_attention_4096_tokens(method, mark):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, up = (torch.randn(2, 2, 4096, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got = outputs_and_grads(lambda *x: method(*x, n_tiles=256), q, k, v, up)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = outputs_and_grads(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x), qf, kf, vf, up.float())
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, want):
        rel = ((a.double() - r.double()).norm() / r.double().norm()).item()
        assert torch.isfinite(a).all() and rel < 2e-2, (name, rel)
