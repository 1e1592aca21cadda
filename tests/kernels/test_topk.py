"""The selection kernels of ``pixdit.kernels.topk`` against ``blocks.topk_desc`` (descending fp32 score, ties ->
smaller id) for every k bucket and path; on CPU through the Triton interpreter (tests/kernels/conftest.py), on the
GPU natively, all of them with ``-m gpu`` (k is a run-time argument: a sweep over k compiles at most one variant per
size bucket).

    .venv/bin/python -m pytest tests/kernels/test_topk.py -q
"""

import os

import pytest
import torch

from pixdit.kernels import topk
from pixdit.kernels.blocks import exact_fp32_matmul, topk_desc

# Every test here also runs under `pytest -m gpu`: the kernel tests below run natively on CUDA, and there the row
# kernel's longest rows take their slots from atomics in any order, which only the tie-heavy rows on the GPU check.
pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_interpreter = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def tie_heavy(bh, rows, n_cand, d, seed):
    """Small-integer q, k (exact fp32 dot products, so every path sees the same scores): many equal scores, key rows
    duplicated far apart (equal scores at distant ids, across chunk borders) and all-zero key rows (score 0)."""
    g = torch.Generator().manual_seed(seed)
    qp = torch.randint(-1, 2, (bh, rows, d), generator=g).float()
    kp = torch.randint(-1, 2, (bh, n_cand, d), generator=g).float()
    kp[:, n_cand // 2 : n_cand // 2 + 5] = kp[:, 3:8]
    kp[:, -3:] = kp[:, :3]
    kp[:, 10:13] = 0.0
    return qp, kp


def oracle(qp, kp, k):
    return topk_desc(qp.double() @ kp.double().transpose(-1, -2), k)


def test_route_sends_each_k_where_the_module_doc_says():
    assert topk._route(4096, 64, 32, None) == "two_pass"  # 256x256 VSA/SLA
    assert topk._route(4096, 64, 17, None) == "two_pass"
    assert topk._route(4096, 64, 16, None) == "two_pass"
    assert topk._route(4096, 64, 1, None) == "two_pass"
    assert topk._route(2048, 64, 16, None) == "two_pass"
    assert topk._route(1024, 64, 20, None) == "two_pass"  # 128x128 VSA/SLA ([d, 1024] is too big for one-shot)
    assert topk._route(1024, 64, 8, None) == "two_pass"  # 512x512 LLSA L=2, coarsest level
    assert topk._route(4096, 64, topk.ROW_SELECT_MAX_K, None) == "two_pass"
    assert topk._route(4096, 64, topk.ROW_SELECT_MAX_K + 1, None) == "torch"  # large k: nothing to compile
    big = topk.ROW_SELECT_MAX_CANDIDATES + 1  # longer score rows than a program holds: stream them
    assert topk._route(big, 64, topk.STREAM_MAX_K, None) == "streaming"
    assert topk._route(big, 64, topk.STREAM_MAX_K + 1, None) == "torch"
    assert topk._route(1100, 16, 1099, None) == "torch"
    assert topk._route(256, 64, 100, None) == "one_shot"  # 4,096 tokens, 16-token tiles
    assert topk._route(256, 64, 256, None) == "torch"  # every tile selected
    assert topk._route(64, 32, 64, 16) == "one_shot"  # LLSA children: all of them is fine
    assert topk._route(2048, 64, 8, 16) == "torch"


@needs_interpreter
@pytest.mark.parametrize("k", [1, 3, 16, 17, 32, 33, 64])
def test_streaming_kernel_every_bucket_matches_topk_desc(k):
    """Each SLOTS bucket (16 / 32 / 64) at its edges; 700 candidates = 21 chunks + a partial one, 40 rows = one
    full and one partial program, two (batch*head) slices, tie-heavy scores."""
    qp, kp = tie_heavy(2, 40, 700, 16, seed=k)
    out = torch.empty(2, 40, k, dtype=torch.int32, device=DEVICE)
    got = topk._streaming_topk(qp.to(DEVICE), kp.to(DEVICE), k, out).cpu()
    assert torch.equal(got, oracle(qp, kp, k))


@needs_interpreter
@pytest.mark.parametrize("trend", [0.0, 4.0])
def test_streaming_kernel_continuous_scores_and_insertions(trend):
    """Random scores over 2000 candidates with k = 20: many insertion rounds per chunk early on. With a rising trend
    (later candidates score higher on average) newcomers keep entering the top k until the end, so an eviction of
    the wrong entry (or a worst value one place off) loses some."""
    g = torch.Generator().manual_seed(11)
    qp, kp = torch.randn(1, 33, 32, generator=g), torch.randn(1, 2000, 32, generator=g)
    qp[..., 0], kp[..., 0] = 1.0, trend * torch.linspace(0, 1, 2000)
    out = torch.empty(1, 33, 20, dtype=torch.int32, device=DEVICE)
    got = topk._streaming_topk(qp.to(DEVICE), kp.to(DEVICE), 20, out).cpu()
    assert torch.equal(got, oracle(qp, kp, 20))


@needs_interpreter
def test_streaming_kernel_worst_kept_is_the_kth_best():
    """After the first chunk (128 candidates, scores 1000 + id) the worst kept entry is the 20th best, 1108. A later
    1108.5 must still enter the top 20 (a threshold one place higher would drop it); a later 1108 loses the tie to
    the kept id 108."""
    n = 400
    kp = torch.zeros(1, n, 16)
    kp[0, :128, 0] = 1000.0 + torch.arange(128.0)
    kp[0, 200, 0], kp[0, 300, 0] = 1108.5, 1108.0
    qp = torch.zeros(1, 3, 16)
    qp[0, :, 0] = 1.0
    out = torch.empty(1, 3, 20, dtype=torch.int32, device=DEVICE)
    got = topk._streaming_topk(qp.to(DEVICE), kp.to(DEVICE), 20, out).cpu()
    assert got[0, 0].tolist() == list(range(127, 108, -1)) + [200]
    assert torch.equal(got, oracle(qp, kp, 20))


@needs_interpreter
@pytest.mark.parametrize(
    "n,k",
    [(1, 1), (7, 7), (300, 1), (300, 16), (300, 17), (1000, 32), (1000, 33), (2100, 64), (2100, 65), (2100, 128)]
    + [(9000, 40)],  # the longest bucket (BLOCK 16,384, 16 warps on the GPU: 512^2 VSA with 16-token tiles)
)
def test_row_select_kernel_matches_topk_desc(n, k):
    """The two-pass path's row kernel on given fp32 scores, each CAP bucket at its edges (k = 16 | 17, 32 | 33, 64 | 65), k = n, row lengths that
    are not powers of two: continuous scores, and tie-heavy rows (a run of small integers, all-zero rows mixing
    +0.0 and -0.0, +-inf entries) where the threshold score is shared by more ids than the k winners need."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    scores = torch.randn(6, n, generator=g)
    scores[1:3] = torch.randint(-2, 3, (2, n), generator=g).float()
    scores[3] = 0.0
    scores[3, ::2] = -0.0
    scores[4, : n // 2] = -0.0
    scores[5, 0], scores[5, -1] = float("-inf"), float("inf")
    out = torch.full((6, k), -7, dtype=torch.int32, device=DEVICE)  # poisoned: every slot must be written
    got = topk._rows_topk(scores.to(DEVICE), k, out).cpu()
    assert torch.equal(got, topk_desc(scores, k))


@needs_interpreter
@pytest.mark.parametrize("k", [1, 5, 8, 9, 17, 128, 255])
def test_one_shot_kernel_run_time_k(k):
    """All 256 candidates scored at once, k rounds in a run-time loop, up to k = candidates - 1."""
    qp, kp = tie_heavy(2, 24, 256, 32, seed=100 + k)
    assert topk._route(256, 32, k, None) == "one_shot"
    got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl="triton").cpu()
    assert torch.equal(got, oracle(qp, kp, k))


@pytest.mark.parametrize("n_cand,k", [(256, 256), (1100, 65), (1100, 1100)])
def test_torch_path_for_all_candidates_and_large_k(n_cand, k):
    qp, kp = tie_heavy(2, 20, n_cand, 16, seed=n_cand + k)
    got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl="triton").cpu()
    assert got.shape == (2, 20, k) and torch.equal(got, oracle(qp, kp, k))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_scores_stay_fp32_under_autocast(impl):
    """A training step runs under autocast, which would turn the fp32 score matmul into a bf16 one: a different
    selection on the PyTorch path, and bf16 scores the two-pass row kernel cannot read (it crashed VSA / SLA
    training). 600 candidates at head_dim 64 take the two-pass route."""
    assert topk._route(600, 64, 20, None) == "two_pass"
    g = torch.Generator().manual_seed(5)
    qp, kp = torch.randn(2, 40, 64, generator=g), torch.randn(2, 600, 64, generator=g)
    want = oracle(qp, kp, 20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), 20, impl=impl).cpu()
    assert torch.equal(got, want)


def test_pooled_topk_rejects_k_outside_the_candidates():
    qp, kp = torch.randn(1, 4, 16), torch.randn(1, 40, 16)
    for bad in (0, 41, 2.5, True):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, 40\]"):
            topk.pooled_topk(qp, kp, bad)


# ---------------------------------------------------------------------------------------------------- GPU (-m gpu)
def compiled_variants(fn) -> int:
    """Variants of a @triton.jit kernel compiled in this process (Triton 3.x keeps them per device)."""
    return sum(len(caches[0]) for caches in fn.device_caches.values())


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_k_sweep_compiles_one_variant_per_bucket(mark):
    q, kp = (x.cuda() for x in tie_heavy(6, 1024, 1024, 64, seed=0))  # exact scores: every path agrees
    before = compiled_variants(topk._row_topk_kernel)
    for k in range(4, topk.ROW_SELECT_MAX_K + 1, 4):
        assert topk._route(1024, 64, k, None) == "two_pass"
        got = topk.pooled_topk(q, kp, k)
        assert torch.equal(got, topk.pooled_topk(q, kp, k, impl="torch")), k
    assert compiled_variants(topk._row_topk_kernel) - before <= 4  # CAP 32, 64, 128, 256
    before = compiled_variants(topk._streaming_topk_kernel)
    for k in range(4, topk.STREAM_MAX_K + 1, 4):
        out = torch.empty(6, 1024, k, device="cuda", dtype=torch.int32)
        got = topk._streaming_topk(q, kp, k, out)
        assert torch.equal(got, topk.pooled_topk(q, kp, k, impl="torch")), k
    assert compiled_variants(topk._streaming_topk_kernel) - before <= 3  # SLOTS 16, 32, 64
    q, kp = q[:, :256], kp[:, :256]
    before = compiled_variants(topk._pooled_topk_kernel)
    for k in range(4, 256, 12):
        assert torch.equal(topk.pooled_topk(q, kp, k), topk.pooled_topk(q, kp, k, impl="torch")), k
    assert compiled_variants(topk._pooled_topk_kernel) - before <= 1


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_two_pass_and_streaming_match_torch_at_the_256px_vsa_shape(mark):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, kp = torch.randn(12, 4096, 64, device="cuda", generator=g), torch.randn(12, 4096, 64, device="cuda", generator=g)
    for k in (8, 32, 64):
        want = topk.pooled_topk(q, kp, k, impl="torch")
        with exact_fp32_matmul():  # the two-pass path whatever the route: the torch path's chunks of cuBLAS scores
            two_pass = topk._all_candidates_torch(q, kp, k, select=topk._select_rows)
        assert torch.equal(two_pass, want)  # the same scores: the same ids
        streamed = topk._streaming_topk(q, kp, k, torch.empty_like(want))
        assert (streamed != want).any(-1).float().mean() < 1e-3  # fp32 near-ties only (other summation order)
        assert torch.equal(topk.pooled_topk(q, kp, k), two_pass), k  # the route at this length
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as in a training step: the scores stay fp32
            assert torch.equal(topk.pooled_topk(q, kp, k), two_pass), k
