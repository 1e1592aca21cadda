"""pixdit's command-line entry points, installed as console scripts (pyproject.toml ``[project.scripts]``):

    pixdit-train            pixdit.cli.train           (also: python train.py ...)
    pixdit-evaluate         pixdit.cli.evaluate        (also: python scripts/evaluate.py ..., torchrun ...)
    pixdit-prepare-data     pixdit.cli.prepare_data    (also: python scripts/prepare_data.py ...)
    pixdit-make-fid-stats   pixdit.cli.make_fid_stats  (also: python scripts/make_fid_stats.py ...)

The files at the repository root (train.py, scripts/*.py) only call these ``main()`` functions, so the commands in
the README work from a checkout and from an installed pixdit alike. A user mistake (``PixditError``) ends a command
with one line on stderr (``fail``), never a traceback.
"""

from __future__ import annotations

import sys


def fail(message: str, status: int = 2) -> None:
    """Print ``error: message`` on stderr and exit with ``status`` (2: a usage error, as argparse and Hydra use)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
