"""The kernel scripts: scripts/ab_attention.py and scripts/ab_qk_norm.py (interleaved A/Bs of two kernel libraries in
one process) run end to end, a CPU smoke run with the repository's own kernels/ as the "before" side, loaded a second time under another module
name; scripts/kernel_compile_report.py describes every argument of the attention kernels it compiles (a kernel that
gains an argument must show up here, not as a broken report on the next device-free session)."""

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ab_attention(kernels_from: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "scripts/ab_attention.py",
        *extra,
        "--kernels-from",
        kernels_from,
        "--quick",
        "--device",
        "cpu",
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ab_attention_quick_cpu():
    run = ab_attention("kernels")
    assert run.returncode == 0, run.stderr
    header, rule, llsa, vsa = run.stdout.strip().splitlines()[-4:]
    assert "before fwd ms" in header and "after fwd+bwd ms" in header
    assert llsa.startswith("| llsa | 32² | L=1 |") and vsa.startswith("| vsa | 32² | K=2 |")
    # the same library on both sides: output and gradients equal, so the comparison column reads all zeros
    assert "max rel. diff o, dq, dk, dv" in header
    assert llsa.endswith("| 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00 |") and vsa.endswith("0.0e+00, 0.0e+00 |")


def test_ab_attention_times_several_libraries_against_the_installed_one(tmp_path):
    """Two --kernels-from folders: one row per case and folder, each against the installed library; a folder given
    twice is refused."""
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "scripts/ab_attention.py", "--quick", "--device", "cpu", "--cases", "llsa:32:1"]
    run = subprocess.run(
        [*command, "--kernels-from", "kernels", str(tmp_path / "kernels")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    header, rule, first, second = run.stdout.strip().splitlines()[-4:]
    assert "| before |" in header
    assert first.startswith("| llsa | 32² | L=1 | 16 | kernels |")
    assert second.startswith(f"| llsa | 32² | L=1 | 16 | {tmp_path / 'kernels'} |")
    assert first.endswith("| 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00 |") and second.endswith("0.0e+00, 0.0e+00 |")
    twice = subprocess.run([*command, "--kernels-from", "kernels", "kernels"], cwd=ROOT, capture_output=True, text=True)
    assert twice.returncode != 0 and "a folder is given twice" in twice.stderr


def test_ab_attention_back_to_back_reports_wall_and_host_time():
    """--back-to-back N: the loop's wall and host milliseconds per call, before and after; not with --kernel-time."""
    run = ab_attention("kernels", "--back-to-back", "3", "--cases", "llsa:32:1")
    assert run.returncode == 0, run.stderr
    header, rule, llsa = run.stdout.strip().splitlines()[-3:]
    for column in ("before fwd ms", "after fwd+bwd ms", "before fwd host ms", "after fwd+bwd host ms"):
        assert f"| {column} |" in header
    assert "fwd+bwd host speed-up" in header and llsa.startswith("| llsa | 32² | L=1 |")
    both = ab_attention("kernels", "--back-to-back", "3", "--kernel-time")
    assert both.returncode != 0 and "not --kernel-time" in both.stderr


def test_back_to_back_times_every_call_and_the_host_share():
    """kernel_ab.back_to_back_ms: two warm-up calls and N timed ones; on the CPU the host is the whole wall time."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from kernel_ab import back_to_back_ms
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    calls = []
    wall, host = back_to_back_ms(lambda: calls.append(1), 5, "cpu")
    assert len(calls) == 7 and 0 <= host <= wall


def test_ab_attention_kernel_time_needs_cuda():
    run = ab_attention("kernels", "--kernel-time")
    assert run.returncode != 0 and "--kernel-time times CUDA kernels, got --device cpu" in run.stderr


def test_ab_attention_names_a_missing_library():
    run = ab_attention("docs")
    assert run.returncode != 0 and "--kernels-from docs: no __init__.py there" in run.stderr


def test_ab_attention_names_a_bad_case():
    run = ab_attention("kernels", "--cases", "vsa:big")
    assert run.returncode != 0 and "--cases 'vsa:big': expected METHOD:SIDE[:X[:B]]" in run.stderr


def test_ab_attention_block_sparse_and_dense_cases():
    """bsa:SIDE:K[:B] (random lists, the same for both libraries) and flash:SIDE; bsa needs its K, flash takes none."""
    run = ab_attention("kernels", "--cases", "bsa:32:2:16", "flash:32")
    assert run.returncode == 0, run.stderr
    bsa, flash = run.stdout.strip().splitlines()[-2:]
    assert bsa.startswith("| bsa | 32² | K=2 | 16 |") and flash.startswith("| flash | 32² | - | - |")
    assert bsa.endswith("| 0.0e+00, 0.0e+00, 0.0e+00, 0.0e+00 |") and flash.endswith("0.0e+00, 0.0e+00 |")
    for bad in ("bsa:32", "flash:32:2"):
        run = ab_attention("kernels", "--cases", bad)
        assert run.returncode != 0 and f"--cases {bad!r}: expected METHOD:SIDE[:X[:B]]" in run.stderr


def test_kernel_ms_counts_kernels_that_overlap_once(monkeypatch):
    """kernel_ms is the GPU's busy time: kernels on two streams that run at once count once, gaps not at all; on one
    stream it is the sum of the durations (the profiler replaced by fixed spans, in ms, over 2 calls)."""
    import pixdit.report as report

    spans = [("a", 0.0, 1.0), ("b", 0.5, 2.0), ("c", 1.5, 1.8), ("d", 3.0, 4.0)]  # b under a and c under b
    monkeypatch.setattr(report, "_kernel_spans", lambda fn, calls, warmup: spans)
    assert report.kernel_ms(lambda: None, calls=2) == (2.0 + 1.0) / 2
    events = report.kernel_events(lambda: None, calls=2)  # durations, for the per-kernel tables
    assert [name for name, _ in events] == ["a", "b", "c", "d"]
    assert all(abs(ms - want) < 1e-9 for (_, ms), want in zip(events, [1.0, 1.5, 0.3, 1.0]))
    monkeypatch.setattr(report, "_kernel_spans", lambda fn, calls, warmup: [("a", 0.0, 1.0), ("b", 1.0, 1.5)])
    assert report.kernel_ms(lambda: None, calls=1) == 1.5


def test_random_block_order_is_a_seeded_permutation_per_tile():
    """The block-sparse benchmarks' lists (kernel_ab.random_block_order): every key block once per query tile, the
    same for the same seed (so both libraries of an A/B, and Flex, walk the same lists), other for another seed."""
    import torch

    order = runpy.run_path(str(ROOT / "scripts" / "kernel_ab.py"))["random_block_order"]
    a = order((2, 3, 256, 16), 32, "cpu")
    assert a.shape == (2, 3, 8, 8) and a.dtype == torch.int32
    assert (a.sort(-1).values == torch.arange(8, dtype=torch.int32)).all()
    assert torch.equal(a, order((2, 3, 256, 16), 32, "cpu")) and not torch.equal(
        a, order((2, 3, 256, 16), 32, "cpu", 1)
    )


def test_ab_qk_norm_quick_cpu():
    """The qk-norm + RoPE A/B: one row per call, the same library on both sides computes the same tensors."""
    command = [sys.executable, "scripts/ab_qk_norm.py", "--kernels-from", "kernels", "--quick", "--device", "cpu"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    header, rule, sampling, forward, both = run.stdout.strip().splitlines()[-5:]
    assert "before ms" in header and "TB/s after" in header and "max rel. diff" in header
    assert sampling.startswith("| sampling |") and forward.startswith("| forward |")
    assert both.startswith("| forward+backward |") and "| - | - |" in both  # no byte count for the backward
    assert all(row.endswith("| 0.0e+00 |") for row in (sampling, forward, both))
    bad = subprocess.run([*command, "--pool", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--pool must be a power of two up to 128 that divides side² = 1024" in bad.stderr


def test_ab_qkv_gemm_quick_cpu():
    """The fused qkv GEMM's A/B, the kernels interpreted: one row per shape, the two forms agree to fp16 rounding;
    a malformed shape is refused by name."""
    command = [sys.executable, "scripts/ab_qkv_gemm.py", "--quick", "--device", "cpu"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    header, rule, row = run.stdout.strip().splitlines()[-3:]
    assert "two launches ms" in header and "one GEMM ms" in header and row.startswith("| 8², batch 2 |")
    assert float(row.split("|")[-2]) < 4e-3  # max rel. diff: one fp16 rounding of qkv at most
    bad = subprocess.run([*command, "--shapes", "8x2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--shapes: each must be SIDE:BATCH" in bad.stderr


def test_ab_qk_norm_reports_a_library_that_computes_something_else(tmp_path):
    """A "before" library whose qk-norm uses another eps: the comparison column is no longer zero."""
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / "kernels" / "qk_norm_rope.py"
    source = module.read_text()
    assert "    eps: float = 1e-5,\n" in source
    module.write_text(source.replace("    eps: float = 1e-5,\n", "    eps: float = 1e-1,\n"))
    command = [sys.executable, "scripts/ab_qk_norm.py", "--kernels-from", str(tmp_path / "kernels"), "--quick"]
    run = subprocess.run([*command, "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = run.stdout.strip().splitlines()[-3:]
    assert len(rows) == 3 and not any(row.endswith("| 0.0e+00 |") for row in rows)


def test_compile_report_gives_every_kernel_argument():
    report = runpy.run_path(str(ROOT / "scripts" / "kernel_compile_report.py"))
    variants = report["attention_variants"](64)
    variants.append(("one-shot", *report["one_shot_variant"](64, 256)[:3]))
    variants.append(("streaming", *report["streaming_variant"](64, 32)[:3]))
    variants.append(("row select", *report["row_select_variant"](4096, 32)[:3]))
    variants.append(("rescore", *report["rescore_variant"](4096, 32, 64)[:3]))
    assert len(variants) == 24
    for label, fn, args, constexprs in variants:
        signature, attrs = report["launch_variant"](fn, args, constexprs)
        assert len(signature) + len(constexprs) == len(fn.arg_names), label
        assert all(attrs.get((fn.arg_names.index(p),)) for p, t in signature.items() if t.startswith("*")), label
        if label in ("streaming", "rescore"):  # k = 32 is a multiple of 16, but k is do_not_specialize: no hint
            assert "k" in signature and (fn.arg_names.index("k"),) not in attrs, label
    joints = report["joint_variants"]()
    assert {label.split(" rows")[0] for label, *_ in joints} == {
        f"joint d={d}{b}{s}" for d in (384, 768, 1152) for b in ("", " branch") for s in ("", " stats")
    }
    for label, fn, args, constexprs, launch in joints:
        signature, attrs = report["launch_variant"](fn, args, constexprs)
        assert len(signature) + len(constexprs) == len(fn.arg_names), label
        assert set(launch) == {"num_warps"}, label


def test_compile_report_launch_warps_are_the_launchers():
    """``--warps launch``: the 16-row fine programs on one warp, the 64-row pooled tiles and the 64-key dk/dv programs
    of the candidate and coarsest levels on four, the candidates' slot sums on four (SUM_SLOTS_WARPS), SLA's 16-row
    walks (forward, dq, dk/dv) on one; the 128-row forward on four over 128-key steps, on eight over the dense
    tail's 64-key steps; the 128-key dk/dv on eight."""
    report = runpy.run_path(str(ROOT / "scripts" / "kernel_compile_report.py"))
    warps = {label: report["launch_warps"](fn, const) for label, fn, _, const in report["attention_variants"](64)}
    assert warps == {
        "fwd fine (16-row blocks)": 1,
        "fwd fine, partial in bf16": 1,
        "fwd pooled (64-row tiles + tail)": 4,
        "fwd pooled, start values in bf16": 4,
        "dq pooled (64-row tiles + tail)": 4,
        "dq fine": 1,
        "fwd bsa 128 (K = 64)": 4,
        "fwd dense 128 (tail)": 8,
        "dkdv fine (16-key blocks)": 1,
        "dkdv fine keeping dS": 1,
        "dq fine from the kept dS": 1,
        "dkdv pooled candidates (by query group)": 4,
        "dkdv pooled candidates, partials summed": 4,
        "dkdv pooled coarsest (64 keys, split)": 4,
        "dkdv dense 128": 8,
        "sla dq (16-row blocks)": 1,
        "sla dkdv (16-key blocks)": 1,
        "sla dkdv + negligible walk": 1,
        "sla fwd (16-row blocks)": 1,
        "sla fwd + negligible walk": 1,
    }


def test_llsa_recall_sibling_union():
    """llsa_recall.py's "union of 4": identical lists in a group of 4 -> 1/4, disjoint lists -> 1."""
    import torch

    union = runpy.run_path(str(ROOT / "scripts" / "llsa_recall.py"))["sibling_union"]
    same = torch.arange(8).repeat(1, 1, 8, 1)  # 8 query blocks, all with the blocks 0..7
    disjoint = torch.arange(64).view(1, 1, 8, 8)
    half = torch.stack([torch.arange(8), torch.arange(8), torch.arange(8, 16), torch.arange(8, 16)]).repeat(2, 1)
    assert union(same, 4) == 0.25 and union(disjoint, 4) == 1.0 and union(half[None, None], 4) == 0.5


def test_llsa_recall_column_union():
    """llsa_recall.py's "columns of 4": every query block listing the same 4 neighbouring key blocks -> 1/4 (each
    query block counted once per group), lists that never share a group of 4 -> 1."""
    import torch

    union = runpy.run_path(str(ROOT / "scripts" / "llsa_recall.py"))["column_union"]
    same_group = torch.arange(8).repeat(1, 1, 6, 1)  # 6 query blocks, each listing key blocks 0..7 (2 groups of 4)
    spread = (torch.arange(8) * 4).repeat(1, 1, 6, 1)  # key blocks 0, 4, 8, ...: one per group
    mixed = torch.stack([torch.arange(8) * 4, torch.arange(8)])[None, None]  # one spread list, one grouped
    assert union(same_group, 4) == 0.25 and union(spread, 4) == 1.0
    assert union(mixed, 4) == (8 + 2) / 16


def test_ab_attention_llsa_block_size_case_and_per_kernel_needs_cuda():
    run = ab_attention("kernels", "--cases", "llsa:32:1:32")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("| llsa | 32² | L=1 | 32 |")
    run = ab_attention("kernels", "--per-kernel", "5")
    assert run.returncode != 0 and "--per-kernel times CUDA kernels, got --device cpu" in run.stderr


def test_ab_attention_launch_table_orders_by_the_larger_time(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the script imports its neighbour kernel_ab
    table = runpy.run_path(str(ROOT / "scripts" / "ab_attention.py"))["launch_table"]
    text = table({"a": 1.0, "b": 3.0, "c": 0.5}, {"a": 4.0, "b": 2.0, "d": 0.1}, 2)
    assert [line.split(" | ")[0].strip("| ") for line in text.splitlines()[2:]] == ["a", "b"]


LABELS_SNIPPET = """
import sys
sys.path.insert(0, "scripts")
import torch
from kernel_ab import labelled_launches
import pixdit.kernels as lib
from pixdit.kernels import block_sparse

q, k, v = (torch.randn(1, 1, 1024, 16, requires_grad=True) for _ in range(3))
launcher = block_sparse._fwd
with labelled_launches(lib) as labels:
    out = lib.llsa_attention(q, k, v, block_size=16, topk=2, num_levels=2, impl="triton")
    torch.autograd.grad(out.sum(), (q, k, v))
assert block_sparse._fwd is launcher, "the kernels were not restored"
for name, label in labels:
    print(label)
"""


def test_labelled_launches_name_each_launch_by_its_block_constants_and_grid():
    """kernel_ab.labelled_launches (behind ab_attention.py --per-kernel) under the interpreter: LLSA's fine and pooled
    passes of one kernel get labels of their own; the one-warp fine passes (forward, dk/dv) walk one block per
    step, and the fine dq is the one from the dS that the fine dk/dv kept."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PIXDIT_KERNELS_AUTOTUNE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", LABELS_SNIPPET], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr
    labels = run.stdout.strip().splitlines()
    assert "_fwd_kernel BLOCK_M=16 KEY_BLOCK=16 PER_ITER=1 grid (64, 1)" in labels
    assert "_fwd_kernel BLOCK_M=64 KEY_BLOCK=16 PER_ITER=4 HAS_TAIL=True HAS_INIT=True grid (16, 1)" in labels
    assert "_ds_dq_kernel QUERY_BLOCK=16 KEY_BLOCK=16 grid (64, 1)" in labels
    assert not any(label.startswith("_dq_kernel BLOCK_M=16") for label in labels)  # the fine dq recomputes nothing
    dkdv = [label for label in labels if label.startswith("_dkdv_kernel")]
    assert (
        len(dkdv) == 2  # the fine level and the coarsest; the candidate level runs by query group
        and "_dkdv_kernel QUERY_BLOCK=16 KEY_BLOCK=16 GROUP=1 PER_ITER=1 N_SPLIT=1 grid (64, 1, 1)" in dkdv
    )
    assert "_grouped_dkdv_kernel KEY_BLOCK=16 SLOTS=4 grid (1, 4, 1)" in labels  # 4 ancestors, lists of 2 blocks
    assert "_sum_slots_kernel KEY_BLOCK=16 grid (4, 1)" in labels
    assert "_pooled_topk_kernel grid (4, 1)" in labels  # a kernel without block constants: name and grid


BREAKDOWN_SNIPPET = """
import sys
sys.path.insert(0, "scripts")
import torch
import kernel_ab
import pixdit.report
import pixdit.kernels as lib

q, k, v = (torch.randn(1, 1, 1024, 16) for _ in range(3))
call = lambda: lib.llsa_attention(q, k, v, block_size=16, topk=2, num_levels=2, impl="triton")

with kernel_ab.labelled_launches(lib) as seen:  # the kernels of one call, in launch order
    call()
order = [name for name, _ in seen]

def profiled(fn, calls, warmup):  # what torch.profiler reports on a GPU: kernels by name, in the order they ran
    for _ in range(calls):
        fn()
    return [(name, 1.0 + i) for i, name in enumerate(order * calls)] + [("a copy", 0.5)]

pixdit.report.kernel_events = profiled
for label, ms in kernel_ab.launch_breakdown(lib, call, calls=2, warmup=0).items():
    print(f"{ms}|{label}")
pixdit.report.kernel_events = lambda fn, calls, warmup: profiled(fn, calls, warmup)[1:]
try:
    kernel_ab.launch_breakdown(lib, call, calls=1, warmup=0)
except RuntimeError as error:
    print("mismatch:", error)
"""


def test_launch_breakdown_matches_kernels_to_launches_in_order():
    """kernel_ab.launch_breakdown on the CPU, the profiler replaced by one that numbers the kernels in launch order:
    each launch's time lands on its own label (equal labels of two calls add up, per call), other kernels keep their
    names, and a profile that does not match the launches is an error, not a wrong table."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PIXDIT_KERNELS_AUTOTUNE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", BREAKDOWN_SNIPPET], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr
    rows = dict(line.split("|")[::-1] for line in run.stdout.splitlines() if "|" in line)
    # one LLSA forward: the pooling of q, k, v (one launch), the pyramid's second level and the bank (one), 2
    # selection launches, then the fine (5th) and the pooled (6th) forward; 6 launches per call, so the second
    # call's fine forward is the 11th kernel
    assert float(rows["_fwd_kernel BLOCK_M=16 KEY_BLOCK=16 PER_ITER=1 grid (64, 1)"]) == (5 + 11) / 2
    assert float(rows["_block_means_kernel GROUP=2 grid (32, 1, 3)"]) == (1 + 7) / 2
    assert float(rows["_next_level_kernel grid (4, 1, 3)"]) == (2 + 8) / 2
    assert float(rows["_pooled_topk_kernel grid (1, 1)"]) == (3 + 9) / 2 and float(rows["a copy"]) == 0.25
    assert "mismatch: launch_breakdown: the profiler saw" in run.stdout


def test_bench_joint_quick_cpu(monkeypatch):
    """The joints' benchmark: the three compiled forms (plain ops, adaln_joint recomputing its statistics and reading
    the forward's) give the same gradients (fp32 here), and in the interpreter the Triton backward runs at every
    launch both ways, the fixed one marked once per joint."""
    command = [sys.executable, "scripts/bench_joint.py", "--quick", "--device", "cpu"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    plain, fused, from_stats = (line for line in lines if line.startswith(("| Inductor", "| adaln_joint")))
    assert "statistics" in from_stats
    assert float(fused.split("|")[-2]) < 1e-5 and float(from_stats.split("|")[-2]) < 1e-5, (fused, from_stats)
    launches = [line for line in lines if line.startswith(("| before the attention", "| after the attention"))]
    from pixdit.kernels.adaln_joint import backward_launches

    assert len(launches) == 2 * sum(launch["NUM_STAGES"] == 2 for launch in backward_launches(48))
    assert sum("| yes |" in line for line in launches) == 2
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # bad input, in process: the script's folder on the path
    parse_args = runpy.run_path(str(ROOT / "scripts" / "bench_joint.py"))["parse_args"]
    with pytest.raises(SystemExit, match="--side must be >= 1, got 0"):
        parse_args(["--side", "0"])
    with pytest.raises(SystemExit, match="--per-kernel needs a CUDA device"):
        parse_args(["--quick", "--device", "cpu", "--per-kernel", "4"])


def test_device_suite_knob_names_a_missing_knob_before_any_work(tmp_path):
    """``device_suite.sh knob`` copies kernels/ once per NAME=VALUE and rewrites that module-level line; a name that
    block_sparse.py does not define at module level is refused with its name, before anything is timed."""
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "scripts/device_suite.sh", "knob", "REGISTER_CAPS = 152"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 2 and "kernels/block_sparse.py has no one-line module-level 'REGISTER_CAPS = ...'" in (
        run.stderr + run.stdout
    )
    assert not (tmp_path / "ab_knob.log").exists()


def test_bench_attention_speedups_follow_the_sdpa_row_wherever_it_stands(monkeypatch):
    """The speed-ups are over the SDPA row of the same size even when ``sdpa`` is listed after the sparse backends
    (a run with ``--backends llsa,sdpa`` once printed "-" for them); a size without an SDPA row has none. With kernel
    time, the time columns are the GPU's and the eager medians get their own column: header and rows agree."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the script imports its neighbour kernel_ab
    script = runpy.run_path(str(ROOT / "scripts" / "bench_attention.py"))

    def row(side, backend, fwd, fwdbwd, kernel_time):
        return dict(side=side, tokens=side * side, batch=2, backend=backend, tokens_per_query=512, fwd_ms=fwd,
                    fwdbwd_ms=fwdbwd, eager_fwd_ms=2 * fwd, eager_fwdbwd_ms=2 * fwdbwd, kernel_time=kernel_time,
                    peak_mib=1.0, fwd_tflops=1.0, fwdbwd_tflops=1.0)  # fmt: skip

    for kernel_time in (False, True):
        rows = [row(256, "llsa L=2", 0.5, 2.0, kernel_time), row(256, "sdpa", 25.0, 100.0, kernel_time)]
        rows.append(row(128, "llsa L=2", 0.4, 1.5, kernel_time))
        script["fill_speedups"](rows)
        assert (rows[0]["speedup_fwd"], rows[0]["speedup_fwdbwd"]) == (50.0, 50.0)
        assert (rows[1]["speedup_fwd"], rows[2]["speedup_fwd"]) == (1.0, None)
        head, rule = script["header"](kernel_time).splitlines()
        cells = [script["format_row"](r).count("|") for r in rows]
        assert cells == [head.count("|")] * 3 == [rule.count("|")] * 3
        line = script["format_row"](rows[0])
        assert "| 50.0x | 50.0x |" in line and (" 1.000 / 4.000 |" in line) == kernel_time
        assert ("GPU fwd ms" in head) == kernel_time


def test_profile_llsa_host_mode_reports_gpu_and_wall_time_and_the_host_functions(monkeypatch, capsys):
    """``profile_llsa.py --host`` (device_suite.sh host): the GPU time of a call, its wall time back to back and the
    host's functions by own time, here with a stand-in for the GPU profiler and a CPU call that sleeps."""
    import time

    import torch

    import pixdit.report as report

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when run as a script: its folder's kernel_ab
    host_profile = runpy.run_path(str(ROOT / "scripts" / "profile_llsa.py"))["host_profile"]
    monkeypatch.setattr(report, "kernel_ms", lambda fn: 0.25)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    def slow_launcher():
        calls.append(1)
        time.sleep(0.002)

    host_profile(slow_launcher, 5)
    out = capsys.readouterr().out
    wall = float(out.split("wall time per call back to back ")[1].split(" ms")[0])
    host = float(out.split("(host ")[1].split(" ms")[0])
    # two warm-up calls, five timed back to back, five under cProfile
    assert "GPU kernel time 0.250 ms" in out and wall >= 2.0 and host >= 2.0 and len(calls) == 12
    assert "slow_launcher" in out and "tottime" in out
