"""``python scripts/evaluate.py ...`` runs ``pixdit-evaluate ...`` (pixdit.cli.evaluate; its docstring has the details)."""

import sys

from pixdit.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
