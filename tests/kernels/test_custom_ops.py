"""The Triton launchers are torch custom ops (``torch.ops.pixdit.*``): torch.compile traces every backend whole.

Two checks, on CPU under the Triton interpreter and on the GPU:

* every backend's Triton path compiles with ``fullgraph=True`` (no graph break anywhere: selection, glue, kernels)
  and gives the eager call's output and gradients bit for bit (backend "aot_eager": Dynamo + AOTAutograd, which
  run the ops' fake-tensor rules and functionalize their mutations);
* ``torch.library.opcheck`` on every op as the backends call it (schema and declared mutations, the fake-tensor rule
  against the real output's shape / dtype / strides, tracing with dynamic shapes).

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_custom_ops.py
"""

from __future__ import annotations

import ast
import os
import re
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pixdit.kernels as K
from pixdit.kernels.qk_norm_rope import qk_norm_rope
from pixdit.kernels.qkv_norm_rope import qkv_norm_rope

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _lists(n_tiles: int, n_blocks: int, width: int, seed: int) -> torch.Tensor:
    """[1, 1, n_tiles, width] distinct block ids per tile, one empty slot (-1) in the last tile."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(n_blocks, generator=g)[:width] for _ in range(n_tiles)]).to(torch.int32)
    rows[-1, -1] = -1
    return rows[None, None].to(DEVICE)


def _gate(q):
    g = torch.Generator().manual_seed(1)
    return torch.randn(q.shape, generator=g).to(DEVICE, DTYPE).requires_grad_(True)


def _tokens_major(o: torch.Tensor) -> torch.Tensor:
    """``[b, h, n, d] -> [b, n, h * d]`` as a model does before its output projection: the attention's backward then
    gets a transposed dO (``block_sparse.flatten_grad``)."""
    return o.transpose(1, 2).flatten(2)


# name -> (number of tokens, call(q, k, v, extra) -> tensor or tuple of tensors, make_extra(q) -> extra arguments)
CASES = {
    "block_sparse": (
        160,  # 10 query tiles of 16 over 5 key blocks of 32: a partial last block, and the LSE returned
        lambda q, k, v, x: K.block_sparse_attention(
            q, k, v, x[0], query_block=16, key_block=32, block_log_weights=x[1], return_lse=True, impl="triton"
        ),
        lambda q: [_lists(10, 5, 3, 0), torch.linspace(0.0, 1.0, 5, device=DEVICE)],
    ),
    "flash": (144, lambda q, k, v, x: _tokens_major(K.flash_attention(q, k, v, impl="triton")), None),
    "llsa": (
        256,
        lambda q, k, v, x: _tokens_major(K.llsa_attention(q, k, v, block_size=16, topk=2, num_levels=2, impl="triton")),
        None,
    ),
    "vsa": (
        152,  # a partial last tile
        lambda q, k, v, x: _tokens_major(K.vsa_attention(q, k, v, block_size=16, topk=3, gate=x[0], impl="triton")),
        lambda q: [_gate(q)],
    ),
    "sla": (
        160,
        lambda q, k, v, x: tuple(
            _tokens_major(o)
            for o in K.sla_attention(
                q, k, v, block_size=16, topk=3, linear_scope="marginal", negligible_ratio=0.2, impl="triton"
            )
        ),
        None,
    ),
}


def _inputs(n: int, seed: int = 0, heads: int = 2, head_dim: int = 32):
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, n, head_dim)
    return [torch.randn(shape, generator=g).to(DEVICE, DTYPE).requires_grad_(True) for _ in range(3)]  # q, k, v


def _loss(out) -> torch.Tensor:
    parts = out if isinstance(out, tuple) else (out,)
    return sum((p.float() * torch.linspace(-1, 1, p.shape[-1], device=p.device)).square().sum() for p in parts)


def _run(fn, q, k, v, extra):
    leaves = [q, k, v, *(x for x in extra if x.requires_grad)]
    for t in leaves:
        t.grad = None
    out = fn(q, k, v, extra)
    _loss(out).backward()
    outs = out if isinstance(out, tuple) else (out,)
    return [o.detach().clone() for o in outs], [t.grad.clone() for t in leaves]


def _close(a, b, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    tolerance = 1e-5 if a.dtype == torch.float32 else 2e-2  # bf16 outputs: a rounding step apart at most
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item() < tolerance


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_compile_matches_eager(name, backend):
    """aot_eager runs the traced graph op by op: bit for bit. Inductor generates code for the traced glue (the
    real compile=true; on CPU it needs a C++ compiler) and may sum in another order: close."""
    if backend == "inductor" and DEVICE == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("Inductor's CPU code generation needs a C++ compiler (g++ or $CXX)")
    check_fullgraph(name, backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_compile_gpu(name):
    check_fullgraph(name, "inductor")


def check_fullgraph(name: str, backend: str):
    n, call, make_extra = CASES[name]
    q, k, v = _inputs(n)
    extra = make_extra(q) if make_extra else []
    outs_ref, grads_ref = _run(call, q, k, v, extra)
    torch._dynamo.reset()
    compiled = torch.compile(call, backend=backend, fullgraph=True)
    if backend == "inductor":
        from torch._inductor.utils import run_and_get_code

        (outs, grads), code = run_and_get_code(_run, compiled, q, k, v, extra)
        if name in ("llsa", "flash"):  # one dO, read by every dq and dk/dv op of the backward
            grads_read = _incoming_gradients(code)
            assert len(grads_read) >= 2, f"{name}: no block-sparse backward ops in the generated code"
            assert len(set(grads_read)) == 1, f"{name}: the backward's ops read dO from {sorted(set(grads_read))}"
    else:
        outs, grads = _run(compiled, q, k, v, extra)
    exact = backend == "aot_eager"
    for a, b in zip(outs, outs_ref, strict=True):
        assert _close(a, b, exact), f"{name}: compiled output differs from eager"
    for i, (a, b) in enumerate(zip(grads, grads_ref, strict=True)):
        assert b.abs().max() > 0, f"{name}: input {i} gets no gradient: the check would be vacuous"
        assert _close(a, b, exact), f"{name}: compiled gradient of input {i} differs from eager"


def _incoming_gradients(code: list[str]) -> list[str]:
    """The dO argument of every ``bsa_backward_dq`` / ``bsa_backward_dkdv(_grouped)`` call in Inductor's generated
    wrapper code (``bsa_backward_ds_dq`` reads no dO). A view of an unrealized copy made Inductor copy it once per op
    that needs exact strides (five copies of LLSA's dO before ``block_sparse.flatten_grad``): then each op reads
    another buffer."""
    found = []
    reads_do = re.compile(r"torch\.ops\.pixdit\.bsa_backward_(dq|dkdv|dkdv_grouped)\.")
    for line in "\n".join(code).splitlines():
        if reads_do.search(line) and line.strip().startswith(("buf", "torch.ops")):
            call = ast.parse(line.strip()).body[0].value
            found.append(ast.unparse(call.args[3]))
    return found


# name -> call, and two token counts: one graph compiled with dynamic shapes serves both (validation batches, a
# sweep over image sizes in one process); selection counts that depend on the size are specialized, not traced.
DYNAMIC = {
    "flash": (lambda q, k, v: K.flash_attention(q, k, v, impl="triton"), (144, 200)),
    "llsa": (
        lambda q, k, v: K.llsa_attention(q, k, v, block_size=16, topk=2, num_levels=2, impl="triton"),
        (256, 512),
    ),
    "vsa": (lambda q, k, v: K.vsa_attention(q, k, v, block_size=16, topk_ratio=0.3, impl="triton"), (152, 200)),
    "sla": (
        lambda q, k, v: K.sla_attention(
            q, k, v, block_size=16, topk=3, linear_scope="marginal", negligible_ratio=0.2, impl="triton"
        ),
        (160, 208),
    ),
}


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_dynamic_shapes_compile_matches_eager(name):
    call, sizes = DYNAMIC[name]
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in sizes:
        q, k, v = _inputs(n, heads=1, head_dim=16)  # the sizes are what is traced here: the smallest heads
        outs_ref, grads_ref = _run(lambda q, k, v, x: call(q, k, v), q, k, v, [])
        outs, grads = _run(lambda q, k, v, x: compiled(q, k, v), q, k, v, [])
        for a, b in zip(outs + grads, outs_ref + grads_ref, strict=True):
            assert torch.equal(a, b), f"{name} at {n} tokens: the dynamic-shape graph differs from eager"


class _RecordOps(TorchDispatchMode):
    """Records one call of every ``pixdit::`` op with detached copies of its arguments (taken before the call: some
    ops write into theirs): the first call that gives the most optional arguments (e.g. the fine level's dk/dv, which
    also keeps dS, over the pooled levels' that do not)."""

    def __init__(self):
        super().__init__()
        self.calls = {}
        self.given = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = sum(a is not None for a in (*args, *kwargs.values()))
        if func.namespace == "pixdit" and given > self.given.get(func, -1):
            copy = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            self.calls[func], self.given[func] = copy, given
        return func(*args, **kwargs)


def _recorded_calls():
    mode = _RecordOps()
    with mode:
        for n, call, make_extra in CASES.values():
            q, k, v = _inputs(n)
            _run(call, q, k, v, make_extra(q) if make_extra else [])
        # qkv dense but not contiguous (tokens-major memory): the fake rules must give the real outputs' strides
        qkv = torch.randn(16, 2, 3 * 2 * 8, device=DEVICE, dtype=DTYPE, requires_grad=True)
        weights = [torch.rand(8, device=DEVICE, requires_grad=True) + 0.5 for _ in range(2)]
        angles = torch.rand(16, 4, device=DEVICE)
        # with the block means and the projection's bias (the path LLSA models train with), so the op's check
        # covers its second output and the bias's partial sums
        bias = torch.randn(3 * 2 * 8, device=DEVICE, requires_grad=True)
        *out, _ = qk_norm_rope(
            qkv.transpose(0, 1), 2, *weights, angles.cos(), angles.sin(), impl="triton", pool_block=8, bias=bias
        )
        _loss(tuple(out)).backward()
        # the inference projection with qk-norm + RoPE + block means in its epilogue (no autograd)
        x = torch.randn(2, 64, 32, device=DEVICE, dtype=torch.float16)
        rope = torch.rand(64, 8, device=DEVICE)
        with torch.no_grad():
            qkv_norm_rope(
                x, torch.randn(96, 32, device=DEVICE), torch.randn(96, device=DEVICE), *torch.rand(2, 16, device=DEVICE) + 0.5,
                rope.cos(), rope.sin(), 2, pool_block=16, impl="triton",
            )  # fmt: skip
        # the DiT block's two joints: before the attention (no branch) and after it; the second once more with the
        # backward reading the forward's statistics (its most arguments: the call recorded)
        from pixdit.kernels import adaln_joint as joint

        x = torch.randn(2, 40, 24, device=DEVICE, dtype=DTYPE, requires_grad=True)
        branch = torch.randn_like(x, requires_grad=True)
        mods = [torch.randn(2, 24, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3)]
        x1, h1 = joint.adaln_joint(x, None, None, mods[1], mods[2], 1e-6, impl="triton")
        _loss(joint.adaln_joint(x1, branch * h1, mods[0], mods[1], mods[2], 1e-5, impl="triton")).backward()
        joint.BACKWARD_FROM_STATS = True
        try:
            _loss(joint.adaln_joint(x, branch, mods[0], mods[1], mods[2], 1e-5, impl="triton")).backward()
        finally:
            joint.BACKWARD_FROM_STATS = False
    return mode.calls


OPS = [
    "bsa_forward",
    "bsa_backward_dq",
    "bsa_backward_dkdv",
    "bsa_backward_dkdv_grouped",
    "bsa_backward_ds_dq",
    "pooled_topk",
    "block_means",
    "csr_to_csc_by_counts",
    "llsa_next_level",
    "vsa_combine",
    "vsa_combine_backward",
    "linear_global_grads",
    "sla_forward",
    "sla_backward_dq",
    "sla_backward_dkdv",
    "qk_norm_rope",
    "qk_norm_rope_backward",
    "qkv_norm_rope",
    "adaln_joint_backward",
]


@pytest.fixture(scope="module")
def recorded():
    return _recorded_calls()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(recorded, op, device):
    if device != DEVICE:
        pytest.skip(f"the ops run on {DEVICE} here")
    _opcheck_recorded(recorded, op)


def _opcheck_recorded(recorded: dict, op: str) -> None:
    """``torch.library.opcheck`` of ``pixdit::op`` on its recorded call (``_RecordOps``)."""
    matches = [f for f in recorded if f.name().split("::")[1].split(".")[0] == op]
    assert matches, f"pixdit::{op} was not called: the check would be vacuous"
    args, kwargs = recorded[matches[0]]
    torch.library.opcheck(matches[0], args, kwargs)


# The Gluon kernels' ops (pixdit.kernels.llsa_gluon): sm_90 GPUs only (Gluon has no interpreter), so checked there, as
# LLSA calls them with both switched on at a shape they take (16,384 tokens, L = 2, K = 4: groups of 256 query rows
# over 4 listed blocks and a coarsest level of 64 rows, each whole 64-key steps)
GLUON_OPS = ["llsa_pooled_forward", "llsa_pooled_dq"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", GLUON_OPS)
def test_opcheck_gluon(op, monkeypatch):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("the Gluon kernels run on sm_90 GPUs")
    from pixdit.kernels import llsa

    monkeypatch.setattr(llsa, "GLUON_POOLED_FORWARD", True)
    monkeypatch.setattr(llsa, "GLUON_POOLED_DQ", True)
    mode = _RecordOps()
    q, k, v = (torch.randn(1, 2, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    with mode:
        _loss(_tokens_major(K.llsa_attention(q, k, v, block_size=16, topk=4, num_levels=2))).backward()
    _opcheck_recorded(mode.calls, op)


def test_every_op_is_checked():
    registered = {name for name in dir(torch.ops.pixdit) if not name.startswith("_")} - {"name"}
    checked = set(OPS) | set(GLUON_OPS)
    assert registered == checked, f"ops without an opcheck: {registered - checked}; stale: {checked - registered}"


def test_eager_calls_skip_the_dispatcher_and_traced_calls_use_it(monkeypatch):
    """A plain eager call runs the launcher itself; under a dispatch mode (what make_fx and FakeTensorMode use) the
    call goes through the op, so tracing sees it."""
    from pixdit.kernels import block_sparse

    kernel_op = block_sparse._bsa_forward_op
    seen = []
    monkeypatch.setattr(kernel_op, "op", lambda *a, **k: seen.append("op") or kernel_op.launcher(*a, **k))
    n, call, make_extra = CASES["block_sparse"]
    q, k, v = _inputs(n)
    extra = make_extra(q)
    with torch.no_grad():
        eager = call(q, k, v, extra)
        assert seen == [], "an eager call went through the custom op"
        with _RecordOps():
            traced = call(q, k, v, extra)
    assert seen == ["op"], "a call under a dispatch mode skipped the custom op"
    assert all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True))


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The launchers' host copies of ``triton.cdiv`` / ``triton.next_power_of_2`` (which are constexpr functions,
    slow to call from the host) give the same numbers."""
    import triton

    from pixdit.kernels.ops import cdiv, next_power_of_2

    for a in [*range(0, 300), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 100, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
