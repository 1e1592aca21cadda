"""LLSA's pooled pass in Gluon (``pixdit.kernels.llsa_gluon``).

Without a GPU: the kernel is compiled for sm_90 (H100 / H200) at LLSA's usual shapes (Gluon has no interpreter, so
this is what the CPU can check: it builds, its shared memory fits, its products are wgmma and its loads TMA), and the
shape rules say which calls it takes. On an sm_90 GPU (``pytest -m gpu``): LLSA with the Gluon pass against LLSA with
``bsa_forward``'s pass (outputs and gradients, the same selection) and against the exact fp32 path, eager and compiled.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_llsa_gpu import rel, run

from pixdit.kernels import llsa, llsa_attention, llsa_gluon

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs an sm_90 GPU"
)

# (candidate blocks per level, tail rows): LLSA at 256², L = 2; 128², L = 2; 512², L = 3 (B = 16, K = 8)
CASES = {"256² L=2": ((8, 0), 256), "128² L=2": ((8, 0), 64), "512² L=3": ((8, 8), 64)}
FORMS = ("forward", "dq")


def compile_for_sm90(cand_widths, tail_rows, dtype="bf16", dq=False) -> dict:
    """The kernel compiled for sm_90 with LLSA's arguments at one shape (no GPU needed): what the tests check of it."""
    import os
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def desc(rows):
        return f"tensordesc<{dtype}[{rows},64],{gl.NVMMASharedLayout.get_default_for([rows, 64], gl_dtype)!r}>"

    descriptors = dict(k_desc=desc(16), v_desc=desc(16), tail_k_desc=desc(64), tail_v_desc=desc(64))
    constexprs = dict(HEAD_DIM=64, BLOCK=16, GROUP_ROWS=256, CAND1=cand_widths[0], CAND2=cand_widths[1])
    warps = 4 if dq else llsa_gluon.FORWARD_WARPS
    constexprs |= dict(TAIL_ROWS=tail_rows, num_warps=warps)
    if dq:
        kernel = llsa_gluon._pooled_dq_kernel
        signature = dict(q_desc=desc(64), do_desc=desc(64), **descriptors)
        signature |= dict(O=f"*{dtype}", LSE="*fp32", DELTA="*fp32", DQ="*fp32", LIST="*i32")
        ints = "n_q bank_rows stride_lb stride_lt heads tail_lo".split()
        floats = "qk_scale sm_scale weight1 weight2 tail_bias".split()
    else:
        kernel = llsa_gluon._pooled_forward_kernel
        signature = dict(q_desc=desc(llsa_gluon.FORWARD_ROWS), **descriptors)
        signature |= dict(O_INIT=f"*{dtype}", LSE_INIT="*fp32", O=f"*{dtype}", LSE="*fp32", LIST="*i32")
        ints = "n_q bank_rows stride_lb stride_lt out_heads stride_ob stride_oh stride_on tail_lo".split()
        floats = "qk_scale weight1 weight2 tail_bias".split()
    signature |= {name: "i32" for name in ints} | {name: "fp32" for name in floats}
    signature |= {name: "constexpr" for name in constexprs}
    # what a launch specialises at LLSA's shapes: 16-byte aligned pointers, these integers multiples of 16
    aligned = [name for name, kind in signature.items() if kind.startswith("*")]
    aligned += [
        name for name in ints if name in "n_q bank_rows stride_lb stride_ob stride_oh stride_on tail_lo".split()
    ]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp  # (a subprocess of its own: see compiled)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        ptx = kernel.asm["ptx"]
        # ptxas's own report of the PTX (Triton's compile does not keep it): registers, spills, and whether it had to
        # serialise the asynchronous wgmma (warning C7514), which would undo the kernels' overlap
        with open(os.path.join(tmp, "kernel.ptx"), "w") as f:
            f.write(ptx)
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        info = subprocess.run(
            [os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
        with open(os.path.join(tmp, "kernel.cubin"), "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    return {
        "shared": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "shared ld/st": ptx.count("st.shared") + ptx.count("ld.shared"),
        "registers": int(re.search(r"Used (\d+) registers", info.stderr).group(1)),
        "spilled bytes": int(re.search(r"(\d+) bytes spill stores", info.stderr).group(1)),
        "wgmma serialised": "C7514" in info.stderr,
        "step loops' barriers": step_loop_barriers(sass),
    }


def step_loop_barriers(sass: str) -> list[int]:
    """CTA-wide barriers (``BAR.SYNC``) in each innermost SASS loop that issues wgmma (``HGMMA``): the walks' step
    loops. A loop is the code from a label to a branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := re.search(r"BRA\W+(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i
    ]
    with_wgmma = [(a, b) for a, b in loops if any("HGMMA" in line for line in lines[a:b])]
    innermost = [
        (a, b) for a, b in with_wgmma if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in with_wgmma)
    ]
    return [sum("BAR.SYNC" in line for line in lines[a:b]) for a, b in innermost]


@pytest.fixture(scope="module")
def compiled():
    """Every case compiled in one subprocess without TRITON_INTERPRET: Gluon's reductions (``gl.max``, ``gl.sum``)
    are Triton functions, which the interpreter replaces, so the CPU test session itself cannot compile them."""
    script = (
        "import json, os, runpy, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); m = runpy.run_path(sys.argv[1]); "
        "f = m['compile_for_sm90']; cases = m['CASES']; "
        "print(json.dumps({c + ', ' + p: f(*cases[c], dq=p == 'dq') for c in cases for p in m['FORMS']} "
        "| {'fp16': f((8, 0), 256, 'fp16')}))"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case, form, compiled):
    cand_widths, tail_rows = CASES[case]
    report = compiled[f"{case}, {form}"]
    keys = sum(cand_widths) * 16 + tail_rows
    # the group's K and V (2 bytes a value), two 64-row tiles (the forward's 128-row q; the dq's q and dO), the
    # barriers: nothing else in shared memory
    assert report["shared"] <= 2 * keys * 64 * 2 + 2 * 64 * 64 * 2 + 1024, report
    # the products as the code issues them (the middle steps are a loop), four k16 wgmma each
    if form == "dq":  # S(0), dP(0); the loop's S, dP, dq += dS K; the last step's dq
        assert report["wgmma"] == 6 * 4
    else:  # each of the two 128-row tiles: S(0); the loop's S, O; the last step's O
        assert report["wgmma"] == 2 * 4 * 4
    q_copies = 2  # q and dO; the forward's two 128-row q tiles
    copies = 2 * sum(cand_widths) + 2 * tail_rows // 64 + q_copies
    assert report["tma"] == copies, "K and V: a copy per listed block and per 64 tail rows; the 64-row q tiles"
    # (the dq's one read of dO from shared memory, for Δ, is an ldmatrix)
    assert report["shared ld/st"] == 0, "P (dS) should reach the last product in registers"
    assert report["spilled bytes"] == 0 and not report["wgmma serialised"], report
    # a CTA-wide barrier in a step loop would hold the warpgroups in lockstep at every step (the compiler puts one
    # before any mbarrier wait, so the kernels wait for their keys before the loops: llsa_gluon._wait_keys)
    assert report["step loops' barriers"] and not any(report["step loops' barriers"]), report
    if form == "forward":  # two programs of 8 warps per SM (the forward's point): 65,536 registers / 512 threads
        assert report["registers"] <= 128, report


def test_kernel_compiles_for_fp16(compiled):
    assert compiled["fp16"]["wgmma"] == 2 * 4 * 4


@pytest.mark.parametrize("case", list(CASES))
def test_case_supported_takes_llsa_usual_shapes(case):
    cand_widths, tail_rows = CASES[case]
    widths = tuple(w for w in cand_widths if w)
    assert llsa_gluon.case_supported(torch.bfloat16, 64, 65536, 16, widths, tail_rows, True)
    assert llsa_gluon.case_supported(torch.float16, 64, 65536, 16, widths, tail_rows, True)


@pytest.mark.parametrize(
    "dtype,d,n_q,B,widths,tail,full,why",
    [
        (torch.float32, 64, 65536, 16, (8,), 256, True, "fp32"),
        (torch.bfloat16, 128, 65536, 16, (8,), 256, True, "head_dim 128"),
        (torch.bfloat16, 64, 65536, 16, (8,), 256, False, "lists with empty slots"),
        (torch.bfloat16, 64, 65536, 16, (), 256, True, "L = 1: no candidate level"),
        (torch.bfloat16, 64, 65536, 16, (8, 8, 8), 64, True, "three candidate levels"),
        (torch.bfloat16, 64, 65536, 16, (3,), 256, True, "K = 3: 48-key steps"),
        (torch.bfloat16, 64, 65536, 16, (8,), 16, True, "a tail of 16 rows"),
        (torch.bfloat16, 64, 65536, 16, (8,), 1024, True, "1,152 keys: more than shared memory holds"),
        (torch.bfloat16, 64, 65536 + 64, 16, (8,), 256, True, "tokens not a multiple of B^2"),
        (torch.bfloat16, 64, 65536, 8, (8,), 64, True, "B = 8: groups of 64 rows, not whole 128-row tiles"),
    ],
)
def test_case_supported_refuses(dtype, d, n_q, B, widths, tail, full, why):
    assert not llsa_gluon.case_supported(dtype, d, n_q, B, widths, tail, full), why


def test_llsa_runs_the_gluon_kernels_only_on_an_sm90_gpu():
    q = torch.zeros(12, 65536, 64, dtype=torch.bfloat16)
    assert not llsa._gluon_pooled(q, 16, (8,), (4096, 4352, 0.0), True, switch=True)  # a CPU tensor


def test_environment_switches_one_pass_or_both_and_names_a_bad_value():
    """``PIXDIT_KERNELS_GLUON``: 0 / 1 / forward / dq, read once at import; anything else is refused by name."""
    script = "from pixdit.kernels import llsa; print(llsa.GLUON_POOLED_FORWARD, llsa.GLUON_POOLED_DQ)"
    for value, expected in (("dq", "False True"), ("forward", "True False")):
        env = dict(os.environ, PIXDIT_KERNELS_GLUON=value)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        assert done.stdout.split()[-2:] == expected.split(), (value, done.stdout, done.stderr[-500:])
    env = dict(os.environ, PIXDIT_KERNELS_GLUON="yes")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "PIXDIT_KERNELS_GLUON must be one of 0, 1, forward, dq" in done.stderr


# ------------------------------------------------------------------------------------------------------- on the GPU
def counted(monkeypatch, form: str = "forward") -> list[str]:
    """Switch one Gluon kernel on (``form``: "forward" or "dq") and record its calls (a test that it ran, not only that
    the results agree)."""
    calls = []
    name = "pooled_dq" if form == "dq" else "pooled_forward"
    original = getattr(llsa_gluon, name)

    def counting(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(llsa, "GLUON_POOLED_DQ" if form == "dq" else "GLUON_POOLED_FORWARD", True)
    monkeypatch.setattr(llsa_gluon, name, counting)
    return calls


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("b,h,N,L,B", [(2, 3, 65536, 2, 16), (1, 2, 16384, 2, 16), (1, 2, 262144, 3, 16)])
def test_gluon_pass_matches_bsa_pass_and_exact_path(dtype, b, h, N, L, B, form, monkeypatch):
    """LLSA with one Gluon kernel (the forward or the dq) against LLSA with ``bsa_forward`` /
    ``bsa_backward_dq`` (the same selection: within a rounding) and the exact fp32 path (within the dtype's)."""
    torch.manual_seed(N + L)
    q, k, v = (torch.randn(b, h, N, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn_like(q)
    kw = dict(block_size=B, topk=8, num_levels=L, impl="triton")
    plain = run(q, k, v, go, **kw)
    calls = counted(monkeypatch, form)
    gluon = run(q, k, v, go, **kw)
    assert len(calls) == 1, "the Gluon kernel did not run"
    index = llsa.llsa_select(q, k, B, 8, L)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    exact = run(qf, kf, vf, go.float(), index=index, **dict(kw, impl="torch"))
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    for name, a, p, r in zip(("o", "dq", "dk", "dv"), gluon, plain, exact):
        assert torch.isfinite(a).all(), name
        assert rel(a, r) < tol, (name, rel(a, r))
        # the same steps in the same order as the Triton pass: at most a rounding apart
        assert rel(a, p) < 1e-3, (name, rel(a, p))
    print(form, "bitwise equal to the Triton pass (o, dq, dk, dv):", [torch.equal(a, p) for a, p in zip(gluon, plain)])


@pytest.mark.gpu
@hopper
def test_gluon_pass_continues_an_fp32_partial(monkeypatch):
    """``llsa.PARTIAL_DTYPE = "float32"``: the fine pass's partial in fp32, which the Gluon pass loads as it is."""
    monkeypatch.setattr(llsa, "PARTIAL_DTYPE", "float32")
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 65536, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plain = llsa_attention(q, k, v, topk=8, num_levels=2)
    calls = counted(monkeypatch, "forward")
    gluon = llsa_attention(q, k, v, topk=8, num_levels=2)
    assert len(calls) == 1
    assert rel(gluon, plain) < 1e-3


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("form", FORMS)
def test_gluon_pass_compiled_equals_eager(form, monkeypatch):
    """Under torch.compile the kernels are custom ops (``torch.ops.pixdit.llsa_pooled_forward``, ``..._dq``): the
    same bits as eager, forward and gradients."""
    calls = counted(monkeypatch, form)
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 3, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    go = torch.randn_like(q)

    def step(q, k, v, go):
        o = llsa_attention(q, k, v, topk=8, num_levels=2)
        return (o, *torch.autograd.grad(o, (q, k, v), go))

    eager = step(q, k, v, go)
    compiled = torch.compile(step)(q, k, v, go)
    assert calls, "the Gluon kernel did not run"
    for name, a, b in zip(("o", "dq", "dk", "dv"), compiled, eager):
        assert torch.equal(a, b), name
