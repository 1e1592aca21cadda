#!/usr/bin/env python
"""Data-loader throughput: images/s per worker at 128/256/512 px, on synthetic shards this script builds.

    python scripts/bench_data.py                                  # 128, 256, 512 px, png, 0 and 2 workers
    python scripts/bench_data.py --resolutions 256 --workers 0 4 8 --format jpg

For every resolution it writes photo-like synthetic images (smooth colour fields plus grain, so PNG sizes are close
to real photographs: see the bytes/image column) as shards in a temporary folder, then times ShardDataModule's
training stream (tar read, decode, flip, conversion to float [-1, 1], batching), first in the main process
(= one worker's throughput), then with DataLoader workers. The loader keeps up with a GPU when
    images/s per worker x data.num_workers  >  training images/s per GPU   (docs/benchmarks.md).
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pixdit.data.datamodule import ShardDataModule
from pixdit.data.imageops import encode_image
from pixdit.data.shards import ShardWriter, write_manifest


def synthetic_photo(rng: np.random.Generator, resolution: int) -> np.ndarray:
    """Smooth random colour field (bicubic upsampled 8x8) + gaussian grain: compresses like a photograph."""
    coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((resolution, resolution), Image.BICUBIC), dtype=np.float32)
    grain = rng.normal(0.0, 6.0, smooth.shape)
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def build_shards(root: Path, resolution: int, count: int, image_format: str) -> float:
    """Write `count` synthetic images as shards; returns the mean encoded bytes per image."""
    rng = np.random.default_rng(resolution)
    total_bytes = 0
    with ShardWriter(root, "train", maxcount=max(1, count // 8)) as writer:
        for i in range(count):
            data = encode_image(synthetic_photo(rng, resolution), image_format, quality=95)
            total_bytes += len(data)
            writer.write(f"{i:08d}", data, image_format)
    write_manifest(
        root,
        resolution=resolution,
        image_format=image_format,
        splits={"train": writer.split_info()},
        source="bench_data.py synthetic",
    )
    return total_bytes / count


def images_per_second(root: Path, num_workers: int, batch_size: int, epoch_images: int) -> float:
    dm = ShardDataModule(
        root,
        batch_size=batch_size,
        num_workers=num_workers,
        epoch_images=epoch_images,
        shuffle_block=256,
        pin_memory=False,
    )
    loader = dm.train_dataloader()
    iterator = iter(loader)
    first = next(iterator)  # exclude worker start-up
    start, images = time.perf_counter(), 0
    for batch in iterator:
        images += batch["image"].shape[0]
    elapsed = time.perf_counter() - start
    del first
    return images / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts to time")
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        help="images per resolution (default: 2^25 / side^2, at least 128: a few seconds each)",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--format", choices=["png", "jpg"], default="png")
    args = parser.parse_args()

    print(
        "| side | format | bytes/image | "
        + " | ".join(
            "1 worker (main process) img/s" if w == 0 else f"{w} workers img/s (per worker)" for w in args.workers
        )
        + " |"
    )
    print("|---|---|---|" + "---|" * len(args.workers))
    for resolution in args.resolutions:
        count = args.images or max(128, (1 << 25) // (resolution * resolution))
        root = Path(tempfile.mkdtemp(prefix=f"bench_data_{resolution}_"))
        try:
            mean_bytes = build_shards(root, resolution, count, args.format)
            cells = []
            for workers in args.workers:
                rate = images_per_second(root, workers, args.batch_size, count)
                cells.append(f"{rate:,.0f}" if workers == 0 else f"{rate:,.0f} ({rate / workers:,.0f})")
            print(
                f"| {resolution} | {args.format} | {mean_bytes / 1024:,.0f} KiB | " + " | ".join(cells) + " |",
                flush=True,
            )
        finally:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
