"""Does DDP scale? 1 GPU with per-GPU batch 2b against 2 GPUs with per-GPU batch b (same global batch, same steps):
loss curves, validation loss and images/s, through train.py exactly as users run it.

    python scripts/bench_scaling.py --out bench/scaling                      # needs 2 GPUs; ~5 min on H200s
    python scripts/bench_scaling.py --out bench/scaling --noise-run          # + a 1-GPU run with another seed: the
                                                                             #   run-to-run noise to judge "matches" by
    python scripts/bench_scaling.py --out /tmp/s --cpu --steps 4 --per-gpu-batch 2 -- +model.depth=1
                                                                             # plumbing check on a CPU (gloo)

Runs (each a `python train.py ...` in its own directory under --out, log in <run>.log):
  1gpu:  trainer=gpu data.batch_size=2b
  2gpu:  trainer=ddp trainer.devices=2 data.batch_size=b
  [1gpu_seed1: as 1gpu with seed=1]
on --experiment (default quickstart: the bundled data, built with scripts/make_quickstart_data.py if missing) with
--model (default dit_s at patch size 1: 1024 tokens per 32x32 image). Anything after `--` is passed to every run.

Writes --out/scaling.md (table + commands), scaling.json and scaling.png (training loss, smoothed, and validation
loss against step). images/s is the global rate (all GPUs), the median of the throughput monitor's windows.
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


def run_commands(args) -> dict[str, list[str]]:
    b = args.per_gpu_batch
    common = [f"experiment={args.experiment}", f"model={args.model}", "model.patch_size=1",
              f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={max(1, args.steps // args.val_points)}",
              f"trainer.log_every_n_steps={min(10, args.throughput_window)}",
              f"callbacks.throughput.window={args.throughput_window}",
              "callbacks.samples=null", "callbacks.checkpoint=null", f"data.num_workers={args.num_workers}"]
    if args.cpu:
        single = ["trainer=cpu"]
        double = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true"]
    else:
        single = ["trainer=gpu"]
        double = ["trainer=ddp"]
    runs = {
        "1gpu": [*common, *single, f"data.batch_size={2 * b}", "seed=0"],
        "2gpu": [*common, *double, "trainer.devices=2", f"data.batch_size={b}", "seed=0"],
    }
    if args.noise_run:
        runs["1gpu_seed1"] = [*common, *single, f"data.batch_size={2 * b}", "seed=1"]
    return {name: [*overrides, *args.extra, f"hydra.run.dir={args.out / name}"] for name, overrides in runs.items()}


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
    tail = [v for _, v in train[-max(1, len(train) // 5):]]
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
    one, two = by_name["1gpu"], by_name["2gpu"]
    lines = [f"# DDP scaling: 1 GPU x batch {2 * args.per_gpu_batch} vs 2 GPUs x batch {args.per_gpu_batch}", "",
             f"{args.steps} steps, experiment={args.experiment}, model={args.model} (patch 1); "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             "| run | final val loss | final val loss (EMA) | train loss (last 20%) | images/s | tokens/s | peak GB | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {fmt(r['final_val_loss'])} | {fmt(r['final_val_loss_ema'])} | "
                     f"{fmt(r['train_loss_last20pct'])} | {fmt(r['images_per_s'], ',.0f')} | "
                     f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['peak_mem_gb'], '.2f')} | {r['wall_s']} |")
    lines.append("")
    if one["images_per_s"] and two["images_per_s"]:
        speedup = two["images_per_s"] / one["images_per_s"]
        lines.append(f"Speed-up 2 GPUs / 1 GPU: {speedup:.2f}x (scaling efficiency {speedup / 2:.0%}).")
    if one["final_val_loss"] is not None and two["final_val_loss"] is not None:
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
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo) instead of GPUs: a plumbing check")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"error: needs 2 GPUs, found {torch.cuda.device_count()} (use --cpu for a plumbing check)",
                  file=sys.stderr)
            return 2
    quickstart_data = REPO / "data" / "quickstart" / "manifest.json"
    if args.experiment == "quickstart" and not any(o.startswith("data.root=") for o in args.extra) \
            and not quickstart_data.is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_quickstart_data.py"), "--out",
                        str(quickstart_data.parent)], check=True)
    commands = run_commands(args)
    results = []
    for name, overrides in commands.items():
        print(f"[{name}] python train.py {' '.join(overrides)}", flush=True)
        start = time.perf_counter()
        with open(args.out / f"{name}.log", "w") as log:
            proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"error: run {name} failed (exit {proc.returncode}); see {args.out / f'{name}.log'}", file=sys.stderr)
            return 1
        results.append(summarize(name, args.out / name, seconds))
        print(f"[{name}] done in {seconds:.0f} s: val loss {fmt(results[-1]['final_val_loss'])}, "
              f"{fmt(results[-1]['images_per_s'], ',.0f')} images/s", flush=True)

    markdown = report(results, commands, args)
    (args.out / "scaling.md").write_text(markdown)
    (args.out / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "scaling.png")
    print(markdown)
    print(f"wrote {args.out / 'scaling.md'}, scaling.json, scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
