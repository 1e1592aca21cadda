"""``python scripts/prepare_data.py ...`` runs ``pixdit-prepare-data ...`` (pixdit.cli.prepare_data; its docstring has the details)."""

import sys

from pixdit.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
