"""scripts/bench_vs_commit.py on CPU: other trees installed on the side and timed against this checkout, the rows
matched into one table. The other trees here are this commit's own (git archive HEAD), so the check needs git."""

import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_vs_commit.py"


@pytest.fixture(scope="module")
def base_tree(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a clone to export a commit's tree")
    tree = tmp_path_factory.mktemp("trees") / "main"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def test_bench_vs_commit_times_every_tree_and_matches_their_rows(base_tree, tmp_path, capsys):
    """Two other trees (a stack: main, then a branch on it) and this checkout: one table, each version's ratio to
    the one before it and this checkout's to the first."""
    step = shutil.copytree(base_tree, base_tree.parent / "step")
    out = tmp_path / "vs"
    script = runpy.run_path(str(SCRIPT))
    table = script["main"](
        [str(base_tree), str(step), "--out", str(out), "--"]
        + ["--device", "cpu", "--quick", "--sizes", "16", "--attention", "llsa"]
    )
    printed = capsys.readouterr().out
    for name in ("main", "step"):  # the probe: each tree imports its own copy, not the installed one
        assert f"# {name}: pixdit from {out / name / 'site' / 'pixdit'}" in printed
        assert (out / name / "0" / "bench_train.json").is_file()
    assert (out / "head" / "0" / "bench_train.json").is_file()
    assert len(table) == 1 and table[0]["variant"] == "llsa" and table[0]["side"] == 16
    row = table[0]
    assert row["main"] > 0 and row["step"] > 0 and row["head"] > 0
    assert row["step / main"] == pytest.approx(row["step"] / row["main"])
    assert row["head / step"] == pytest.approx(row["head"] / row["step"])
    assert row["head / main"] == pytest.approx(row["head"] / row["main"])
    text = (out / "bench_vs_commit.md").read_text()
    assert "main tokens_per_s" in text and "head / step" in text and f"step = {step}" in text
    assert (out / "bench_vs_commit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_tree_is_the_base_and_a_missing_row_keeps_its_status():
    script = runpy.run_path(str(SCRIPT))
    rows = {
        "base": [{"model": "DiT-S", "side": 16, "variant": "llsa", "tokens_per_s": 100.0, "peak_gb": 1.0}],
        "head": [
            {"model": "DiT-S", "side": 16, "variant": "llsa", "tokens_per_s": 125.0, "peak_gb": 1.5},
            {"model": "DiT-S", "side": 32, "variant": "llsa", "status": "out of memory"},
        ],
    }
    table = script["compare"](rows, "train")
    assert list(table[0]) == ["model", "side", "variant", "base", "head", "head / base", "base GB", "head GB"]
    assert table[0]["head / base"] == 1.25 and table[0]["head GB"] == 1.5
    assert table[1]["base"] == "-" and table[1]["head"] == "out of memory" and table[1]["head / base"] == "-"
    text = script["markdown"](table, ["base", "head"], "train")
    assert "**1.250x**" in text and "base tokens_per_s" in text


def test_bench_vs_commit_names_what_is_wrong(base_tree, tmp_path, capsys):
    script = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit):
        script["main"]([str(tmp_path), "--", "--quick"])
    assert f"base {tmp_path} must be a pixdit source tree with pyproject.toml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script["main"]([str(base_tree), "--", "--quick", "--out", str(tmp_path)])
    assert "give --out before '--'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # two trees in folders of one name: their columns could not be told apart
        script["main"]([str(base_tree), str(base_tree), "--", "--quick"])
    assert "each folder name names a column, so they must differ" in capsys.readouterr().err


def test_split_variants():
    split = runpy.run_path(str(SCRIPT))["split_variants"]
    assert split(["--compile", "--attention", "full", "llsa:num_levels=2", "--sizes", "256"]) == (
        ["--compile", "--sizes", "256"],
        ["full", "llsa:num_levels=2"],
    )
    assert split(["--sizes", "16"]) == (["--sizes", "16"], [])
