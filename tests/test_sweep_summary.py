"""scripts/summarize_sweep.py on a hand-made multirun directory whose right answers are known.

The directory mimics what Hydra + Lightning's CSVLogger + pixdit.sweep.SweepCallback write: per job
``.hydra/overrides.yaml``, ``csv/version_0/metrics.csv`` and ``status.json``; one job failed, one never finished.
"""

import csv
import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "summarize_sweep.py"


FIELDS = ["epoch", "step", "train/loss", "val/loss", "perf/images_per_s", "perf/tokens_per_s", "perf/peak_mem_gb"]


def make_job(
    root: Path, num: int, overrides: list[str], rows: list[dict] | None, status: dict | None, fields: list[str] = FIELDS
):
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if rows is not None:
        log_dir = job / "csv" / "version_0"
        log_dir.mkdir(parents=True)
        with open(log_dir / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    if status is not None:
        (job / "status.json").write_text(json.dumps(status))


def lightning_rows(val_losses, images_per_s, peak_mem):
    """Rows the way Lightning's CSVLogger writes them: one metric group per row, other cells empty."""
    rows = []
    for step, ips in enumerate(images_per_s):
        rows.append(
            {
                "epoch": 0,
                "step": 10 * step + 9,
                "train/loss": 1.0 / (step + 1),
                "perf/images_per_s": ips,
                "perf/tokens_per_s": ips * 1024,
                "perf/peak_mem_gb": peak_mem[step],
            }
        )
    for step, loss in enumerate(val_losses):
        rows.append({"epoch": 0, "step": 20 * step + 19, "val/loss": loss})
    return rows


def test_summary_table_and_plot(tmp_path):
    sweep = tmp_path / "multirun"
    common = ["experiment=quickstart", "trainer.max_steps=40"]
    make_job(
        sweep,
        0,
        common + ["attention.topk=4", "attention.block_size=16"],
        lightning_rows([0.9, 0.5], [10.0, 30.0, 32.0], [1.0, 2.5, 2.0]),
        {"status": "ok"},
    )
    make_job(
        sweep,
        1,
        common + ["attention.topk=8", "attention.block_size=16"],
        lightning_rows([0.8, 0.4], [20.0, 40.0, 44.0], [1.0, 1.5, 3.0]),
        {"status": "ok"},
    )
    make_job(
        sweep,
        2,
        common + ["attention.topk=4", "attention.block_size=32"],
        lightning_rows([], [5.0], [0.5]),
        {"status": "failed", "error": "RuntimeError: CUDA out of memory |x"},
    )
    make_job(sweep, 10, common + ["attention.topk=8", "attention.block_size=32"], None, None)
    # FID from the evaluation entry point wins over nothing logged.
    (sweep / "1" / "metrics.json").write_text(json.dumps({"fid": 12.5, "is_mean": 3.25, "note": "x"}))

    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(sweep), "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr

    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # Numeric job order (10 after 2), only the swept keys as parameter columns.
    assert [r["run"] for r in rows] == ["0", "1", "2", "10"]
    assert "experiment" not in rows[0] and "trainer.max_steps" not in rows[0]
    assert [(r["attention.topk"], r["attention.block_size"]) for r in rows] == [
        ("4", "16"),
        ("8", "16"),
        ("4", "32"),
        ("8", "32"),
    ]
    # Final validation loss = last logged value; throughput = median of windows; memory = max.
    assert float(rows[0]["val_loss"]) == 0.5 and float(rows[1]["val_loss"]) == 0.4
    assert float(rows[0]["images_per_s"]) == 30.0 and float(rows[1]["tokens_per_s"]) == 40.0 * 1024
    assert float(rows[0]["peak_mem_gb"]) == 2.5 and float(rows[1]["peak_mem_gb"]) == 3.0
    assert float(rows[1]["fid"]) == 12.5 and float(rows[1]["inception_score"]) == 3.25 and rows[0]["fid"] == ""
    assert rows[2]["val_loss"] == "" and float(rows[2]["images_per_s"]) == 5.0
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "incomplete"]
    assert "out of memory" in rows[2]["error"]

    markdown = (out / "summary.md").read_text()
    assert markdown.splitlines()[0].startswith("| run | attention.topk | attention.block_size | val_loss")
    assert "\\|x" in markdown  # a '|' in an error message must not break the markdown table
    png = (out / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_summary_rejects_a_directory_without_runs(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no Hydra job directories" in result.stderr


def test_fid_over_training_curves_and_best(tmp_path):
    """The FID callback's rows in metrics.csv (fid, is_mean at the evaluation steps, between training rows) become a
    curve per run and the table's last / best FID."""
    sweep = tmp_path / "multirun"
    fields = [*FIELDS, "fid", "is_mean", "is_std"]
    fids = {0: [(100, 80.0), (200, 41.5), (300, 44.0)], 1: [(100, 70.0), (200, 35.0), (300, 30.25)]}
    for job, curve in fids.items():
        rows = [{"epoch": 0, "step": step - 1, "train/loss": 0.5} for step, _ in curve]
        rows += [{"step": step, "fid": fid, "is_mean": 2.0, "is_std": 0.1} for step, fid in curve]
        make_job(sweep, job, ["attention=full" if job == 0 else "attention=llsa"], rows, {"status": "ok"}, fields)
    make_job(sweep, 2, ["attention=vsa"], [{"epoch": 0, "step": 9, "train/loss": 0.4}], {"status": "ok"}, fields)
    result = subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(sweep / "summary.csv", newline="") as f:
        rows = {r["attention"]: r for r in csv.DictReader(f)}
    assert float(rows["full"]["fid"]) == 44.0 and float(rows["full"]["fid_best"]) == 41.5  # last vs best
    assert int(rows["full"]["fid_best_step"]) == 200
    assert float(rows["llsa"]["fid"]) == 30.25 and float(rows["llsa"]["fid_best"]) == 30.25
    assert rows["vsa"]["fid_best"] == ""  # no FID logged: no curve, no best
    png = (sweep / "fid_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "fid_curves.png" in result.stdout


def test_steps_are_the_optimizer_steps_the_run_recorded(tmp_path):
    """Lightning logs optimizer step n's metrics at step n - 1, but the final validation after fit at step n: the
    largest logged step + 1 was one too many. pixdit-train records the steps in status.json."""
    sweep = tmp_path / "multirun"
    rows = [{"epoch": 0, "step": step, "train/loss": 1.0} for step in range(5)] + [
        {"epoch": 0, "step": 5, "val/loss": 0.5}
    ]
    make_job(sweep, 0, ["trainer.max_steps=5", "seed=0"], rows, {"status": "ok", "global_step": 5})
    make_job(sweep, 1, ["trainer.max_steps=5", "seed=1"], rows[:3], None)  # killed: estimated from the metrics
    result = subprocess.run([sys.executable, str(SCRIPT), str(sweep)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(sweep / "summary.csv", newline="") as f:
        assert [(r["steps"], r["status"]) for r in csv.DictReader(f)] == [("5", "ok"), ("3", "incomplete")]
