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
from pixdit.kernels.blocks import topk_desc

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
    + [(4096, 64)]  # full rows of VSA's / SLA's 256² (no absent key: the search starts from the group maxima)
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


def adversarial_screening(qp, kp, k):
    """Screened scores as bad as ``topk._screen_error`` allows: each exact score moved by (almost) the bound, the
    exact top k down and every other key up, so that keys just below the cut overtake it in the screened order."""
    exact = qp.double() @ kp.double().transpose(-1, -2)
    e = topk._screen_error(qp.shape[-1]) * qp.double().norm(dim=-1, keepdim=True)
    e = e * kp.double().norm(dim=-1).amax(-1)[:, None, None]
    winner = torch.zeros_like(exact, dtype=torch.bool).scatter_(-1, topk_desc(exact, k).long(), True)
    return (exact + torch.where(winner, -0.999, 0.999) * e).float()


@needs_interpreter
@pytest.mark.parametrize("n,k", [(600, 20), (1000, 32), (2100, 64)])
def test_screened_selection_is_exact_against_the_worst_screening_and_ties(n, k):
    """The screened selection's kernels return the exact top k: continuous rows whose screening moves every score
    by its whole error bound against the cut (certified: their screened rows are left as they were); rows with
    near-ties at the cut (a zero query, a query that sees two distinct scores, a long key that widens the bound)
    take the exact path; the exact scores (small integers) tie at distant ids. Rows belong to two (batch * head)
    slices of keys with different norms. Halving the kernels' margin fails this test."""
    g = torch.Generator().manual_seed(n + k)
    qp, kp = torch.randn(2, 6, 64, generator=g), torch.randn(2, n, 64, generator=g)
    kp[1] *= 3.0
    qp[0, 1] = 0.0  # every score 0: all n keys tie
    qp[1, 2] = 0.0
    qp[1, 2, 0] = 1.0  # scores are kp[1, :, 0]: two values only
    kp[1, :, 0] = (torch.arange(n) % 2).float()
    qp[0, 3] = torch.randint(-1, 2, (64,), generator=g).float()  # integer scores: exact, many ties
    kp[0, :, :] = torch.randint(-1, 2, (n, 64), generator=g).float()
    kp[0, n // 2 : n // 2 + 5] = kp[0, 3:8]
    kp[0, 11] *= 5.0  # a long key widens slice 0's bound: every row there is within it of the cut
    screened = adversarial_screening(qp, kp, k).reshape(12, n)
    want = topk_desc(qp.double() @ kp.double().transpose(-1, -2), k)
    out = torch.full((12, k), -7, dtype=torch.int32, device=DEVICE)  # poisoned: every slot must be written
    scores = screened.to(DEVICE, copy=True)
    got = topk._rows_topk_screened(scores, k, out, qp.to(DEVICE), kp.to(DEVICE)).cpu()
    assert torch.equal(got.view(2, 6, k), want)
    unchanged = (scores.cpu() == screened).all(-1)  # a row that was not certified is rescored in place
    assert unchanged[[6, 7, 9, 10, 11]].all() and not unchanged[[0, 2, 3, 4, 5, 8]].any()  # (row 1: all zeros)


@needs_interpreter
@pytest.mark.parametrize("screened", [False, True])
@pytest.mark.parametrize("scores_per_chunk", [None, 2 * 12 * 600, 10 * 600])
def test_two_pass_route_chunks_slices_and_rows(scores_per_chunk, screened, monkeypatch):
    """The two-pass route end to end (exact or screened cuBLAS scores, row kernel) on tie-heavy inputs, with the
    scores cut into chunks of whole slices (3 slices: chunks of 2 and 1) or of rows of one slice (10 rows at a
    time). At this row length the route screens only when told to (``_SCREEN_MIN_CANDIDATES``)."""
    if scores_per_chunk is not None:
        monkeypatch.setattr(topk, "_TORCH_MAX_SCORES", scores_per_chunk)
    if screened:
        monkeypatch.setattr(topk, "_SCREEN_MIN_CANDIDATES", 0)
    assert topk._screens(20, 600) == screened and not topk._screens(64, 600)
    qp, kp = tie_heavy(3, 12, 600, 64, seed=7)
    # the chunks cut the scores, not the row kernel's work: one k where they are cut, every k where they are not
    for k in (1, 20, 64) if scores_per_chunk is None else (20,):
        assert topk._route(600, 64, k, None) == "two_pass"
        got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl="triton").cpu()
        assert torch.equal(got, oracle(qp, kp, k)), k


@needs_interpreter
@pytest.mark.parametrize("k", [1, 5, 8, 9, 17, 128, 255])
def test_one_shot_kernel_run_time_k(k):
    """All 256 candidates scored at once, k rounds in a run-time loop, up to k = candidates - 1."""
    qp, kp = tie_heavy(2, 24, 256, 32, seed=100 + k)
    assert topk._route(256, 32, k, None) == "one_shot"
    got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl="triton").cpu()
    assert torch.equal(got, oracle(qp, kp, k))


@needs_interpreter
@pytest.mark.parametrize(
    "d,n_cand,children",
    [(16, 128, True), (64, 128, True), (128, 128, True), (64, 200, False), (64, 512, False), (32, 1000, False)],
)
def test_one_shot_kernel_every_launch_and_head_dim(d, n_cand, children):
    """The one-shot kernel's launches (``_one_shot_launch``: 1, 2 and 8 warps) and its product in chunks of d (one
    chunk at d = 16, eight at 128): LLSA's children of 8 parents, and every key row a candidate, against the fp64
    oracle on tie-heavy scores (exact in fp32, so no summation order may change a pick)."""
    qp, kp = tie_heavy(2, 48 if children else 37, n_cand if not children else 512, d, seed=d + n_cand)
    assert topk._route(n_cand, d, 9, 16 if children else None) == "one_shot"
    if children:
        g = torch.Generator().manual_seed(d)
        parents = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(2 * 3)]).view(2, 3, 8)
        got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), 9, parents=parents.to(DEVICE), child_block=16)
        ids = (parents[:, :, None, :, None] * 16 + torch.arange(16)).expand(2, 3, 16, 8, 16).reshape(2, 48, 128)
        ids = ids.sort(-1).values  # topk_desc breaks ties by position: put the candidates in id order
        scores = (qp.double()[:, :, None, :] * kp.double()[torch.arange(2)[:, None, None], ids]).sum(-1)
        want = ids.gather(-1, topk_desc(scores, 9).long()).int()
    else:
        got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), 9, impl="triton")
        want = oracle(qp, kp, 9)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("n_cand,k", [(256, 256), (1100, 65), (1100, 1100)])
def test_torch_path_for_all_candidates_and_large_k(n_cand, k):
    qp, kp = tie_heavy(2, 12, n_cand, 16, seed=n_cand + k)
    got = topk.pooled_topk(qp.to(DEVICE), kp.to(DEVICE), k, impl="triton").cpu()
    assert got.shape == (2, 12, k) and torch.equal(got, oracle(qp, kp, k))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_scores_stay_fp32_under_autocast(impl):
    """A training step runs under autocast, which would turn the fp32 score matmul into a bf16 one: a different
    selection on the PyTorch path, and bf16 scores the two-pass row kernel cannot read (it crashed VSA / SLA
    training). 600 candidates at head_dim 64 take the two-pass route."""
    assert topk._route(600, 64, 20, None) == "two_pass"
    g = torch.Generator().manual_seed(5)
    qp, kp = torch.randn(2, 16, 64, generator=g), torch.randn(2, 600, 64, generator=g)
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
    g = torch.Generator(device="cuda").manual_seed(0)  # rows of 4,096 candidates: the screened selection
    qs, ks = torch.randn(2, 64, 64, device="cuda", generator=g), torch.randn(2, 4096, 64, device="cuda", generator=g)
    before = compiled_variants(topk._row_topk_kernel), compiled_variants(topk._rescore_kernel)
    for k in range(4, topk.ROW_SELECT_MAX_K + 1, 4):
        assert topk._screens(k, 4096) == (k <= 51)  # up to 64 rescored ids
        assert near_ties_only(topk.pooled_topk(qs, ks, k), topk.pooled_topk(qs, ks, k, impl="torch"), qs, ks), k
    after = compiled_variants(topk._row_topk_kernel), compiled_variants(topk._rescore_kernel)
    assert after[0] - before[0] <= 4 + 3 and after[1] - before[1] <= 3  # + the flagged pass; rescoring: c 16, 32, 64
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


def near_ties_only(got, want, qp, kp):
    """Rows where two exact fp32 selections differ: few (one in 1,000, or one), and only where fp32 rounding can
    swap the cut (the k-th scores of both picks, in fp64, within d * 2^-22 * ||q|| * max ||k||, the two summation
    orders' error)."""
    differ = (got != want).any(-1)
    if not differ.any():
        return True
    exact = qp.double() @ kp.double().transpose(-1, -2)
    kth = [exact.gather(-1, ids.long()).amin(-1) for ids in (got, want)]
    bound = qp.shape[-1] * 2.0**-22 * qp.double().norm(dim=-1) * kp.double().norm(dim=-1).amax(-1)[:, None]
    few = differ.sum() <= max(1, differ.numel() // 1000)
    return bool(few) and bool(((kth[0] - kth[1]).abs() <= bound)[differ].all())


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_two_pass_and_streaming_match_torch_at_the_256px_vsa_shape(mark, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(1)
    q, kp = torch.randn(12, 4096, 64, device="cuda", generator=g), torch.randn(12, 4096, 64, device="cuda", generator=g)
    for k in (8, 32, 64):
        want = topk.pooled_topk(q, kp, k, impl="torch")
        with monkeypatch.context() as patch:  # the route unscreened: the row kernel on chunks of cuBLAS fp32 scores
            patch.setattr(topk, "_SCREEN_MIN_CANDIDATES", 1 << 30)
            unscreened = topk.pooled_topk(q, kp, k)
        assert torch.equal(unscreened, want)  # the same scores: the same ids
        streamed = topk._streaming_topk(q, kp, k, torch.empty_like(want))
        assert near_ties_only(streamed, want, q, kp)  # fp32 near-ties only (other summation order)
        assert topk._route(4096, 64, k, None) == "two_pass"
        screened = topk.pooled_topk(q, kp, k)  # the route: screened at k = 8 and 32, not at 64
        assert near_ties_only(screened, want, q, kp), k
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as in a training step: the same selection
            assert torch.equal(topk.pooled_topk(q, kp, k), screened), k


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_gpu_one_shot_tensor_core_scores_differ_on_near_ties_only(mark):
    """The one-shot kernel scores up to 256 candidates on the tensor cores (``tf32x3``, ``_one_shot_launch``): on
    continuous inputs at LLSA's 256² shapes (a training step's 4 images x 6 heads) its picks are the fp32 ones but on
    near-ties. One TF32 product instead of three differs in ~0.3% of the rows and fails this."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, kp = (torch.randn(24, 4096, 64, device="cuda", generator=g) for _ in range(2))
    parents = torch.rand(24, 256, 256, device="cuda", generator=g).argsort(-1)[..., :8]  # 8 of 256 level-2 blocks
    assert topk._route(128, 64, 8, 16) == "one_shot" and topk._one_shot_launch(128, 64)["PRECISION"] == "tf32x3"
    got = topk.pooled_topk(q, kp, 8, parents=parents, child_block=16)
    assert near_ties_only(got, topk.pooled_topk(q, kp, 8, parents=parents, child_block=16, impl="torch"), q, kp)
    q, kp = q[:, :256], kp[:, :256]  # the coarsest level: all 256 blocks are candidates
    assert topk._route(256, 64, 8, None) == "one_shot" and topk._one_shot_launch(256, 64)["PRECISION"] == "tf32x3"
    assert near_ties_only(topk.pooled_topk(q, kp, 8), topk.pooled_topk(q, kp, 8, impl="torch"), q, kp)
