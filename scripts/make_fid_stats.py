"""``python scripts/make_fid_stats.py ...`` runs ``pixdit-make-fid-stats ...`` (pixdit.cli.make_fid_stats; its docstring has the details)."""

import sys

from pixdit.cli.make_fid_stats import main

if __name__ == "__main__":
    sys.exit(main())
