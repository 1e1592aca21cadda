"""LLSA / block-sparse kernels on the GPU at real sizes (skipped without CUDA):  pytest tests/kernels -m gpu

Triton output and gradients vs the exact fp32 PyTorch path given the same index tables, per dtype; selection vs the
fp64 oracle as sets per row; bitwise determinism; the dense kernel vs SDPA.
"""

import pytest
import torch

from pixdit.kernels import block_sparse_attention, flash_attention, llsa_attention, llsa_check, llsa_select
from pixdit.kernels.reference import llsa_hier_topk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(q, k, v, go, **kw):
    for x in (q, k, v):
        x.grad = None
    o = llsa_attention(q, k, v, **kw)
    o.backward(go)
    return o.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "b,h,N,d,L,Le,K",
    [
        (2, 3, 16384, 64, 2, None, 8),
        (1, 2, 4096, 128, 1, None, 8),
        (1, 1, 65536, 32, 3, None, 8),
        (2, 2, 768 * 4, 64, 1, None, 3),
        (1, 2, 16384, 64, 2, 1, [4, 8]),
    ],
)
def test_llsa_triton_matches_exact_path(dtype, b, h, N, d, L, Le, K):
    matches_exact_path(b, h, N, d, L, Le, K, dtype, seed=0)


def matches_exact_path(b, h, N, d, L, Le, K, dtype, seed, select_here=False):
    """LLSA's Triton path against the exact fp32 path given the same selection; ``select_here``: the Triton path
    makes the selection itself, so its lists are full (the pooled walks LLSA trains with)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, h, N, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn(b, h, N, d, device="cuda", dtype=dtype)
    index = llsa_select(q, k, 16, K, L)
    given = None if select_here else index
    out = run(q, k, v, go, topk=K, num_levels=L, enrich_levels=Le, index=given, impl="triton")
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = run(qf, kf, vf, go.float(), topk=K, num_levels=L, enrich_levels=Le, index=index, impl="torch")
    for name, a, r in zip(("o", "dq", "dk", "dv"), out, ref):
        assert torch.isfinite(a).all(), name
        assert rel(a, r) < TOL[dtype], (name, rel(a, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,L", [(16384, 2), (65536, 2), (262144, 3)])
def test_llsa_selection_made_here_matches_exact_path(dtype, N, L):
    """The selection made inside fills every list, so the pooled pass walks them without masks (the coarsest level
    in whole steps; at L = 3 one weight per candidate level): against the exact path given the same selection."""
    matches_exact_path(1, 2, N, 64, L, None, 8, dtype, seed=N + L, select_here=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,L", [(65536, 2), (262144, 3)])
def test_llsa_fine_partial_in_fp32_matches_exact_path(dtype, N, L, monkeypatch):
    """The fine pass's partial output in fp32 (``llsa.PARTIAL_DTYPE = "float32"``; the default keeps it in the
    inputs' dtype) against the exact path, with the selection made here."""
    from pixdit.kernels import llsa

    monkeypatch.setattr(llsa, "PARTIAL_DTYPE", "float32")
    matches_exact_path(1, 2, N, 64, L, None, 8, dtype, seed=N + L + 1, select_here=True)


@pytest.mark.parametrize(
    "N,d,L,dtype,select_here",
    [(4096, 128, 1, torch.float32, False), (16384, 64, 2, torch.float16, True), (65536, 64, 2, torch.bfloat16, True)],
)
def test_llsa_reads_no_uninitialized_memory(N, d, L, dtype, select_here):
    """Every buffer the Triton path allocates with torch.empty filled with NaN (deterministic mode's
    ``fill_uninitialized_memory``): a kernel that reads a slot nobody wrote turns an output or a gradient NaN or
    moves it. The shapes of three tests that failed once on a freshly started machine and passed in three reruns
    (docs/kernel_notes.md v47 (e))."""
    torch.manual_seed(N + d)
    q, k, v = (torch.randn(1, 2, N, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    index = None if select_here else llsa_select(q, k, 16, 8, L)
    kw = dict(topk=8, num_levels=L, index=index, impl="triton")
    plain = run(q, k, v, go, **kw)
    deterministic, fill = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        filled = run(q, k, v, go, **kw)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    for name, a, b in zip(("o", "dq", "dk", "dv"), filled, plain):
        assert torch.isfinite(a).all(), f"{name}: NaN from memory that no kernel wrote"
        assert rel(a, b) < 1e-6, (name, rel(a, b))


def test_llsa_deterministic_bitwise():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    a = run(q, k, v, go)
    b = run(q, k, v, go)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("N,L", [(16384, 2), (4096, 1), (65536, 3)])
def test_selection_matches_fp64_oracle(N, L):
    torch.manual_seed(2)
    q, k = (torch.randn(1, 2, N, 64, device="cuda") for _ in range(2))
    ks = llsa_check(N, 16, L, 8)["topk"]
    ours = llsa_select(q, k, 16, ks, L)
    ref = llsa_hier_topk(q.double(), k.double(), 16, ks)
    # coarsest level: same input -> compare directly; finer levels given our parents (the oracle's may differ)
    same = (ours[-1].long().sort(-1).values == ref[-1].sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.99, same


@pytest.mark.parametrize("N", [4096, 1000])
def test_flash_attention_matches_sdpa(N):
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 6, N, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    o = flash_attention(q, k, v)
    o.backward(go)
    mine = (o.detach(), q.grad, k.grad, v.grad)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    r = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf)
    r.backward(go.float())
    for a, b in zip(mine, (r, qf.grad, kf.grad, vf.grad)):
        assert rel(a, b) < 2e-2


def test_block_sparse_vsa_shape_with_lse():
    torch.manual_seed(4)
    b, h, N, d, blk, K = 2, 2, 4000, 64, 64, 5
    q, k, v = (torch.randn(b, h, N, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    T = (N + blk - 1) // blk
    lists = torch.rand(b, h, T, T, device="cuda").argsort(-1)[..., :K].int()
    go, gl = torch.randn_like(q), torch.randn(b, h, N, device="cuda")
    res = []
    for impl in ("triton", "torch"):
        for x in (q, k, v):
            x.grad = None
        o, lse = block_sparse_attention(q, k, v, lists, query_block=blk, key_block=blk, return_lse=True, impl=impl)
        ((o.float() * go.float()).sum() + (lse * gl).sum()).backward()
        res.append((o.detach(), lse.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, r in zip(*res):
        assert rel(a, r) < 2e-2
