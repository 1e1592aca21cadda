"""Registers pixdit's local GPU-pool launcher with Hydra (configs/hydra/launcher/local_gpus.yaml).

Hydra instantiates launchers only from modules of the ``hydra_plugins`` namespace package, which it scans at start-up;
pixdit installs this package into it (pyproject.toml), so ``pixdit-train -m ... hydra/launcher=local_gpus`` finds it
from any directory, and the sweep's worker processes can unpickle the launcher. The implementation and its
documentation are in src/pixdit/sweep.py.
"""

from pixdit.sweep import LocalGPUPool


class LocalGPUPoolLauncher(LocalGPUPool):
    """``hydra/launcher=local_gpus``: one job per GPU at a time (pixdit.sweep.LocalGPUPool)."""
