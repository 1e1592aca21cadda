"""One table and one plot for a Hydra multirun (a sweep over K/B/L, backends, resolutions, ...).

    python scripts/summarize_sweep.py multirun/2026-11-30/12-00-00
    python scripts/summarize_sweep.py multirun/2026-11-30/12-00-00 --out reports/llsa_grid

Writes into ``--out`` (default: the multirun directory itself)

* ``summary.md``  - a markdown table, one row per run (also printed),
* ``summary.csv`` - the same table as CSV,
* ``summary.png`` - every metric against every swept parameter (one panel each; one line per setting of the other
  swept parameters; failed runs are left out of the plot and marked in the tables),
* ``fid_curves.png`` - FID against the training step, one line per run, when the FID callback logged FID during
  training (``callbacks.fid.every_n_train_steps``); the tables then also hold each run's best logged FID and its step.

A run is any directory below MULTIRUN_DIR that holds ``.hydra/overrides.yaml`` (Hydra saves it when the job starts).
Per run it reads:

* the swept values: the overrides whose value differs between runs (``.hydra/overrides.yaml``);
* Lightning's CSV logger output (``metrics.csv`` anywhere below the run directory; the newest one if several):
  final validation loss of the weights and of the EMA weights (``val/loss``, ``val/loss_ema``), training throughput (median of ``perf/images_per_s`` and
  ``perf/tokens_per_s``: the median ignores the slow first window), peak memory (max of ``perf/peak_mem_gb``),
  FID / IS (last logged value) when the evaluation callback logged them, and the lowest logged FID
  (``fid_best``) with its step (``fid_best_step``);
* ``metrics.json`` below the run directory (written by scripts/evaluate.py), whose ``fid`` / ``is_mean`` keys take
  precedence over logged values (several files: the last in path order wins);
* ``status.json`` in the run directory, written by pixdit-train when the run ends (``pixdit.rundir.write_status``):
  ``ok``, ``failed`` (plus the error), ``preempted`` or ``interrupted``, and the optimizer steps done (the ``steps``
  column). A run without it is ``incomplete`` (still running, or killed before it could record the end: out of
  memory, time limit).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

import yaml

from pixdit.files import atomic_write
from pixdit.report import markdown_table

# Each reported metric: table column -> (regular expressions tried in order against the CSV/JSON keys, reduction).
# The names are the ones the pixdit module / callbacks log (src/pixdit/module.py, callbacks.py, eval/); the
# alternatives keep older runs readable.
METRICS: dict[str, tuple[tuple[str, ...], str]] = {
    "val_loss": ((r"^val/loss$", r"^val_loss$"), "last"),
    "val_loss_ema": ((r"^val/loss_ema$",), "last"),
    "fid": ((r"^fid$", r"^(val|eval)/fid$", r"fid"), "last"),
    "inception_score": ((r"^is_mean$", r"^inception_score$", r"^(val|eval)/is(_mean)?$", r"^is$"), "last"),
    "images_per_s": ((r"^perf/images_per_s$", r"images_per_s"), "median"),
    "tokens_per_s": ((r"^perf/tokens_per_s$", r"tokens_per_s"), "median"),
    "peak_mem_gb": ((r"^perf/peak_mem_gb$", r"peak_mem"), "max"),
}


def find_runs(multirun_dir: Path) -> list[Path]:
    """Every job directory below ``multirun_dir`` (the ones Hydra gave a ``.hydra/overrides.yaml``), in job order."""
    runs = [p.parent.parent for p in multirun_dir.rglob(".hydra/overrides.yaml")]

    def job_order(run: Path):
        # Hydra names job dirs by job number ("0", "1", ..., "10"): sort numerically where possible.
        rel = run.relative_to(multirun_dir).parts
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel]

    return sorted(runs, key=job_order)


def read_overrides(run: Path) -> dict[str, str]:
    """``key=value`` overrides of one job as a dict (``+key``/``~key`` prefixes kept in the key)."""
    items = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
    out = {}
    for item in items:
        key, _, value = str(item).partition("=")
        out[key] = value
    return out


def read_metrics_csv(run: Path) -> dict[str, list[float]]:
    """Column -> the numeric values logged in it, in order, from the newest ``metrics.csv`` below ``run``."""
    files = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    columns: dict[str, list[float]] = {}
    with open(files[-1], newline="") as f:
        for row in csv.DictReader(f):
            for key, text in row.items():
                if key is None or text in (None, ""):
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                if math.isfinite(value):
                    columns.setdefault(key, []).append(value)
    return columns


def read_curve(run: Path, column: str) -> list[tuple[int, float]]:
    """(step, value) of every row of the newest ``metrics.csv`` below ``run`` that logged ``column``, in step order."""
    files = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    points = []
    with open(files[-1], newline="") as f:
        for row in csv.DictReader(f):
            try:
                step, value = int(float(row.get("step") or "")), float(row.get(column) or "")
            except ValueError:
                continue
            if math.isfinite(value):
                points.append((step, value))
    return sorted(points)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def reduce_metric(values: list[float], how: str) -> float:
    if how == "last":
        return values[-1]
    if how == "max":
        return max(values)
    if how == "median":
        return statistics.median(values)
    raise ValueError(f"unknown reduction {how!r}")


def pick(keys, patterns: tuple[str, ...]) -> str | None:
    """The first key matching the first pattern that matches any key (pattern order = preference)."""
    for pattern in patterns:
        for key in keys:
            if re.search(pattern, key):
                return key
    return None


def summarize_run(run: Path) -> dict:
    """Metrics and status of one run (missing metrics are absent from the dict)."""
    logged = read_metrics_csv(run)
    metrics_json = {}
    for path in sorted(run.rglob("metrics.json")):
        metrics_json.update({k: v for k, v in read_json(path).items() if isinstance(v, (int, float))})
    row: dict = {}
    for name, (patterns, how) in METRICS.items():
        json_key = pick(metrics_json, patterns)
        if json_key is not None:
            row[name] = float(metrics_json[json_key])
            continue
        column = pick(logged, patterns)
        if column is not None:
            row[name] = reduce_metric(logged[column], how)
    curve = read_curve(run, "fid")
    if curve:
        best_step, best = min(curve, key=lambda point: (point[1], point[0]))
        row["fid_best"], row["fid_best_step"] = best, best_step
    status = read_json(run / "status.json")
    if isinstance(status.get("global_step"), int):
        row["steps"] = status["global_step"]  # optimizer steps done, recorded by pixdit-train when the run ended
    elif "step" in logged:
        # A run without that record (still running, killed): Lightning logs the metrics of optimizer step n (1-based)
        # at step n - 1, so the largest logged step + 1 (an estimate: the final validation is logged at step n).
        row["steps"] = int(max(logged["step"])) + 1
    row["status"] = status.get("status", "incomplete")
    if status.get("error"):
        row["error"] = " ".join(str(status["error"]).split())[:200]
    return row


def build_table(multirun_dir: Path) -> tuple[list[str], list[str], list[dict]]:
    """(swept parameter names, column names, rows) for every run below ``multirun_dir``."""
    runs = find_runs(multirun_dir)
    if not runs:
        raise SystemExit(f"error: no Hydra job directories (with .hydra/overrides.yaml) below {multirun_dir}")
    overrides = [read_overrides(run) for run in runs]
    all_keys = list(dict.fromkeys(k for o in overrides for k in o))
    # Swept = any override whose value is not the same in every run (also a key present in some runs only).
    swept = [k for k in all_keys if len({o.get(k) for o in overrides}) > 1]
    rows = []
    for run, o in zip(runs, overrides):
        row = {"run": str(run.relative_to(multirun_dir))}
        row.update({k: o.get(k, "") for k in swept})
        row.update(summarize_run(run))
        rows.append(row)
    metric_columns = [m for m in [*METRICS, "fid_best", "fid_best_step", "steps"] if any(m in r for r in rows)]
    columns = ["run", *swept, *metric_columns, "status"]
    if any("error" in r for r in rows):
        columns.append("error")
    return swept, columns, rows


def format_cell(value) -> str:
    if isinstance(value, float):
        if abs(value) >= 1e4:
            return f"{value:,.0f}"  # tokens/s: 493,000 reads better than 4.93e+05
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def to_markdown(columns: list[str], rows: list[dict]) -> str:
    return markdown_table(rows, columns, cell=lambda column, value: format_cell(value)) + "\n"


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with atomic_write(path, "w") as f:  # a reader (a dashboard, the next summary) never sees half a table
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def as_number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def plot(path: Path, swept: list[str], metric_columns: list[str], rows: list[dict]) -> bool:
    """Grid of panels: one row per metric, one column per swept parameter. Returns False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok_rows = [r for r in rows if r["status"] == "ok"] or rows
    metrics = [m for m in metric_columns if any(m in r for r in ok_rows)]
    params = swept or ["run"]
    if not metrics:
        return False
    fig, axes = plt.subplots(len(metrics), len(params), figsize=(4.5 * len(params), 3.2 * len(metrics)), squeeze=False)
    for j, param in enumerate(params):
        values = list(dict.fromkeys(r[param] for r in ok_rows))
        numeric = all(as_number(v) is not None for v in values)
        # Numeric values on a numeric axis (log2 for powers of two such as K and B); others as categories.
        order = sorted(values, key=lambda v: (as_number(v), v) if numeric else v)
        position = {v: (as_number(v) if numeric else i) for i, v in enumerate(order)}
        others = [p for p in swept if p != param]
        for i, metric in enumerate(metrics):
            ax = axes[i][j]
            series: dict[str, list[tuple[float, float]]] = {}
            for r in ok_rows:
                if metric in r:
                    label = ", ".join(f"{p}={r[p]}" for p in others) or metric
                    series.setdefault(label, []).append((position[r[param]], r[metric]))
            for label, points in series.items():
                points.sort()
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            if numeric and all(v > 0 and math.log2(v).is_integer() for v in map(as_number, order)) and len(order) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks([position[v] for v in order], order, rotation=0 if numeric else 30)
            ax.set_xlabel(param)
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            if 1 < len(series) <= 12 and i == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_fid_curves(path: Path, multirun_dir: Path, swept: list[str], rows: list[dict]) -> bool:
    """FID against the training step, one line per run (label: its swept values). False if no run logged FID."""
    curves = [(row, read_curve(multirun_dir / row["run"], "fid")) for row in rows]
    curves = [(row, points) for row, points in curves if points]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, points in curves:
        label = ", ".join(f"{p}={row[p]}" for p in swept) or row["run"]
        if row["status"] != "ok":
            label += f" ({row['status']})"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("FID (training-time callback)")
    ax.grid(alpha=0.3)
    if len(curves) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "multirun_dir", type=Path, help="the sweep directory (hydra.sweep.dir), e.g. multirun/DATE/TIME"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write summary.{md,csv,png} (default: multirun_dir)"
    )
    args = parser.parse_args(argv)
    if not args.multirun_dir.is_dir():
        raise SystemExit(f"error: multirun_dir {args.multirun_dir} is not a directory")
    out = args.out or args.multirun_dir
    out.mkdir(parents=True, exist_ok=True)

    swept, columns, rows = build_table(args.multirun_dir)
    markdown = to_markdown(columns, rows)
    with atomic_write(out / "summary.md", "w") as f:
        f.write(markdown)
    write_csv(out / "summary.csv", columns, rows)
    metric_columns = [c for c in columns if c in METRICS]
    plotted = plot(out / "summary.png", swept, metric_columns, rows)
    curves = plot_fid_curves(out / "fid_curves.png", args.multirun_dir, swept, rows)
    print(markdown)
    failed = sum(r["status"] != "ok" for r in rows)
    print(
        f"{len(rows)} runs ({failed} not ok); wrote {out / 'summary.md'}, {out / 'summary.csv'}"
        + (f", {out / 'summary.png'}" if plotted else " (no metrics to plot)")
        + (f", {out / 'fid_curves.png'}" if curves else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
