#!/usr/bin/env python
"""Build the bundled demo dataset (random 32x32 crops of scikit-image's sample photographs) as webdataset shards.

    python scripts/make_quickstart_data.py --out data/quickstart

Deterministic (same arguments -> byte-identical shards), no downloads, a few seconds. `make train` runs it when
data/quickstart/manifest.json is missing. See pixdit/data/quickstart.py for how the crops are made.
"""

import argparse
import sys
import time

from pixdit.data.quickstart import make_quickstart_dataset
from pixdit.errors import PixditError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/quickstart", help="output directory (default: data/quickstart)")
    parser.add_argument("--train", type=int, default=4096, help="number of training images (default 4096)")
    parser.add_argument("--val", type=int, default=256, help="number of held-out validation images (default 256)")
    parser.add_argument("--resolution", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="crop seed (default 0)")
    args = parser.parse_args()
    start = time.time()
    try:
        manifest = make_quickstart_dataset(
            args.out, train_count=args.train, val_count=args.val, resolution=args.resolution, seed=args.seed
        )
    except PixditError as error:
        sys.exit(f"error: {error}")
    counts = ", ".join(f"{split} {count}" for split, count in manifest["counts"].items())
    print(f"wrote {args.out}: {counts} images at {args.resolution}x{args.resolution} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
