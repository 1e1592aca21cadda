"""Sample-generation throughput (images/s) of the pixel DiT: full vs sparse attention, as a markdown table.

Times what an FID evaluation spends on the GPU per batch: `RectifiedFlow.sample` (20 Euler steps by default, bf16
autocast, model in eval mode, no gradients) on a batch of noise already on the device. Per (attention, size): 2
warm-up batches, then the median of --repeats batches timed with CUDA events. Default: DiT-S, full and llsa
(Z-order token order for the sparse one), 128^2 and 256^2, batch 64 at 128^2 and 16 at 256^2 (--batch overrides).

    python scripts/bench_sampling.py                                    # H200: the table for docs/benchmarks.md
    python scripts/bench_sampling.py --attention full llsa vsa --sizes 128 256 512 --batch 8
    python scripts/bench_sampling.py --attention llsa:num_levels=2 --sizes 256 --batch 64 --compile   # a variant
    python scripts/bench_sampling.py --attention llsa --sizes 128 256 512 --compile --out bench/sampling   # + files
    python scripts/bench_sampling.py --attention llsa --sizes 256 --batch 64 --compile --gelu both   # fused vs separate
    python scripts/bench_sampling.py --attention llsa --sizes 256 --batch 32 --compile --means both  # prologue vs own
    python scripts/bench_sampling.py --attention llsa --sizes 256 --batch 32 --compile --v both   # v in place vs copied
    python scripts/bench_sampling.py --attention llsa --sizes 256 --batch 32 --compile --qkv both  # one GEMM vs two
    python scripts/bench_sampling.py --attention llsa --sizes 256 --batch 32 --compile --gelu separate \
        --compile-mode default max-autotune-no-cudagraphs          # Inductor's own matmuls, GELU in their epilogue
    python scripts/bench_sampling.py --device cpu --quick               # CPU smoke run of the script itself

--profile adds, per row, one more batch under torch.profiler: its GPU time by kind of kernel (the table of
bench_train.py --profile: matmul, sparse attention, block means, selection, qk-norm + RoPE, Inductor's fused kernels)
and the top ops, with the time per image and Euler step; with --compile, also Inductor's kernels ranked by the time
they lose against a bandwidth floor (as bench_train.py --compile --profile).

--gelu both times every variant twice in one process: with the MLP's fc1 + GELU as one cuBLASLt call (what sampling
uses on CUDA, pixdit.models.dit.Mlp) and as the two separate ops (what training runs), the "GELU" column.
--means both does the same for the block means of q, k, v (LLSA, VSA, SLA): computed by the qk-norm + RoPE kernel as
it writes them (what the model does, pixdit.models.dit.Attention) or by the attention backend in a pass of its own, the
"means" column. --v both does it for the v that LLSA's forward reads: a view of the qkv projection's output (what
sampling uses, pixdit.models.dit.Attention.view_v) or the contiguous copy that training's backward needs, the "v"
column. --qkv both does it for the qkv projection and the qk-norm + RoPE kernel: two launches (cuBLAS writes qkv,
the kernel reads it back) or one Triton GEMM with the kernel's work in its epilogue (pixdit.kernels.qkv_norm_rope,
pixdit.models.dit.Attention.fuse_inference_qkv), the "qkv" column. --compile-mode MODE [MODE ...] does it for torch.compile's modes (the "mode" column): e.g.
max-autotune-no-cudagraphs against default, where Inductor times its own Triton matmuls against cuBLAS and may fuse
the elementwise work after them (with --gelu separate, the GELU) into their epilogue.

Each row also says what the sampling of a 50,000-image FID costs on one such device ("50k h": hours at --steps
Euler steps; the Inception pass over the samples is not included). With --out DIR: bench_sampling.md (rewritten
after every row, so a run cut short keeps what it measured), bench_sampling.json and bench_sampling.png (images/s
and hours per 50k against the image side, one line per attention variant).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

if any(arg.startswith("--kernels-from") for arg in sys.argv):  # swap the kernel library before pixdit imports it
    from kernel_ab import apply_from_argv

    apply_from_argv(sys.argv)

from pixdit.attention.variants import (  # noqa: E402
    add_block_means_option,
    block_means_settings,
    parse_variant,
    switch_settings,
)
from pixdit.errors import PixditError  # noqa: E402
from pixdit.eval.sampling import auto_batch_size, check_batch_size, sampling_model  # noqa: E402
from pixdit.files import atomic_write, write_json  # noqa: E402
from pixdit.flow import RectifiedFlow  # noqa: E402
from pixdit.models import DIT_MODELS, build_model  # noqa: E402
from pixdit.models.dit import Attention, Mlp  # noqa: E402
from pixdit.report import (  # noqa: E402
    bandwidth_report,
    enable_inductor_kernel_bytes,
    kernel_table,
    markdown_table,
    time_median,
)
from pixdit.runtime import PRECISIONS, autocast  # noqa: E402

DEFAULT_BATCH = {64: 256, 128: 64, 256: 16, 512: 4}
FID_SAMPLES = 50_000  # the samples of the papers' FID protocol; "50k h" = their sampling time on one device


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="DiT-S", choices=list(DIT_MODELS))
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["full", "llsa"],
        help="attention variants: NAME or NAME:KEY=VALUE,... (configs/attention/NAME.yaml)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256], help="image sides in pixels")
    parser.add_argument(
        "--batch",
        nargs="+",
        default=None,
        help="images per batch: an int, or auto (what fits in free GPU memory, as evaluation does); several values: "
        "one row each, in one process (an A/B of the batch); default: by size",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the forward (static batch shape), as evaluation does on GPUs",
    )
    parser.add_argument(
        "--compile-mode",
        nargs="+",
        default=["default"],
        choices=["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"],
        help="torch.compile modes, with --compile: one row per mode (an A/B in one process; default: default)",
    )
    parser.add_argument("--steps", type=int, default=20, help="Euler steps per sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="write bench_sampling.md/.json/.png into this folder")
    parser.add_argument("--quick", action="store_true", help="tiny model, sizes and counts (CPU check of the script)")
    parser.add_argument(
        "--profile", action="store_true", help="per row: one more batch under torch.profiler, by kind of kernel"
    )
    parser.add_argument(
        "--gelu",
        default="fused",
        choices=["fused", "separate", "both"],
        help="the MLP's fc1 + GELU in sampling: one cuBLASLt call with the GELU in its epilogue (CUDA only), the two "
        "separate ops, or both in one run (an A/B)",
    )
    add_block_means_option(parser)
    parser.add_argument(
        "--v",
        default="view",
        choices=["view", "copy", "both"],
        help="the v of a backend that reads it in place (LLSA): a view of the qkv projection's output, a contiguous "
        "copy written by the qk-norm kernel (as in training), or both, one row each (an A/B in one process)",
    )
    parser.add_argument(
        "--qkv",
        default="separate",
        choices=["separate", "fused", "both"],
        help="the qkv projection and the qk-norm + RoPE kernel as two launches (cuBLAS, then the kernel) or as one GEMM "
        "with the kernel's work in its epilogue (pixdit.models.dit.Attention.fuse_inference_qkv), or both, one row "
        "each (an A/B in one process)",
    )
    parser.add_argument(
        "--kernels-from",
        default=None,
        metavar="DIR",
        help="sample with the kernel library in DIR (another commit's kernels/) instead of the installed one",
    )
    return parser.parse_args(argv)


def bench(
    args,
    attention: str,
    attention_config: dict,
    side: int,
    batch_spec,
    gelu: str,
    means: str,
    v: str,
    mode: str,
    qkv: str = "separate",
) -> dict:
    """One row: ``batch_spec`` an int, "auto" (from free memory) or None (the size's default batch)."""
    device = torch.device(args.device)
    overrides = dict(hidden_size=64, depth=2, num_heads=2) if args.quick else {}
    model = build_model(args.model, input_size=(side, side), attention=attention_config, **overrides)
    model = model.to(device).eval().requires_grad_(False)
    flow = RectifiedFlow(image_size=side)
    if batch_spec == "auto":
        batch = auto_batch_size(model, (side, side), device, args.precision)
    else:
        batch = batch_spec or DEFAULT_BATCH.get(side, max(1, 65536 * 16 // (side * side)))
    model = sampling_model(model, device, args.compile, mode)
    noise = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0)).to(device)
    cuda = device.type == "cuda"

    def sample(model=model, noise=noise):  # bound here, so `del` below frees them between sizes
        with autocast(device, args.precision):
            return flow.sample(model, noise, args.steps)

    seconds, peak_gb = time_median(sample, args.warmup, args.repeats, device)
    title = f"{attention}, {side}x{side}, batch {batch}"
    profile = print_profile(sample, batch * args.steps, title, cuda, args.inductor_dir) if args.profile else None
    result = {
        "attention": attention,
        "size": f"{side}x{side}",
        "batch": batch,
        "steps": args.steps,
        "compiled": bool(args.compile and cuda),
        "mode": mode if args.compile and cuda else "-",
        "GELU": gelu if cuda else "separate",
        "means": means,
        "v": v,
        "qkv": qkv if cuda else "separate",
        "batch s": seconds,
        "images/s": batch / seconds,
        "50k h": FID_SAMPLES / (batch / seconds) / 3600,
        "peak GB": peak_gb,
        **({"profile": profile} if profile else {}),
    }
    del sample, model, noise
    if cuda:
        torch.cuda.empty_cache()
    return result


def print_profile(
    sample, network_calls: int, title: str, cuda: bool, inductor_dir=None, row_limit: int = 25
) -> list[dict]:
    """One batch under torch.profiler: the time by kind of kernel (device time on CUDA, the ops' CPU time on CPU), per
    batch and per image and Euler step (``network_calls`` = images x steps), then the top ops; with ``inductor_dir``
    (``enable_inductor_kernel_bytes``), Inductor's kernels against the bandwidth floor. Returns the table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        sample()
        if cuda:
            torch.cuda.synchronize()
    table = kernel_table(prof, cuda)
    for row in table:
        row["ms per image-step"] = row["ms"] / network_calls
    unit = "device" if cuda else "CPU"
    print(f"\n## profile: one batch of {title}\n\n{unit} time by kind of kernel:\n", file=sys.stderr)
    print(markdown_table(table, cell=lambda c, v: f"{v:,.3f}" if isinstance(v, float) else str(v)), file=sys.stderr)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\ntop {row_limit} ops by {sort_by}:", file=sys.stderr)
    print(prof.key_averages().table(sort_by=sort_by, row_limit=row_limit, max_name_column_width=70), file=sys.stderr)
    rows, text = bandwidth_report(prof, inductor_dir if cuda else None, row_limit)
    if rows:
        print(f"\n{text}", file=sys.stderr)
    return table


def markdown(rows: list[dict]) -> str:
    columns = [key for key in rows[0] if key != "profile"]  # the profile is a table of its own (printed, in the JSON)
    return markdown_table(
        rows, columns, cell=lambda column, value: f"{value:,.3f}" if isinstance(value, float) else str(value)
    )


def write_files(out: Path, command: str, settings: str, rows: list[dict]) -> None:
    """bench_sampling.md and .json (atomic: a run stopped by a time limit leaves the last complete table)."""
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in rows if "images/s" in r]
    table = markdown(done) if done else "every setting ran out of memory"
    with atomic_write(out / "bench_sampling.md", "w") as f:
        f.write(f"```\n{command}\n```\n\n{settings}\n\n{table}\n")
    write_json(out / "bench_sampling.json", {"command": command, "settings": settings, "rows": rows})


def variant(row: dict) -> str:
    """The row's attention variant, with the MLP's GELU named where it ran as separate ops and the block means where
    the backend pooled them."""
    return (
        row["attention"]
        + (" (separate GELU)" if row.get("GELU") == "separate" else "")
        + (" (means in backend)" if row.get("means") == "backend" else "")
        + (" (v copied)" if row.get("v") == "copy" else "")
        + (" (qkv GEMM fused)" if row.get("qkv") == "fused" else "")
        + (f" ({row['mode']})" if row.get("mode") not in (None, "-", "default") else "")
    )


def ab_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(row, twin) for every --gelu / --means / --v / --qkv / --compile-mode A/B: the twin ran the same attention with
    only that switch off (the separate GELU, the backend's own means, v copied, the projection and the qk-norm
    kernel as two launches, the default compile mode)."""
    switches = {"GELU": "separate", "means": "backend", "v": "copy", "qkv": "separate", "mode": "default"}
    pairs = []
    for row in rows:
        for key, off in switches.items():
            if row.get(key) == off:
                continue
            want = {**{k: row.get(k) for k in switches}, key: off, "attention": row["attention"]}
            pairs += [(row, other) for other in rows if all(other.get(k) == v for k, v in want.items())]
    return pairs


def plot(rows: list[dict], path: Path) -> None:
    """images/s and hours per 50k samples against the image side, one line per attention variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is missing: no {path.name}")
        return
    done = [r for r in rows if "images/s" in r]
    if not done:
        return
    fig, (ax_rate, ax_hours) = plt.subplots(1, 2, figsize=(11, 4.2))
    sides = sorted({int(r["size"].split("x")[0]) for r in done})
    for index, name in enumerate(dict.fromkeys(variant(r) for r in done)):
        mine = sorted((r for r in done if variant(r) == name), key=lambda r: int(r["size"].split("x")[0]))
        x = [int(r["size"].split("x")[0]) for r in mine]
        style = dict(marker="o", color=f"C{index % 10}", label=name)
        ax_rate.plot(x, [r["images/s"] for r in mine], **style)
        ax_hours.plot(x, [r["50k h"] for r in mine], **style)
    ax_rate.set_ylabel("images / s")
    ax_rate.set_title("sample generation")
    ax_hours.set_ylabel(f"hours of one device for {FID_SAMPLES:,} samples")
    ax_hours.set_title("sampling cost of one FID evaluation")
    for ax in (ax_rate, ax_hours):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sides, [f"{s}²" for s in sides])
        ax.minorticks_off()
        ax.set_xlabel("image side (pixels)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup, args.repeats = [16], 2, 1, 1
        args.batch = args.batch if args.batch and len(args.batch) > 1 else ["2"]  # several: the A/B's CPU check
    batches = [None]  # the default batch of each size
    if args.batch:
        try:
            batches = [check_batch_size(b if b == "auto" else int(b), "--batch") for b in args.batch]
        except (PixditError, ValueError):
            sys.exit(f"error: --batch {' '.join(args.batch)}: each value must be a positive int or auto")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is visible; use --device cpu --quick to check the script")
    try:  # every variant is checked before the first one is timed
        variants = {spec: parse_variant(spec) for spec in args.attention}
    except PixditError as error:
        sys.exit(f"error: {error}")
    # the profile's bandwidth table of Inductor's kernels reads their byte estimates from the output code there
    args.inductor_dir = enable_inductor_kernel_bytes() if args.profile and args.compile else None
    command = "python scripts/bench_sampling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    settings = (
        f"{args.model}, {args.steps} Euler steps, {args.precision} autocast, eval mode, {device}, "
        f"torch {torch.__version__}; median of {args.repeats} batches after {args.warmup} warm-up; "
        f"50k h = sampling hours of one such device for {FID_SAMPLES:,} images"
    )
    rows = []
    gelus = ["fused", "separate"] if args.gelu == "both" else [args.gelu]
    qkvs = ["fused", "separate"] if args.qkv == "both" else [args.qkv]
    modes = list(dict.fromkeys(args.compile_mode)) if args.compile else ["default"]
    for side in args.sizes:
        for attention in args.attention:
            meanses = block_means_settings(args.means, variants[attention])
            vs = switch_settings(args.v, ("view", "copy"), variants[attention].v_view)
            combos = itertools.product(batches, gelus, meanses, vs, qkvs, modes)
            for batch, gelu, means, v, qkv, mode in combos:
                # class switches, read at trace time: set before compiling
                Mlp.fuse_inference_gelu, Attention.fuse_block_means = gelu == "fused", means == "prologue"
                Attention.view_v = v == "view"
                Attention.fuse_inference_qkv = qkv == "fused"
                label = means if variants[attention].block_means else "-"
                v_label = v if variants[attention].v_view else "-"
                try:
                    config = variants[attention].attention
                    rows.append(bench(args, attention, config, side, batch, gelu, label, v_label, mode, qkv))
                except torch.OutOfMemoryError:
                    oom = {"attention": attention, "size": f"{side}x{side}", "batch": "OOM", "GELU": gelu}
                    rows.append(oom | {"means": label, "v": v_label, "qkv": qkv, "mode": mode})
                    torch.cuda.empty_cache()
                finally:
                    Mlp.fuse_inference_gelu = Attention.fuse_block_means = Attention.view_v = True
                    Attention.fuse_inference_qkv = False
                print(rows[-1], file=sys.stderr, flush=True)
                if args.out:
                    write_files(args.out, command, settings, rows)
    print(f"\n{settings}\n")
    done = [r for r in rows if "images/s" in r]
    print(markdown(done) if done else "every setting ran out of memory")
    for side in args.sizes:
        size = f"{side}x{side}"
        batches_here = list(dict.fromkeys(r["batch"] for r in done if r["size"] == size))
        for batch in batches_here:
            same = [r for r in done if r["size"] == size and r["batch"] == batch]
            where = size if len(batches_here) == 1 else f"{size}, batch {batch}"
            speed = {variant(r): r["images/s"] for r in same}
            for row, twin in ab_pairs(same):
                print(f"{where} {variant(row)}: {row['images/s'] / twin['images/s']:.3f}x {variant(twin)}")
            if "full" in speed:
                others = [
                    f"{name} {value / speed['full']:.2f}x full" for name, value in speed.items() if name != "full"
                ]
                print(f"{where}: " + ", ".join(others))
        first = {}  # --batch A/B: each variant's rate against its first batch's
        for row in (r for r in done if r["size"] == size):
            base = first.setdefault(variant(row), row)
            if base is not row:
                ratio = row["images/s"] / base["images/s"]
                print(f"{size} {variant(row)}: batch {row['batch']} {ratio:.3f}x batch {base['batch']}")
    print(f"\ncommand: {command}")
    if args.out:
        print(f"wrote {args.out / 'bench_sampling.md'} and {args.out / 'bench_sampling.json'}")
        plot(rows, args.out / "bench_sampling.png")
    return rows


if __name__ == "__main__":
    main()
