"""``pixdit-prepare-data`` (= ``python scripts/prepare_data.py``): convert an image collection (FFHQ, ImageNet, any
folder / zip / parquet) into webdataset shards for training.

    python scripts/prepare_data.py --source ~/ffhq/images1024x1024 --out data/ffhq256 --resolution 256 --val 1000
    python scripts/prepare_data.py --source ~/imagenet/train --out data/imagenet256 --resolution 256 \\
        --labels folders --workers 16
    python scripts/prepare_data.py --source ~/imagenet/val --out data/imagenet256_val --resolution 256 --labels folders

Writes DIR/{train,val}-%06d.tar + DIR/manifest.json (+ classes.json). Re-run the same command to finish an
interrupted run: complete shards are kept. One run at a time per DIR (a second one exits with status 2, naming the
first). Details: docs/data.md and src/pixdit/data/prepare.py.
"""

import argparse

from pixdit.cli import fail
from pixdit.data.prepare import LABEL_MODES, prepare_dataset
from pixdit.data.shards import IMAGE_FORMATS
from pixdit.errors import PixditError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="folder of images (recursive), .zip, or folder of .parquet")
    parser.add_argument("--out", required=True, help="output directory for the shards")
    parser.add_argument("--resolution", type=int, required=True, help="output side in pixels (centre square)")
    parser.add_argument(
        "--labels",
        choices=LABEL_MODES,
        default="none",
        help="folders: class ids from sorted folder names (ImageNet synsets); default none",
    )
    parser.add_argument("--maxcount", type=int, default=1000, help="images per shard (default 1000)")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes (default 1)")
    parser.add_argument("--format", choices=IMAGE_FORMATS, default="png", help="png (lossless, default) or jpg")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality 1..100 for --format jpg (default 95)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N images of the sorted source")
    parser.add_argument("--val", type=int, default=0, help="hold out N images as a 'val' split (default 0)")
    args = parser.parse_args()
    try:
        manifest = prepare_dataset(
            args.source,
            args.out,
            args.resolution,
            labels=args.labels,
            maxcount=args.maxcount,
            workers=args.workers,
            image_format=args.format,
            quality=args.quality,
            limit=args.limit,
            val=args.val,
        )
    except PixditError as error:
        fail(str(error))
    counts = ", ".join(f"{split} {count}" for split, count in manifest["counts"].items())
    classes = f", {manifest['num_classes']} classes" if manifest["num_classes"] else ""
    print(
        f"wrote {args.out}: {counts} images at {args.resolution}x{args.resolution}{classes}; "
        f"{manifest['skipped_count']} source images skipped (listed above and in the manifest)"
    )


if __name__ == "__main__":
    main()
