"""scripts/loss_vs_commit.py: the table and the verdict from the runs' losses, and its argument checks. The training
processes are replaced by a stand-in (a real CPU run of both trees takes ~50 s: the script's docstring has the
command); the base tree's installation is scripts/bench_vs_commit.py's, tested there."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the script imports its neighbours
    import loss_vs_commit

    return loss_vs_commit


def test_verdict_compares_the_difference_with_the_seed_spread(script):
    runs = {
        "base": {0: {"val_loss": 0.50}, 1: {"val_loss": 0.52}},
        "head": {0: {"val_loss": 0.51}, 1: {"val_loss": 0.52}},
    }
    within = script.verdict(runs, "val_loss")
    assert within["head - base"] == pytest.approx(0.005) and within["seed spread"] == pytest.approx(0.02)
    assert within["within noise"] == "yes"
    runs["head"] = {0: {"val_loss": 0.60}, 1: {"val_loss": 0.61}}
    assert script.verdict(runs, "val_loss")["within noise"] == "no"
    runs["head"][1] = {"status": "failed"}  # a run without a loss gives no verdict, not a false "yes"
    assert script.verdict(runs, "val_loss")["within noise"] == "no result (a run logged no loss)"


def test_main_runs_every_seed_with_both_versions(script, monkeypatch, tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "pyproject.toml").write_text("")
    calls = []

    def fake_train(overrides, seed, run_dir, env, log=None):
        assert log is None  # one job at a time: the output stays on the console
        calls.append((run_dir.parent.name, seed, tuple(overrides), env))
        head = run_dir.parent.name == "head"
        return {"val_loss": 0.5 + 0.01 * seed + (0.001 if head else 0.0), "val_loss_ema": 0.4, "status": "ok"}

    monkeypatch.setattr(script, "install_base", lambda base, site: {"PYTHONPATH": str(site)})
    monkeypatch.setattr(script, "train", fake_train)
    out = tmp_path / "out"
    verdicts = script.main([str(tmp_path / "base"), "--seeds", "0", "1", "--out", str(out), "--", "trainer=cpu"])
    assert [(v, s) for v, s, _, _ in calls] == [("base", 0), ("head", 0), ("base", 1), ("head", 1)]
    assert all(o == ("trainer=cpu",) for _, _, o, _ in calls)
    assert calls[0][3] == {"PYTHONPATH": str(out / "base" / "site")} and calls[1][3] is None  # head: this checkout
    assert verdicts[0]["within noise"] == "yes" and verdicts[0]["head - base"] == pytest.approx(0.001)
    saved = json.loads((out / "loss_vs_commit.json").read_text())
    assert saved["rows"][1]["head val_loss"] == pytest.approx(0.511)
    assert "| val_loss | 0.50500 | 0.50600 | 0.00100 | 0.01000 | yes |" in (out / "loss_vs_commit.md").read_text()


def test_jobs_run_side_by_side_each_with_its_own_log(script, monkeypatch, tmp_path):
    """--jobs 2: every (seed, version) still runs once, each writing to train.log in its run directory; the table
    is the one of a serial run."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "pyproject.toml").write_text("")
    logs = {}

    def fake_train(overrides, seed, run_dir, env, log=None):
        logs[(run_dir.parent.name, seed)] = log
        return {"val_loss": 0.5 + 0.01 * seed, "val_loss_ema": 0.4, "status": "ok"}

    monkeypatch.setattr(script, "install_base", lambda base, site: {"PYTHONPATH": str(site)})
    monkeypatch.setattr(script, "train", fake_train)
    out = tmp_path / "out"
    verdicts = script.main([str(tmp_path / "base"), "--seeds", "0", "1", "--jobs", "2", "--out", str(out), "--", "x=1"])
    assert logs == {(v, s): out / v / f"seed{s}" / "train.log" for v in ("base", "head") for s in (0, 1)}
    assert verdicts[0]["head - base"] == pytest.approx(0.0) and verdicts[0]["within noise"] == "yes"


def test_a_failed_run_prints_the_end_of_its_log(script, monkeypatch, tmp_path, capsys):
    """A run that fails while its output goes to a log: the exit code and the log's last lines (the error) are
    printed, so that the reason needs no second look (a remote machine may not return nested run folders)."""
    import subprocess

    def failing_run(command, env, cwd, stdout, stderr):
        stdout.write("".join(f"line {i}\n" for i in range(30)) + "RuntimeError: boom\n")
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(script.subprocess, "run", failing_run)
    run_dir = tmp_path / "head" / "seed0"
    script.train(["x=1"], 0, run_dir, None, log=run_dir / "train.log")
    out = capsys.readouterr().out
    assert f"# exit code 1, output in {run_dir / 'train.log'}" in out
    assert "#   RuntimeError: boom" in out and "#   line 16" in out and "line 15" not in out


def test_bad_arguments_are_named(script, tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text("")
    for argv, message in [
        ([str(tmp_path / "nothing")], "must be a pixdit source tree with pyproject.toml"),
        ([str(tmp_path), "--seeds", "3"], "--seeds needs at least two different seeds"),
        ([str(tmp_path), "--", "seed=4"], "seed=4: this script sets seed and hydra.run.dir per run"),
        ([str(tmp_path), "--jobs", "0"], "--jobs is the number of training processes at once (>= 1), got 0"),
    ]:
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err
