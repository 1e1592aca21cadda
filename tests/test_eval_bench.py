"""scripts/bench_sampling.py runs end to end (CPU smoke run; the real table is measured on a GPU)."""

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_sampling.py"


def test_bench_sampling_quick_cpu(capsys):
    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa", "llsa:num_levels=1,topk=2"])
    assert [r["attention"] for r in rows] == ["full", "llsa", "llsa:num_levels=1,topk=2"]
    assert all(r["images/s"] > 0 for r in rows)
    assert "| attention | size |" in capsys.readouterr().out


def test_bench_sampling_reports_a_bad_variant_before_timing(capsys):
    script = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit, match="--attention llsa:bogus=1: .*bogus"):
        script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa:bogus=1"])
    assert "images/s" not in capsys.readouterr().err  # nothing was timed, not even the valid variant
