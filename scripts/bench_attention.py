"""Attention kernel benchmark: LLSA, VSA and SLA against PyTorch SDPA and our dense kernel, in the same run.

    python scripts/bench_attention.py                       # 64^2..512^2 tokens, batch*N = 131072, bf16, h=6, d=64
    python scripts/bench_attention.py --quick               # 64^2 and 128^2 only, fewer repeats
    python scripts/bench_attention.py --backends sdpa,flash,llsa --levels 2 --out outputs/bench
    python scripts/bench_attention.py --plot-from outputs/bench/bench_attention.json   # (re)draw the PNG only

Times are medians (ms, CUDA events: ``pixdit.report.time_median``) of the whole call (LLSA includes pooling + selection) for the
forward and for forward+backward (backward of a random upstream gradient). TFLOP/s counts the FLOPs of the attended
tokens only: forward 4*N*T*d per batch*head (T = tokens per query, N for dense), forward+backward 3.5x that
(FlashAttention convention). ``--kernel-time``: the time columns (and the speed-ups and TFLOP/s from them) are the GPU
kernel time instead (torch.profiler, every kernel of the call, no host path; an eager sparse call is host-bound at
256^2), with the eager medians in a last column. The speed-ups are over the SDPA row of the same size, wherever
``sdpa`` stands in --backends (the table printed at the end has them all). Writes a markdown table, a JSON file and a
log-log PNG (time vs tokens) under --out.

Backends: ``sdpa`` (torch scaled_dot_product_attention), ``flash`` (pixdit.kernels.flash_attention: our dense
block-sparse kernel with every block listed), ``llsa`` (one row per valid L), ``vsa`` / ``sla`` (K per image side
from ``--baseline-topk``, one row per block size; VSA gated, SLA timed as ``o_sparse + o_linear``; selection
included; tok/query counts the fine/sparse keys ``K * block``). ``bsa`` / ``flex``: ``block_sparse_attention`` and compiled FlexAttention on the same random block lists
(``--bsa-cases``), so their ratio is measured in one run; Flex twice: with its BlockMask built once outside the
timing ("flex"), and built in every call ("flex+mask"), as a selection that changes per call needs it (ours builds
its transposed lists inside every call). Add a backend: write a
``make_<name>(args, q, k, v) -> list[(label, fn, tokens_per_query)]`` function and list it in BACKENDS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from kernel_ab import random_block_order

from pixdit.report import kernel_ms, time_median


def make_sdpa(args, q, k, v):
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    return [("sdpa", fn, q.shape[2])]


def make_flash(args, q, k, v):
    from pixdit.kernels import flash_attention

    return [("flash (ours, dense)", lambda: flash_attention(q, k, v), q.shape[2])]


def make_llsa(args, q, k, v):
    from pixdit.kernels import llsa_attention, llsa_check

    out, N, B = [], q.shape[2], args.block_size
    for L in args.levels:
        if N % B**L or N // B**L < B:  # valid: B^L divides N and the coarsest level has >= B tokens
            continue
        T = llsa_check(N, B, L, args.topk)["tokens_per_query"]
        fn = lambda L=L: llsa_attention(q, k, v, block_size=B, topk=args.topk, num_levels=L)
        out.append((f"llsa L={L}", fn, T))
    return out


def _baseline_topk(args, N):
    """K of the VSA/SLA rows for this image side (``--baseline-topk side:K,...``; LLSA paper: 20 at 128², 32 at 256²)."""
    table = dict(tuple(int(x) for x in item.split(":")) for item in args.baseline_topk.split(","))
    return table.get(int(round(N**0.5)), max(table.values()))


def make_vsa(args, q, k, v):
    from pixdit.kernels import vsa_attention

    K = _baseline_topk(args, q.shape[2])
    gate = torch.randn_like(q).requires_grad_(q.requires_grad)  # the layer's G_c output: trained, so with a gradient

    def call(C):
        gate.grad = None  # a leaf like q, k, v (bench_one clears theirs): no accumulation into .grad is timed
        return vsa_attention(q, k, v, block_size=C, topk=K, gate=gate)

    return [(f"vsa C={C} K={K}", (lambda C=C: call(C)), K * C) for C in args.vsa_block_sizes]


def make_sla(args, q, k, v):
    from pixdit.kernels import sla_attention

    K = _baseline_topk(args, q.shape[2])
    return [
        (f"sla C={C} K={K}", (lambda C=C: sum(sla_attention(q, k, v, block_size=C, topk=K))), K * C)
        for C in args.sla_block_sizes
    ]


def _bsa_cases(args, q):
    """(block, K) pairs of the block-sparse rows: --bsa-cases "128:16,128:64,64:32,64:128"."""
    cases = [tuple(int(x) for x in item.split(":")) for item in args.bsa_cases.split(",") if item]
    return [(blk, K) for blk, K in cases if q.shape[2] % blk == 0 and K <= q.shape[2] // blk]


def make_bsa(args, q, k, v):
    """``block_sparse_attention`` on random lists (the same lists as the ``flex`` rows)."""
    from pixdit.kernels import block_sparse_attention

    rows = []
    for blk, K in _bsa_cases(args, q):
        lists = random_block_order(q.shape, blk, q.device)[..., :K].contiguous()
        fn = lambda lists=lists, blk=blk: block_sparse_attention(q, k, v, lists, query_block=blk, key_block=blk)
        rows.append((f"block_sparse {blk} K={K}", fn, K * blk))
    return rows


def make_flex(args, q, k, v):
    """PyTorch FlexAttention (compiled) with a BlockMask built from the very same lists as ``bsa`` (all listed
    blocks marked full, so no mask_mod runs: Flex's fastest form). Flex takes only blocks its tiles divide."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for blk, K in _bsa_cases(args, q):
        perm = random_block_order(q.shape, blk, q.device)
        b, h, n = perm.shape[:3]
        counts = torch.full((b, h, n), K, device=q.device, dtype=torch.int32)
        try:
            mask = BlockMask.from_kv_blocks(torch.zeros_like(counts), perm, counts, perm, BLOCK_SIZE=blk)
            o_flex = flex(q, k, v, block_mask=mask)
        except Exception as err:  # e.g. "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"
            print(f"flex {blk} K={K}: not run ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
            continue
        # same function as ours? (only the compiled Flex honours the block mask; eager Flex runs dense)
        from pixdit.kernels import block_sparse_attention

        o_ours = block_sparse_attention(q, k, v, perm[..., :K].contiguous(), query_block=blk, key_block=blk)
        err = ((o_flex.float() - o_ours.float()).norm() / o_ours.float().norm()).item()
        print(f"flex {blk} K={K}: relative difference to block_sparse_attention {err:.1e}")
        rows.append((f"flex {blk} K={K}", (lambda mask=mask: flex(q, k, v, block_mask=mask)), K * blk))

        # What a selection that changes every call (VSA, LLSA) costs in Flex: the BlockMask, whose transposed
        # index (Flex's backward walks it) is built per call, as block_sparse_attention builds its CSC per call.
        def flex_and_mask(perm=perm, counts=counts, blk=blk):
            mask = BlockMask.from_kv_blocks(torch.zeros_like(counts), perm, counts, perm, BLOCK_SIZE=blk)
            return flex(q, k, v, block_mask=mask)

        rows.append((f"flex+mask {blk} K={K}", flex_and_mask, K * blk))
    return rows


BACKENDS = {
    "sdpa": make_sdpa,
    "flash": make_flash,
    "llsa": make_llsa,
    "vsa": make_vsa,
    "sla": make_sla,
    "bsa": make_bsa,
    "flex": make_flex,
}


def bench_one(fn, q, k, v, quick, kernel_time=False):
    warm, rep = (10, 30) if quick else (25, 100)  # calls
    o = fn()
    do = torch.randn_like(o)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fn().backward(do)

    with torch.no_grad():
        t_fwd = 1000 * time_median(fn, warm, rep, q.device)[0]
    t_fb = 1000 * time_median(fwd_bwd, warm, rep, q.device)[0]
    gpu = None
    if kernel_time:  # the kernels alone: eager minus this = the host path's share
        with torch.no_grad():
            fwd_gpu = kernel_ms(fn)
        gpu = (fwd_gpu, kernel_ms(fwd_bwd))
        print(f"  kernel time: fwd {gpu[0]:.3f} ms (eager {t_fwd:.3f}); fwd+bwd {gpu[1]:.3f} ms (eager {t_fb:.3f})")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return t_fwd, t_fb, peak, gpu


def profile(fn, q, k, v, label):
    """Per-kernel CUDA time of one forward+backward (torch.profiler), to see where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    o = fn()
    do = torch.randn_like(o)
    for _ in range(3):
        fn().backward(do)
    torch.cuda.synchronize()
    for x in (q, k, v):  # as bench_one: no accumulation into .grad (three full-size adds that are not attention)
        x.grad = None
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn().backward(do)
        torch.cuda.synchronize()
    print(f"## profile {label} (one forward+backward)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))


def run(args):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows = []
    for side in args.sizes:
        N = side * side
        batch = max(1, args.tokens_total // N)
        torch.manual_seed(0)
        q, k, v = (
            torch.randn(batch, args.heads, N, args.head_dim, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        for name in args.backends:
            for label, fn, T in BACKENDS[name](args, q, k, v):
                if label.startswith("flash") and N > args.max_dense_ours:
                    continue
                t_fwd, t_fb, peak, gpu = bench_one(fn, q, k, v, args.quick, kernel_time=args.kernel_time)
                if args.profile and label.split()[0] in ("llsa", "vsa", "sla", "block_sparse", "flex"):
                    profile(fn, q, k, v, f"{label} at {side}^2")
                flops = 4.0 * N * T * args.head_dim * batch * args.heads
                # the time columns: GPU kernel time with --kernel-time (an eager sparse call is host-bound), else
                # the eager medians; the eager medians stay in their own columns
                fwd_ms, fwdbwd_ms = gpu if gpu else (t_fwd, t_fb)
                if args.label:
                    label = f"{label} ({args.label})"
                row = dict(
                    side=side,
                    tokens=N,
                    batch=batch,
                    backend=label,
                    tokens_per_query=T,
                    fwd_ms=fwd_ms,
                    fwdbwd_ms=fwdbwd_ms,
                    eager_fwd_ms=t_fwd,
                    eager_fwdbwd_ms=t_fb,
                    kernel_time=gpu is not None,
                    peak_mib=peak,
                    fwd_tflops=flops / fwd_ms * 1e-9,
                    fwdbwd_tflops=3.5 * flops / fwdbwd_ms * 1e-9,
                )
                rows.append(row)
                fill_speedups(rows)
                print(format_row(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def fill_speedups(rows):
    """Each row's speed-up over the SDPA row of its size, wherever that row stands in the list (None while there
    is none): the same time columns on both sides."""
    sdpa = {r["side"]: r for r in rows if r["backend"].split(" (")[0] == "sdpa"}
    for r in rows:
        base = sdpa.get(r["side"])
        r["speedup_fwd"] = base["fwd_ms"] / r["fwd_ms"] if base else None
        r["speedup_fwdbwd"] = base["fwdbwd_ms"] / r["fwdbwd_ms"] if base else None


def header(kernel_time: bool) -> str:
    """The table's header; with kernel time the time columns say so and the eager medians follow."""
    times = "GPU fwd ms | GPU fwd+bwd ms" if kernel_time else "fwd ms | fwd+bwd ms"
    eager = " eager fwd / fwd+bwd ms |" if kernel_time else ""
    cols = 11 + kernel_time
    return (
        f"| tokens | batch | backend | tok/query | {times} | speed-up fwd | speed-up fwd+bwd | peak MiB | "
        f"TFLOP/s fwd | TFLOP/s fwd+bwd |{eager}\n|" + "---|" * cols
    )


def format_row(r):
    sp = lambda x: "-" if x is None else f"{x:.1f}x"  # noqa: E731
    eager = f" {r['eager_fwd_ms']:.3f} / {r['eager_fwdbwd_ms']:.3f} |" if r.get("kernel_time") else ""
    return (
        f"| {r['tokens']:,} ({r['side']}²) | {r['batch']} | {r['backend']} | {r['tokens_per_query']:,} | "
        f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {sp(r.get('speedup_fwd'))} | {sp(r.get('speedup_fwdbwd'))} | "
        f"{r['peak_mib']:.0f} | {r['fwd_tflops']:.0f} | {r['fwdbwd_tflops']:.0f} |{eager}"
    )


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (re-run with --plot-from on a machine that has it)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwdbwd_ms", "forward + backward")):
        for label in dict.fromkeys(r["backend"] for r in rows):
            pts = [(r["tokens"], r[key] / r["batch"]) for r in rows if r["backend"] == label]
            ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per image")
        ax.set_ylabel("ms per image (batch-normalised)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="sdpa,flash,llsa", help="comma list of " + ",".join(BACKENDS))
    p.add_argument("--sizes", default="64,128,256,512", help="image sides; tokens = side^2")
    p.add_argument("--levels", default="1,2,3", help="LLSA levels to time (only valid ones run)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--baseline-topk", default="64:8,128:20,256:32,512:32", help="VSA/SLA K per image side")
    p.add_argument("--vsa-block-sizes", default="16,64", help="VSA tile sizes to time")
    p.add_argument("--sla-block-sizes", default="16", help="SLA block sizes to time")
    p.add_argument(
        "--bsa-cases",
        default="128:16,128:64,64:32,64:128",
        help="block:K pairs of the bsa / flex rows (random lists, identical for both)",
    )
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-total", type=int, default=131072, help="batch = max(1, tokens_total // tokens)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--max-dense-ours", type=int, default=65536, help="skip our dense kernel above this many tokens")
    p.add_argument("--quick", action="store_true", help="64^2 and 128^2 only, fewer timed calls")
    p.add_argument("--out", default="outputs/bench_attention")
    p.add_argument(
        "--kernels-from",
        default=None,
        metavar="DIR",
        help="time the kernel library in DIR (another commit's kernels/) instead of the installed one",
    )
    p.add_argument("--label", default="", help="suffix for every row's backend name (e.g. 'base' in an A/B run)")
    p.add_argument(
        "--kernel-time",
        action="store_true",
        help="time columns in GPU kernel time (torch.profiler) instead of eager medians, which follow in a last "
        "column: at 256² an eager sparse call is host-bound",
    )
    p.add_argument(
        "--llsa-coarse-tile",
        type=int,
        default=None,
        help="query rows per program of LLSA's pooled-level pass (a tuning experiment; default: the library's)",
    )
    p.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table per sparse or Flex row")
    p.add_argument("--plot-from", default=None, help="JSON written by an earlier run: only draw the plot")
    args = p.parse_args(argv)
    if args.kernels_from:
        from kernel_ab import use_kernels_from

        use_kernels_from(args.kernels_from)  # before the backends import pixdit.kernels
    if args.llsa_coarse_tile:
        import pixdit.kernels.llsa as llsa_module

        llsa_module.COARSE_TILE = args.llsa_coarse_tile
    os.makedirs(args.out, exist_ok=True)
    if args.plot_from:
        plot(json.load(open(args.plot_from))["rows"], os.path.join(args.out, "bench_attention.png"))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (the CPU path is an exact reference, not a fast kernel)")
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown:
        sys.exit(f"unknown backend(s) {unknown}; choose from {sorted(BACKENDS)}")
    args.sizes = [64, 128] if args.quick else [int(s) for s in args.sizes.split(",")]
    args.levels = [int(x) for x in args.levels.split(",")]
    args.vsa_block_sizes = [int(x) for x in args.vsa_block_sizes.split(",")]
    args.sla_block_sizes = [int(x) for x in args.sla_block_sizes.split(",")]
    print(
        f"# {torch.cuda.get_device_name()} torch {torch.__version__} dtype {args.dtype} heads {args.heads} "
        f"head_dim {args.head_dim} B={args.block_size} K={args.topk}"
    )
    print(header(args.kernel_time))
    rows = run(args)  # speed-ups filled after every row, so the last table has an SDPA row listed later too
    cmd = "python scripts/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = os.path.join(args.out, "bench_attention.md")
    with open(md, "w") as f:
        f.write(
            f"`{cmd}` on {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
            f"heads {args.heads}, head_dim {args.head_dim}, B={args.block_size}, K={args.topk}\n\n"
        )
        table = header(args.kernel_time) + "\n" + "\n".join(format_row(r) for r in rows)
        f.write(table + "\n")
    json.dump({"command": cmd, "rows": rows}, open(os.path.join(args.out, "bench_attention.json"), "w"), indent=1)
    print(f"\n{table}\n\nwrote {md}")  # again, with every speed-up (an SDPA row listed later included)
    plot(rows, os.path.join(args.out, "bench_attention.png"))


if __name__ == "__main__":
    main()
