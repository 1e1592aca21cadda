"""Does DDP scale, and what does FSDP cost? 1 GPU with per-GPU batch 2b against 2 GPUs with per-GPU batch b (same
global batch, same steps), and DDP against FSDP on 2 GPUs: loss curves, validation loss, images/s and peak memory,
through train.py exactly as users run it.

    python scripts/bench_scaling.py --out bench/scaling                      # needs 2 GPUs; ~5 min on H200s
    python scripts/bench_scaling.py --out bench/scaling --noise-run          # + a 1-GPU run with another seed: the
                                                                             #   run-to-run noise to judge "matches" by
    python scripts/bench_scaling.py --out bench/s256 --resolution 256 --per-gpu-batch 4 --noise-run \\
        -- attention=llsa attention.num_levels=2                             # 256^2 pixels (quickstart crops at 256)
    python scripts/bench_scaling.py --out bench/fsdp --runs 2gpu 2gpu_fsdp --resolution 256 --model dit_xl \\
        --per-gpu-batch 8 -- attention=llsa +model.num_heads=18 model.grad_checkpointing=true   # DDP vs FSDP
    python scripts/bench_scaling.py --out /tmp/s --cpu --steps 4 --per-gpu-batch 2 -- +model.depth=1
                                                                             # plumbing check on a CPU (gloo)

Runs (``--runs``; each a `python train.py ...` in its own directory under --out, log in <run>.log):
  1gpu:       trainer=gpu data.batch_size=2b
  2gpu:       trainer=ddp trainer.devices=2 data.batch_size=b
  2gpu_fsdp:  trainer=fsdp trainer.devices=2 data.batch_size=b
  1gpu_seed1: as 1gpu with seed=1 (also added by --noise-run)
Default: 1gpu 2gpu. On --experiment (default quickstart: the bundled data, built with scripts/make_quickstart_data.py
if missing; with --resolution R other than 32, quickstart crops at R x R are built into data/quickstart_R) with
--model (default dit_s at patch size 1: 1024 tokens per 32x32 image). Anything after `--` is passed to every run.

Writes --out/scaling.md (table + commands), scaling.json and scaling.png (training loss, smoothed, and validation
loss against step). images/s is the global rate (all GPUs), the median of the throughput monitor's windows; peak GB
is rank 0's torch.cuda.max_memory_allocated (GiB).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


RUNS = ("1gpu", "2gpu", "2gpu_fsdp", "1gpu_seed1")


def gpus_needed(runs) -> int:
    """GPUs the chosen runs need: 2 for any 2-GPU run, else 1 (``--runs 1gpu`` times train.py on one GPU)."""
    return 2 if any(name.startswith("2gpu") for name in runs) else 1


def data_overrides(args) -> list[str]:
    """The quickstart data at --resolution (built if missing); nothing for other experiments or resolution 32."""
    if args.experiment != "quickstart" or any(o.startswith("data.root=") for o in args.extra):
        return []
    root = REPO / "data" / ("quickstart" if args.resolution == 32 else f"quickstart_{args.resolution}")
    if not (root / "manifest.json").is_file():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "make_quickstart_data.py"),
                "--out",
                str(root),
                "--resolution",
                str(args.resolution),
                *(["--train", "1024", "--val", "64"] if args.resolution > 32 else []),
            ],
            check=True,
        )
    return [] if args.resolution == 32 else [f"data.root={root}", f"data.resolution={args.resolution}"]


def run_commands(args, data: list[str] | None = None) -> dict[str, list[str]]:
    b = args.per_gpu_batch
    common = [
        f"experiment={args.experiment}",
        f"model={args.model}",
        "model.patch_size=1",
        *(data or []),
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={max(1, args.steps // args.val_points)}",
        f"trainer.log_every_n_steps={min(10, args.throughput_window)}",
        f"callbacks.throughput.window={args.throughput_window}",
        "callbacks.samples=null",
        "callbacks.checkpoint=null",
        f"data.num_workers={args.num_workers}",
    ]
    cpu = ["trainer.accelerator=cpu", "trainer.precision=32-true"] if args.cpu else []
    single = ["trainer=cpu"] if args.cpu else ["trainer=gpu"]
    runs = {
        "1gpu": [*common, *single, f"data.batch_size={2 * b}", "seed=0"],
        "2gpu": [*common, "trainer=ddp", *cpu, "trainer.devices=2", f"data.batch_size={b}", "seed=0"],
        "2gpu_fsdp": [*common, "trainer=fsdp", *cpu, "trainer.devices=2", f"data.batch_size={b}", "seed=0"],
        "1gpu_seed1": [*common, *single, f"data.batch_size={2 * b}", "seed=1"],
    }
    chosen = list(dict.fromkeys([*args.runs, *(["1gpu_seed1"] if args.noise_run else [])]))
    return {name: [*runs[name], *args.extra, f"hydra.run.dir={args.out / name}"] for name in chosen}


def read_columns(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv -> column -> [(step, value)]."""
    columns: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, text in row.items():
                if key not in ("step", "epoch") and text not in (None, ""):
                    columns.setdefault(key, []).append((step, float(text)))
    return columns


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def steady_median(points: list[tuple[int, float]]) -> float | None:
    """Median of the throughput windows after the first (which includes start-up and CUDA warm-up)."""
    values = [v for _, v in points]
    return statistics.median(values[1:] or values) if values else None


def summarize(name: str, run_dir: Path, seconds: float) -> dict:
    columns = read_columns(run_dir / "metrics.csv")
    train = columns.get("train/loss", [])
    tail = [v for _, v in train[-max(1, len(train) // 5) :]]
    return {
        "run": name,
        "final_val_loss": columns["val/loss"][-1][1] if "val/loss" in columns else None,
        "final_val_loss_ema": columns["val/loss_ema"][-1][1] if "val/loss_ema" in columns else None,
        "train_loss_last20pct": statistics.fmean(tail) if tail else None,
        "images_per_s": steady_median(columns.get("perf/images_per_s", [])),
        "tokens_per_s": steady_median(columns.get("perf/tokens_per_s", [])),
        "peak_mem_gb": max((v for _, v in columns.get("perf/peak_mem_gb", [])), default=None),
        "wall_s": round(seconds, 1),
        "curves": {k: columns.get(k, []) for k in ("train/loss", "val/loss")},
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [s for s, _ in r["curves"]["train/loss"]]
        ax_train.plot(steps, smooth([v for _, v in r["curves"]["train/loss"]], 10), label=r["run"])
        val = r["curves"]["val/loss"]
        ax_val.plot([s for s, _ in val], [v for _, v in val], marker="o", label=r["run"])
    ax_train.set(xlabel="step", ylabel="training loss (moving average of 10 logs)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss (fixed noise)", title="validation loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(value, spec=".4g") -> str:
    return "-" if value is None else format(value, spec)


def report(results: list[dict], commands: dict[str, list[str]], args) -> str:
    by_name = {r["run"]: r for r in results}
    one, two, fsdp = by_name.get("1gpu"), by_name.get("2gpu"), by_name.get("2gpu_fsdp")
    extra = f", {' '.join(args.extra)}" if args.extra else ""
    lines = [
        f"# {', '.join(by_name)}: per-GPU batch {args.per_gpu_batch} on 2 GPUs, {2 * args.per_gpu_batch} on 1",
        "",
        f"{args.steps} steps, experiment={args.experiment}, model={args.model} (patch 1), "
        f"{args.resolution}x{args.resolution}{extra}; {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "| run | final val loss | final val loss (EMA) | train loss (last 20%) | images/s | tokens/s | peak GB | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['run']} | {fmt(r['final_val_loss'])} | {fmt(r['final_val_loss_ema'])} | "
            f"{fmt(r['train_loss_last20pct'])} | {fmt(r['images_per_s'], ',.0f')} | "
            f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['peak_mem_gb'], '.2f')} | {r['wall_s']} |"
        )
    lines.append("")
    if one and two and one["images_per_s"] and two["images_per_s"]:
        speedup = two["images_per_s"] / one["images_per_s"]
        lines.append(f"Speed-up 2 GPUs / 1 GPU: {speedup:.2f}x (scaling efficiency {speedup / 2:.0%}).")
    if two and fsdp and two["images_per_s"] and fsdp["images_per_s"]:
        memory = ""
        if two["peak_mem_gb"] and fsdp["peak_mem_gb"]:
            memory = f"; peak memory FSDP {fsdp['peak_mem_gb']:.1f} vs DDP {two['peak_mem_gb']:.1f} GB per GPU"
        lines.append(f"FSDP / DDP images/s on 2 GPUs: {fsdp['images_per_s'] / two['images_per_s']:.2f}x{memory}.")
    if one and two and one["final_val_loss"] is not None and two["final_val_loss"] is not None:
        gap = abs(two["final_val_loss"] - one["final_val_loss"])
        line = f"Validation loss gap 2 GPUs vs 1 GPU: {gap:.4f}"
        if "1gpu_seed1" in by_name and by_name["1gpu_seed1"]["final_val_loss"] is not None:
            noise = abs(by_name["1gpu_seed1"]["final_val_loss"] - one["final_val_loss"])
            line += f"; run-to-run noise (1 GPU, seed 0 vs 1): {noise:.4f}"
        lines.append(line + ".")
    lines += ["", "Commands:", ""]
    lines += [f"    python train.py {' '.join(c)}" for c in commands.values()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/scaling"))
    parser.add_argument("--experiment", default="quickstart")
    parser.add_argument("--model", default="dit_s")
    parser.add_argument("--per-gpu-batch", type=int, default=64, help="b: per-GPU batch of the 2-GPU run")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--val-points", type=int, default=4, help="validations per run")
    parser.add_argument("--throughput-window", type=int, default=50)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--noise-run", action="store_true", help="add a 1-GPU run with seed=1 (run-to-run noise)")
    parser.add_argument("--runs", nargs="+", default=["1gpu", "2gpu"], choices=RUNS, help="which runs (see above)")
    parser.add_argument("--resolution", type=int, default=32, help="image side of the quickstart data (built)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo) instead of GPUs: a plumbing check")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    if not args.cpu:
        import torch

        needed = gpus_needed(args.runs)
        if torch.cuda.device_count() < needed:
            print(
                f"error: --runs {' '.join(args.runs)} needs {needed} GPU(s), found {torch.cuda.device_count()} "
                "(use --runs 1gpu on one GPU, or --cpu for a plumbing check)",
                file=sys.stderr,
            )
            return 2
    commands = run_commands(args, data_overrides(args))
    results = []
    for name, overrides in commands.items():
        print(f"[{name}] python train.py {' '.join(overrides)}", flush=True)
        start = time.perf_counter()
        with open(args.out / f"{name}.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, str(REPO / "train.py"), *overrides],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"error: run {name} failed (exit {proc.returncode}); see {args.out / f'{name}.log'}", file=sys.stderr)
            return 1
        results.append(summarize(name, args.out / name, seconds))
        print(
            f"[{name}] done in {seconds:.0f} s: val loss {fmt(results[-1]['final_val_loss'])}, "
            f"{fmt(results[-1]['images_per_s'], ',.0f')} images/s",
            flush=True,
        )

    markdown = report(results, commands, args)
    (args.out / "scaling.md").write_text(markdown)
    (args.out / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "scaling.png")
    print(markdown)
    print(f"wrote {args.out / 'scaling.md'}, scaling.json, scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
