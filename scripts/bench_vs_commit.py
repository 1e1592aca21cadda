"""This checkout against other commits, whole package: one table with the speed-up of every attention variant.

    git archive cfc45cc | tar -x -C bench/base        # the other version's source tree (any commit; mkdir first)
    python scripts/bench_vs_commit.py bench/base --out bench/vs -- \\
        --compile --attention full llsa:num_levels=2 vsa sla --sizes 256 --warmup 2 --steps 5
    python scripts/bench_vs_commit.py bench/main bench/step1 bench/step2 -- \\
        --compile --attention llsa:num_levels=2 --sizes 256 --warmup 2 --steps 5   # stacked changes, one call
    python scripts/bench_vs_commit.py bench/base --bench sampling -- \\
        --attention llsa:num_levels=2 --sizes 256 --batch 32 --compile --warmup 1 --repeats 2
    python scripts/bench_vs_commit.py bench/base -- --device cpu --quick --attention llsa --sizes 16   # CPU check

Everything after ``--`` goes to ``scripts/bench_train.py`` (``--bench train``, the default) or
``scripts/bench_sampling.py`` (``--bench sampling``) of both versions, so use flags that both versions know.
``--kernels-from`` in those scripts swaps only the kernel library inside one process; this script compares whole
trees (model, attention glue, kernels, the bench script itself), so a change outside ``kernels/`` is measured too.

Several trees: give them in the order the changes stack (e.g. main, then each branch that builds on the one
before, this checkout last); the table gives each version's throughput, the ratio of each to the one before it and
this checkout's to the first, so one device call says which step of a stack paid. With one tree it is called
``base`` and the ratio ``head / base``; with several each is named by its folder.

How: each other tree is installed into ``OUT/<name>/site`` (``pip install --no-deps --target``: no network, no
build isolation) and its own bench script runs with that folder first on PYTHONPATH. A probe process checks that it
imports ``pixdit`` and ``pixdit.kernels`` from there before anything is timed. This checkout's script runs with the
installed pixdit. Every ``--attention`` variant is one process per version, the trees in the order given, then this
checkout, variant after variant, so slow drift of the GPU's clocks spreads over all of them. The rows are matched by
what identifies them (model, size, variant), and the table gives every version's throughput, the ratios and peak
memory. Files in ``--out``: bench_vs_commit.md / .json, bench_vs_commit.png (the ratios as bars), and each run's own
table under ``<name>/`` and ``head/``.
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
    parser.add_argument(
        "trees",
        type=Path,
        nargs="+",
        metavar="TREE",
        help="the other versions' source trees (git archive REV | tar -x -C DIR), oldest first",
    )
    parser.add_argument("--bench", default="train", choices=list(BENCHES), help="scripts/bench_<BENCH>.py")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "vs_commit", help="folder for all results")
    args = parser.parse_args(ours)
    for tree in args.trees:
        check_base_tree(parser, tree, f"scripts/bench_{args.bench}.py")
    args.names = version_names(parser, args.trees)
    if "--out" in bench_args:
        parser.error("give --out before '--' (this script puts each run's files under it)")
    args.bench_args = bench_args
    return args


def version_names(parser, trees: list[Path]) -> list[str]:
    """One name per tree for the table's columns and the output folders: ``base`` when there is one, else each
    tree's folder name, which must then differ from the others' and from ``head`` (this checkout)."""
    if len(trees) == 1:
        return ["base"]
    names = [tree.resolve().name for tree in trees]
    if len(set(names)) < len(names) or "head" in names:
        parser.error(
            f"trees {' '.join(map(str, trees))}: with several trees each folder name names a column, so they must "
            "differ and none may be 'head' (e.g. git archive REV | tar -x -C bench/<short name of REV>)"
        )
    return names


def split_variants(bench_args: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments without --attention, its variants); no --attention: one run with the script's default."""
    if "--attention" not in bench_args:
        return bench_args, []
    start = bench_args.index("--attention") + 1
    end = next((i for i in range(start, len(bench_args)) if bench_args[i].startswith("--")), len(bench_args))
    return bench_args[: start - 1] + bench_args[end:], bench_args[start:end]


def install_base(base: Path, site: Path, name: str = "base") -> dict:
    """Install the tree ``base`` into ``site`` and return the environment that imports it first (checked)."""
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*command, "--target", str(site), str(base)], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    found = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    paths = found.stdout.split()
    if not paths or not all(Path(p).resolve().is_relative_to(site.resolve()) for p in paths):
        sys.exit(f"error: with {site} first on PYTHONPATH, pixdit still imports from {paths}: cannot time {name}")
    print(f"# {name}: pixdit from {Path(paths[0]).parent}", flush=True)
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


def ratio_columns(names: list[str]) -> list[tuple[str, str]]:
    """(newer, older) pairs: each version against the one before it, and with three or more, the last (this
    checkout) against the first."""
    pairs = list(zip(names[1:], names[:-1]))
    return pairs + ([(names[-1], names[0])] if len(names) > 2 else [])


def compare(rows: dict[str, list[dict]], bench: str) -> list[dict]:
    """One row per row of this checkout (``rows["head"]``, the last version): every version's throughput (its
    status where it has no number), the ratios of ``ratio_columns`` and every version's peak memory."""
    _, keys, speed, memory = BENCHES[bench]
    names = list(rows)
    table = []
    for head in rows["head"]:
        found = {name: next((r for r in rows[name] if same_row(r, head, keys)), None) for name in names}
        row = {k: head[k] for k in keys if k in head}
        for name, source in found.items():
            value = source.get(speed) if source else None
            row[name] = value if isinstance(value, (int, float)) else (source or {}).get("status", "-")
        for new, old in ratio_columns(names):
            both = all(isinstance(row[n], (int, float)) for n in (new, old)) and row[old] > 0
            row[f"{new} / {old}"] = row[new] / row[old] if both else "-"
        for name, source in found.items():
            row[f"{name} GB"] = (source or {}).get(memory)
        table.append(row)
    return table


def markdown(table: list[dict], names: list[str], bench: str) -> str:
    speed = BENCHES[bench][2]
    ratios = {f"{new} / {old}" for new, old in ratio_columns(names)}

    def cell(column, value):
        if value is None or (isinstance(value, float) and value != value):  # nan: no peak memory on the CPU
            return "-"
        if column in ratios and isinstance(value, float):
            return f"**{value:.3f}x**"
        if isinstance(value, float):
            return f"{value:,.1f}" if value > 1000 else f"{value:,.3f}"
        return str(value)

    header = {name: f"{name} {speed}" for name in names}
    renamed = [{header.get(k, k): v for k, v in row.items()} for row in table]
    return markdown_table(renamed, [header.get(c, c) for c in table[0]], cell=cell)


def plot(table: list[dict], names: list[str], bench: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [f"{new} / {old}" for new, old in ratio_columns(names)]
    rows = [r for r in table if any(isinstance(r[c], float) for c in ratios)]
    if not rows:
        return
    labels = [f"{r.get('variant') or r.get('attention')}, {r.get('side') or r.get('size')}" for r in rows]
    width = 0.8 / len(ratios)
    fig, ax = plt.subplots(figsize=(max(4.0, (0.5 + 0.4 * len(ratios)) * len(rows) + 2), 3.6))
    values = {c: [r[c] if isinstance(r[c], float) else 1.0 for r in rows] for c in ratios}
    for j, column in enumerate(ratios):  # bars from 1.0, so a few percent either way is visible
        x = [i + (j - (len(ratios) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(x, [v - 1.0 for v in values[column]], width, bottom=1.0, label=column)
    spread = max(abs(v - 1.0) for column in values.values() for v in column)
    ax.set_ylim(1.0 - 1.3 * max(spread, 0.02), 1.0 + 1.3 * max(spread, 0.02))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{BENCHES[bench][2]}: ratio")
    ax.legend(fontsize=8)
    ax.set_title("newer / older version (head: this checkout)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    common, variants = split_variants(args.bench_args)
    args.out.mkdir(parents=True, exist_ok=True)
    scripts, envs = {}, {}
    for name, tree in zip(args.names, args.trees):
        envs[name] = install_base(tree, args.out / name / "site", name)
        scripts[name] = tree / "scripts" / f"bench_{args.bench}.py"
    scripts["head"], envs["head"] = ROOT / "scripts" / f"bench_{args.bench}.py", dict(os.environ)
    rows = {name: [] for name in scripts}
    for i, variant in enumerate(variants or [None]):
        run_args = common + (["--attention", variant] if variant else [])
        for name in scripts:
            rows[name] += run_bench(scripts[name], run_args, args.out / name / str(i), envs[name])
    table = compare(rows, args.bench)
    command = "python scripts/bench_vs_commit.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    names = list(scripts)
    text = markdown(table, names, args.bench) if table else "no row of this checkout was measured"
    trees = ", ".join(f"{name} = {tree}" for name, tree in zip(args.names, args.trees))
    print(f"\n{device}, {trees}\n\n{text}\n\ncommand: {command}")
    with atomic_write(args.out / "bench_vs_commit.md", "w") as f:
        f.write(f"```\n{command}\n```\n\n{device}, {trees}\n\n{text}\n")
    write_json(
        args.out / "bench_vs_commit.json",
        {
            "command": command,
            "device": device,
            "trees": dict(zip(args.names, map(str, args.trees))),
            "rows": table,
            **rows,
        },
    )
    plot(table, names, args.bench, args.out / "bench_vs_commit.png")
    print(f"wrote {args.out / 'bench_vs_commit.md'}, .json and .png")
    return table


if __name__ == "__main__":
    main()
