"""scripts/bench_sampling.py runs end to end (CPU smoke run; the real table is measured on a GPU)."""

import runpy
from pathlib import Path


def test_bench_sampling_quick_cpu(capsys):
    script = runpy.run_path(str(Path(__file__).resolve().parent.parent / "scripts" / "bench_sampling.py"))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa"])
    assert [r["attention"] for r in rows] == ["full", "llsa"] and all(r["images/s"] > 0 for r in rows)
    assert "| attention | size |" in capsys.readouterr().out
