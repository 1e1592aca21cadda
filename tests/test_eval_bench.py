"""scripts/bench_sampling.py runs end to end (CPU smoke run; the real table is measured on a GPU)."""

import importlib.util
from pathlib import Path


def test_bench_sampling_quick_cpu(capsys):
    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_sampling.py"
    spec = importlib.util.spec_from_file_location("bench_sampling", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.main(["--device", "cpu", "--quick", "--attention", "full", "llsa"])
    assert [r["attention"] for r in rows] == ["full", "llsa"] and all(r["images/s"] > 0 for r in rows)
    assert "| attention | size |" in capsys.readouterr().out
