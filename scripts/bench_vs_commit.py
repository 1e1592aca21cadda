"""This checkout against another commit, whole package: one table with the speed-up of every attention variant.

    git archive cfc45cc | tar -x -C bench/base        # the other version's source tree (any commit; mkdir first)
    python scripts/bench_vs_commit.py bench/base --out bench/vs -- \\
        --compile --attention full llsa:num_levels=2 vsa sla --sizes 256 --warmup 2 --steps 5
    python scripts/bench_vs_commit.py bench/base --bench sampling -- \\
        --attention llsa:num_levels=2 --sizes 256 --batch 32 --compile --warmup 1 --repeats 2
    python scripts/bench_vs_commit.py bench/base -- --device cpu --quick --attention llsa --sizes 16   # CPU check

Everything after ``--`` goes to ``scripts/bench_train.py`` (``--bench train``, the default) or
``scripts/bench_sampling.py`` (``--bench sampling``) of both versions, so use flags that both versions know.
``--kernels-from`` in those scripts swaps only the kernel library inside one process; this script compares whole
trees (model, attention glue, kernels, the bench script itself), so a change outside ``kernels/`` is measured too.

How: the other tree is installed into ``OUT/base/site`` (``pip install --no-deps --target``: no network, no build
isolation) and its own bench script runs with that folder first on PYTHONPATH. A probe process checks that it
imports ``pixdit`` and ``pixdit.kernels`` from there before anything is timed. This checkout's script runs with the
installed pixdit. Every ``--attention`` variant is one pair of processes, the other version first, then this one,
variant after variant, so slow drift of the GPU's clocks spreads over both. The rows are matched by what identifies
them (model, size, variant), and the table gives both versions' throughput, the ratio and peak memory. Files
in ``--out``: bench_vs_commit.md / .json, bench_vs_commit.png (the ratios as bars), and each run's own table under
``base/`` and ``head/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from pixdit.files import atomic_write, write_json
from pixdit.report import markdown_table

ROOT = Path(__file__).resolve().parents[1]
# per bench: its JSON file, the fields that identify a row, the throughput (higher is better) and the peak memory
BENCHES = {
    "train": ("bench_train.json", ("model", "side", "grad_ckpt", "variant"), "tokens_per_s", "peak_gb"),
    "sampling": ("bench_sampling.json", ("attention", "size", "GELU", "means"), "images/s", "peak GB"),
}
PROBE = "import pixdit, pixdit.kernels; print(pixdit.__file__); print(pixdit.kernels.__file__)"


def split_at_dashes(argv=None) -> tuple[list[str], list[str]]:
    """(this script's arguments, the ones after ``--`` for the other program); ``argv`` None: the command line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])


def check_base_tree(parser, base: Path, *needed: str) -> None:
    """Stop with one message unless ``base`` is a pixdit source tree holding pyproject.toml and ``needed``."""
    files = ("pyproject.toml", *needed)
    if not all((base / name).is_file() for name in files):
        parser.error(
            f"base {base} must be a pixdit source tree with {' and '.join(files)} "
            f"(e.g. mkdir -p {base} && git archive <commit> | tar -x -C {base})"
        )


def parse_args(argv=None):
    ours, bench_args = split_at_dashes(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the other version's source tree (git archive REV | tar -x -C DIR)")
    parser.add_argument("--bench", default="train", choices=list(BENCHES), help="scripts/bench_<BENCH>.py")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "vs_commit", help="folder for all results")
    args = parser.parse_args(ours)
    check_base_tree(parser, args.base, f"scripts/bench_{args.bench}.py")
    if "--out" in bench_args:
        parser.error("give --out before '--' (this script puts each run's files under it)")
    args.bench_args = bench_args
    return args


def split_variants(bench_args: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments without --attention, its variants); no --attention: one run with the script's default."""
    if "--attention" not in bench_args:
        return bench_args, []
    start = bench_args.index("--attention") + 1
    end = next((i for i in range(start, len(bench_args)) if bench_args[i].startswith("--")), len(bench_args))
    return bench_args[: start - 1] + bench_args[end:], bench_args[start:end]


def install_base(base: Path, site: Path) -> dict:
    """Install the base tree into ``site`` and return the environment that imports it first (checked)."""
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "--target", str(site), str(base)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    found = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    paths = found.stdout.split()
    if not paths or not all(Path(p).resolve().is_relative_to(site.resolve()) for p in paths):
        sys.exit(f"error: with {site} first on PYTHONPATH, pixdit still imports from {paths}: cannot time the base")
    print(f"# base: pixdit from {Path(paths[0]).parent}", flush=True)
    return env


def run_bench(script: Path, args: list[str], out: Path, env: dict) -> list[dict]:
    """One bench process; its rows (empty, with the return code printed, if it failed before writing any)."""
    command = [sys.executable, str(script), *args, "--out", str(out)]
    print("\n$ " + " ".join(command), flush=True)
    done = subprocess.run(command, env=env)
    json_file = out / BENCHES[script.stem.removeprefix("bench_")][0]
    if done.returncode != 0:
        print(f"# exit code {done.returncode}", flush=True)
    return json.loads(json_file.read_text())["rows"] if json_file.is_file() else []


def same_row(a: dict, b: dict, keys: tuple[str, ...]) -> bool:
    """Rows that measured the same thing: equal on every identifying field that both have (a field that only one
    version writes, e.g. a column added since, does not split them)."""
    return all(a[k] == b[k] for k in keys if k in a and k in b)


def compare(base_rows: list[dict], head_rows: list[dict], bench: str) -> list[dict]:
    _, keys, speed, memory = BENCHES[bench]
    table = []
    for head in head_rows:
        base = next((b for b in base_rows if same_row(b, head, keys)), None)
        row = {k: head[k] for k in keys if k in head}
        for name, source in (("base", base), ("head", head)):
            value = source.get(speed) if source else None
            row[name] = value if isinstance(value, (int, float)) else (source or {}).get("status", "-")
        both = isinstance(row["base"], (int, float)) and isinstance(row["head"], (int, float)) and row["base"] > 0
        row["head / base"] = row["head"] / row["base"] if both else "-"
        row["base GB"] = (base or {}).get(memory)
        row["head GB"] = head.get(memory)
        table.append(row)
    return table


def markdown(table: list[dict], bench: str) -> str:
    speed = BENCHES[bench][2]

    def cell(column, value):
        if value is None or (isinstance(value, float) and value != value):  # nan: no peak memory on the CPU
            return "-"
        if column == "head / base" and isinstance(value, float):
            return f"**{value:.3f}x**"
        if isinstance(value, float):
            return f"{value:,.1f}" if value > 1000 else f"{value:,.3f}"
        return str(value)

    columns = list(table[0])
    header = {"base": f"base {speed}", "head": f"head {speed}"}
    renamed = [{header.get(k, k): v for k, v in row.items()} for row in table]
    return markdown_table(renamed, [header.get(c, c) for c in columns], cell=cell)


def plot(table: list[dict], bench: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if isinstance(r["head / base"], float)]
    if not rows:
        return
    labels = [f"{r.get('variant') or r.get('attention')}, {r.get('side') or r.get('size')}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.6))
    ax.bar(range(len(rows)), [r["head / base"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{BENCHES[bench][2]}: head / base")
    ax.set_title("this checkout / the base tree", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    common, variants = split_variants(args.bench_args)
    args.out.mkdir(parents=True, exist_ok=True)
    base_env = install_base(args.base, args.out / "base" / "site")
    scripts = {
        "base": args.base / "scripts" / f"bench_{args.bench}.py",
        "head": ROOT / "scripts" / f"bench_{args.bench}.py",
    }
    envs = {"base": base_env, "head": dict(os.environ)}
    rows = {"base": [], "head": []}
    for i, variant in enumerate(variants or [None]):
        run_args = common + (["--attention", variant] if variant else [])
        for version in ("base", "head"):
            rows[version] += run_bench(scripts[version], run_args, args.out / version / str(i), envs[version])
    table = compare(rows["base"], rows["head"], args.bench)
    command = "python scripts/bench_vs_commit.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    text = markdown(table, args.bench) if table else "no row of this checkout was measured"
    print(f"\n{device}, base tree {args.base}\n\n{text}\n\ncommand: {command}")
    with atomic_write(args.out / "bench_vs_commit.md", "w") as f:
        f.write(f"```\n{command}\n```\n\n{device}, base tree {args.base}\n\n{text}\n")
    write_json(args.out / "bench_vs_commit.json", {"command": command, "device": device, "rows": table, **rows})
    plot(table, args.bench, args.out / "bench_vs_commit.png")
    print(f"wrote {args.out / 'bench_vs_commit.md'}, .json and .png")
    return table


if __name__ == "__main__":
    main()
