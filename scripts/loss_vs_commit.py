"""Validation loss of this checkout against another commit's whole tree: the same short training run, several seeds.

A change meant to be numerically neutral (a faster kernel, a fused op, another launch configuration) must leave the
validation loss of a short run where it was, within the seed-to-seed spread. This script runs the run with both
versions and says whether it did.

    mkdir -p bench/base && git archive <commit> | tar -x -C bench/base     # the other version's source tree
    python scripts/make_quickstart_data.py --out data/crops64 --resolution 64
    python scripts/loss_vs_commit.py bench/base --seeds 0 1 --out bench/loss_vs -- \\
        experiment=quickstart model=dit_s model.patch_size=1 attention=llsa optimizer.lr=1e-4 \\
        data.root=data/crops64 data.resolution=64 trainer.max_steps=700 trainer.val_check_interval=700
    python scripts/loss_vs_commit.py bench/base -- experiment=quickstart trainer=cpu model=dit_t \\
        +model.hidden_size=32 +model.depth=1 +model.num_heads=2 trainer.max_steps=2 trainer.val_check_interval=2 \\
        callbacks.samples=null                                               # a CPU check of the script, ~1 minute

Everything after ``--`` is Hydra overrides of ``pixdit-train`` for both versions (use keys both versions know). Each
(seed, version) is one process, ``python -m pixdit.cli.train <overrides> seed=S hydra.run.dir=OUT/<version>/seed<S>``,
the seeds in order and the base first for each (``--jobs N``: N at once); the base tree is installed on the side as in
``scripts/bench_vs_commit.py`` (``install_base``). The final ``val/loss`` and ``val/loss_ema`` come from each run's
CSV log (``summarize_sweep.summarize_run``). The verdict compares the mean difference of the two versions with the
seed-to-seed spread inside each version (the largest minus the smallest loss of a version over the seeds): within
noise when the difference is at most that spread. Files in ``--out``: loss_vs_commit.md / .json and every run's
directory.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_vs_commit import check_base_tree, install_base, split_at_dashes
from summarize_sweep import summarize_run

from pixdit.files import atomic_write, write_json
from pixdit.report import markdown_table

ROOT = Path(__file__).resolve().parents[1]
LOSSES = ("val_loss", "val_loss_ema")  # summarize_run's names of val/loss and val/loss_ema
FAILED_LOG_LINES = 15  # lines of a failed run's log printed with its exit code


def parse_args(argv=None):
    ours, overrides = split_at_dashes(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the other version's source tree (git archive REV | tar -x -C DIR)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="one run per seed and version (>= 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "loss_vs_commit", help="folder for all results")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="training processes at once (short runs spend most of their time starting and compiling, so several "
        "share one GPU well); with more than one, each writes its output to train.log in its run directory",
    )
    args = parser.parse_args(ours)
    if args.jobs < 1:
        parser.error(f"--jobs is the number of training processes at once (>= 1), got {args.jobs}")
    check_base_tree(parser, args.base)
    if len(set(args.seeds)) < 2:
        parser.error(f"--seeds needs at least two different seeds (the noise to compare with), got {args.seeds}")
    taken = [o for o in overrides if o.split("=")[0].lstrip("+~") in ("seed", "hydra.run.dir")]
    if taken:
        parser.error(f"{' '.join(taken)}: this script sets seed and hydra.run.dir per run; drop them after '--'")
    args.overrides = overrides
    args.out = args.out.resolve()  # the runs' hydra.run.dir, whatever their working directory
    return args


def train(overrides: list[str], seed: int, run_dir: Path, env: dict | None, log: Path | None = None) -> dict:
    """One training process; its losses and status (``summarize_run``), the exit code printed if it failed. ``log``:
    a file for its output instead of this process's."""
    command = [sys.executable, "-m", "pixdit.cli.train", *overrides, f"seed={seed}", f"hydra.run.dir={run_dir}"]
    print("\n$ " + " ".join(command) + (f" > {log}" if log else ""), flush=True)
    if log is None:
        done = subprocess.run(command, env=env, cwd=ROOT)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            done = subprocess.run(command, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        print(f"# exit code {done.returncode}" + (f", output in {log}" if log else ""), flush=True)
        if log is not None:  # the error itself, so that a failed run needs no second look
            tail = log.read_text(errors="replace").splitlines()[-FAILED_LOG_LINES:]
            print("\n".join(f"#   {line[:300]}" for line in tail), flush=True)
    return summarize_run(run_dir)


def verdict(runs: dict[str, dict[int, dict]], loss: str) -> dict:
    """Mean loss per version, their difference, the seed-to-seed spread inside each version, within noise or not."""
    values = {v: [r[loss] for r in runs[v].values() if loss in r] for v in ("base", "head")}
    if any(len(vals) < 2 for vals in values.values()):
        return {"loss": loss, "within noise": "no result (a run logged no loss)"}
    means = {v: statistics.fmean(vals) for v, vals in values.items()}
    spread = max(max(vals) - min(vals) for vals in values.values())
    difference = means["head"] - means["base"]
    return {
        "loss": loss,
        "base mean": means["base"],
        "head mean": means["head"],
        "head - base": difference,
        "seed spread": spread,
        "within noise": "yes" if abs(difference) <= spread else "no",
    }


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    envs = {"base": install_base(args.base, args.out / "base" / "site"), "head": None}
    runs: dict[str, dict[int, dict]] = {"base": {}, "head": {}}

    def one(seed: int, version: str) -> None:
        run_dir = args.out / version / f"seed{seed}"
        run = train(args.overrides, seed, run_dir, envs[version], log=run_dir / "train.log" if args.jobs > 1 else None)
        runs[version][seed] = run
        # each run's losses as it ends, in full: a call cut short by a time limit keeps the finished ones
        print(f"# {version} seed {seed}: " + ", ".join(f"{k} {run[k]:.5f}" for k in LOSSES if k in run), flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # in order: seeds ascending, the base first for each
        for done in [pool.submit(one, seed, version) for seed in args.seeds for version in ("base", "head")]:
            done.result()  # re-raises a job's exception
    rows = []
    for seed in args.seeds:
        row = {"seed": seed}
        for version in ("base", "head"):
            for loss in LOSSES:
                row[f"{version} {loss}"] = runs[version][seed].get(loss, runs[version][seed].get("status"))
        rows.append(row)
    verdicts = [verdict(runs, loss) for loss in LOSSES]

    def cell(column, value):
        return f"{value:.5f}" if isinstance(value, float) else str(value)

    command = "python scripts/loss_vs_commit.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = f"{markdown_table(rows, cell=cell)}\n\n{markdown_table(verdicts, cell=cell)}"
    print(f"\nbase tree {args.base}\n\n{text}\n\ncommand: {command}")
    with atomic_write(args.out / "loss_vs_commit.md", "w") as f:
        f.write(f"```\n{command}\n```\n\nbase tree {args.base}\n\n{text}\n")
    write_json(args.out / "loss_vs_commit.json", {"command": command, "rows": rows, "verdicts": verdicts})
    print(f"wrote {args.out / 'loss_vs_commit.md'} and .json")
    return verdicts


if __name__ == "__main__":
    main()
