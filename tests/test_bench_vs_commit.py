"""scripts/bench_vs_commit.py on CPU: another tree installed on the side and timed against this checkout, the rows
matched into one table. The other tree here is this commit's own (git archive HEAD), so the check needs git."""

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
    tree = tmp_path_factory.mktemp("base")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def test_bench_vs_commit_times_both_trees_and_matches_their_rows(base_tree, tmp_path, capsys):
    out = tmp_path / "vs"
    script = runpy.run_path(str(SCRIPT))
    table = script["main"](
        [str(base_tree), "--out", str(out), "--", "--device", "cpu", "--quick", "--sizes", "16", "--attention", "llsa"]
    )
    printed = capsys.readouterr().out
    assert f"# base: pixdit from {out / 'base' / 'site' / 'pixdit'}" in printed  # the probe: not the installed one
    assert len(table) == 1 and table[0]["variant"] == "llsa" and table[0]["side"] == 16
    assert table[0]["base"] > 0 and table[0]["head"] > 0
    assert table[0]["head / base"] == pytest.approx(table[0]["head"] / table[0]["base"])
    assert (out / "base" / "0" / "bench_train.json").is_file() and (out / "head" / "0" / "bench_train.json").is_file()
    assert "head / base" in (out / "bench_vs_commit.md").read_text()
    assert (out / "bench_vs_commit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_vs_commit_names_what_is_wrong(base_tree, tmp_path, capsys):
    script = runpy.run_path(str(SCRIPT))
    with pytest.raises(SystemExit):
        script["main"]([str(tmp_path), "--", "--quick"])
    assert f"base {tmp_path} must be a pixdit source tree with pyproject.toml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script["main"]([str(base_tree), "--", "--quick", "--out", str(tmp_path)])
    assert "give --out before '--'" in capsys.readouterr().err


def test_split_variants():
    split = runpy.run_path(str(SCRIPT))["split_variants"]
    assert split(["--compile", "--attention", "full", "llsa:num_levels=2", "--sizes", "256"]) == (
        ["--compile", "--sizes", "256"],
        ["full", "llsa:num_levels=2"],
    )
    assert split(["--sizes", "16"]) == (["--sizes", "16"], [])
