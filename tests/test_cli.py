"""The packaged entry points: console scripts installed, configs shipped inside the package (so ``pixdit-train`` works
from any directory). The root shims (train.py, scripts/*.py) are run by test_train, test_sweep, test_prepare and
test_eval_callback.

    .venv/bin/python -m pytest tests/test_cli.py
"""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "pixdit-train": "pixdit.cli.train:main",
    "pixdit-evaluate": "pixdit.cli.evaluate:main",
    "pixdit-prepare-data": "pixdit.cli.prepare_data:main",
    "pixdit-make-fid-stats": "pixdit.cli.make_fid_stats:main",
}


def test_console_scripts_are_installed_and_load():
    installed = {ep.name: ep for ep in entry_points(group="console_scripts") if ep.name.startswith("pixdit-")}
    assert {name: ep.value for name, ep in installed.items()} == COMMANDS
    for ep in installed.values():
        assert callable(ep.load())


def test_configs_are_package_data():
    """Every YAML file of configs/ is reachable through the package pixdit.configs (what Hydra's pkg:// reads)."""
    package = importlib.resources.files("pixdit.configs")
    in_repo = sorted(p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*.yaml"))
    assert in_repo and all(package.joinpath(name).is_file() for name in in_repo)


def test_pixdit_train_composes_from_another_directory(tmp_path):
    command = shutil.which("pixdit-train", path=str(Path(sys.executable).parent))
    assert command, "pixdit-train is not installed next to this Python"
    result = subprocess.run(
        [command, "experiment=quickstart", "trainer.max_steps=7", "--cfg", "job"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "name: quickstart" in result.stdout and "max_steps: 7" in result.stdout
    assert not any(tmp_path.iterdir())  # --cfg job runs nothing
