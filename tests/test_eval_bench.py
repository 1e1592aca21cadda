"""scripts/bench_sampling.py runs end to end (CPU smoke run; the real table is measured on a GPU)."""

import json
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
    assert "images/s" not in capsys.readouterr().out  # nothing was timed, not even the valid variant


def test_bench_sampling_writes_its_files_and_the_cost_of_50k_samples(tmp_path, capsys):
    script = runpy.run_path(str(SCRIPT))
    out = tmp_path / "sampling"
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa", "--out", str(out)])
    for row in rows:  # hours of one device for the 50,000 samples of an FID, from the measured rate
        assert row["50k h"] == pytest.approx(50_000 / row["images/s"] / 3600)
    table = (out / "bench_sampling.md").read_text()
    assert "--out" in table and "| attention | size |" in table and "50k h" in table
    saved = json.loads((out / "bench_sampling.json").read_text())
    assert [r["attention"] for r in saved["rows"]] == ["full", "llsa"] and "50k h" in saved["settings"]
    assert (out / "bench_sampling.png").stat().st_size > 0


def test_bench_sampling_gelu_both_times_each_variant_twice_and_restores_the_switch(capsys):
    from pixdit.models.dit import Mlp

    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa", "--gelu", "both"])
    assert [r["attention"] for r in rows] == ["full", "full", "llsa", "llsa"]
    assert {r["GELU"] for r in rows} == {"separate"}  # the fused call exists on CUDA only
    assert Mlp.fuse_inference_gelu is True


def test_bench_sampling_means_both_times_prologue_and_backend_pooling_and_restores_the_switch(capsys, monkeypatch):
    from pixdit.models.dit import Attention

    seen = []
    forward = Attention.forward

    def spy(self, *args, **kwargs):
        seen.append(self.fuse_block_means)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "forward", spy)
    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "llsa", "--means", "both"])
    assert [(r["attention"], r["means"]) for r in rows] == [("llsa", "prologue"), ("llsa", "backend")]
    assert True in seen and False in seen and Attention.fuse_block_means is True
    assert "16x16 llsa (separate GELU): " in capsys.readouterr().out  # the A/B line: prologue / backend


def test_bench_sampling_v_both_times_the_view_and_the_copy_and_restores_the_switch(capsys, monkeypatch):
    """--v both: LLSA (which reads v in place) runs once with v as a view of qkv and once copied; full attention,
    which does not, once."""
    from pixdit.models.dit import Attention

    seen = []
    forward = Attention.forward

    def spy(self, *args, **kwargs):
        seen.append(self.view_v)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "forward", spy)
    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "full", "llsa", "--v", "both"])
    assert [(r["attention"], r["v"]) for r in rows] == [("full", "-"), ("llsa", "view"), ("llsa", "copy")]
    assert True in seen and False in seen and Attention.view_v is True
    assert "16x16 llsa (separate GELU): " in capsys.readouterr().out  # the A/B line: view / copy


def test_bench_sampling_profile_groups_the_batch_by_kind_of_kernel(capsys):
    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "llsa", "--profile"])
    parts = {row["part"]: row for row in rows[0]["profile"]}
    assert "matmul" in parts and all(row["ms"] >= 0 for row in parts.values())
    assert sum(row["share %"] for row in parts.values()) == pytest.approx(100)
    assert parts["matmul"]["ms per image-step"] == pytest.approx(parts["matmul"]["ms"] / (2 * 2))  # 2 images, 2 steps
    captured = capsys.readouterr()
    assert "time by kind of kernel" in captured.err
    header = next(line for line in captured.out.splitlines() if line.startswith("| attention | size |"))
    assert "profile" not in header  # a table of its own, not a column of the results table


def test_bench_sampling_compile_modes_time_one_row_per_mode(capsys):
    script = runpy.run_path(str(SCRIPT))
    seen = []
    globals_ = script["main"].__globals__  # the functions' own globals (run_path returns a copy)
    real = globals_["sampling_model"]

    def spy(model, device, compile, mode=None):
        seen.append((compile, mode))
        return real(model, device, compile, mode)

    globals_["sampling_model"] = spy
    argv = ["--device", "cpu", "--quick", "--attention", "llsa", "--compile"]
    rows = script["main"]([*argv, "--compile-mode", "default", "max-autotune-no-cudagraphs"])
    assert seen == [(True, "default"), (True, "max-autotune-no-cudagraphs")]
    assert [r["mode"] for r in rows] == ["-", "-"]  # CPU: nothing is compiled, and the rows say so
    with pytest.raises(SystemExit):
        script["main"]([*argv, "--compile-mode", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


def test_bench_sampling_times_several_batches_in_one_process(capsys):
    script = runpy.run_path(str(SCRIPT))
    rows = script["main"](["--device", "cpu", "--quick", "--attention", "llsa", "--batch", "1", "3"])
    assert [r["batch"] for r in rows] == [1, 3]
    assert "llsa (separate GELU): batch 3 " in capsys.readouterr().out  # the ratio to the first batch's row


def test_bench_sampling_rejects_a_bad_batch_before_timing(capsys):
    script = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit, match="--batch 4 0: each value must be a positive int or auto"):
        script["main"](["--device", "cpu", "--batch", "4", "0"])
    assert "images/s" not in capsys.readouterr().out  # no row was timed (the table goes to stdout)
