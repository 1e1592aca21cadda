"""``pixdit-make-fid-stats`` (= ``python scripts/make_fid_stats.py``): reference statistics for FID (and sFID,
KID, precision/recall, FD-DINOv2) from a pixdit shard folder, through clean-fid's "clean" pipeline (cached).

    python scripts/make_fid_stats.py --shards data/ffhq256                       # -> data/ffhq256/fid_stats/clean_256.npz
    python scripts/make_fid_stats.py --shards data/ffhq1024 --resolution 256 --out stats/ffhq256.npz
    python scripts/make_fid_stats.py --shards data/imagenet256 --kid --inception-path /data/inception-2015-12-05.pt
    python scripts/make_fid_stats.py --shards data/imagenet256 --sfid --dinov2-path /data/dinov2_vitl14_pretrain.pth

Streams every image of the split (default: train, the whole training set, as papers do) as uint8 -> clean-fid's PIL
bicubic resize to 299 -> Inception pool features, accumulating mean and covariance in float64 (features are not kept
unless --kid, which stores them for KID and precision/recall). --sfid adds the spatial statistics (`mu_s`, `sigma_s`),
--dinov2-path the DINOv2 ones (`mu_dinov2`, `sigma_dinov2`) for FD-DINOv2; --inception-mode legacy_tensorflow uses the
network's TF-style resize instead (ADM suite / EDM; file `legacy_tensorflow_<res>.npz`). Writes `mu`, `sigma`,
`count` and `description` (JSON: source, shards checksum, split, resolution, Inception mode, resize pipeline, count,
date). Re-running with the same shards and settings does nothing (--force recomputes).
Use the file with `eval.reference=PATH` (scripts/evaluate.py) or `callbacks.fid.reference=PATH` (training); the
training callback finds the default path by itself.
"""

from __future__ import annotations

import argparse
import sys

import torch

from pixdit.errors import PixditError
from pixdit.eval.dinov2 import DINOv2FeatureExtractor, resolve_dinov2_path
from pixdit.eval.inception import INCEPTION_MODES, InceptionFeatureExtractor, resolve_inception_path
from pixdit.eval.reference import make_reference_stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="shard folder with manifest.json")
    parser.add_argument("--resolution", type=int, default=None, help="evaluation resolution (default: the shards')")
    parser.add_argument(
        "--out", default=None, help="output .npz (default: SHARDS/fid_stats/<inception mode>_<res>.npz)"
    )
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-images", type=int, default=None, help="only the first N images (quick checks)")
    parser.add_argument(
        "--kid", action="store_true", help="also store the features (for KID and precision/recall; 8 KB per image)"
    )
    parser.add_argument("--sfid", action="store_true", help="also the spatial statistics for sFID (mu_s, sigma_s)")
    parser.add_argument("--dinov2-path", default=None, help="dinov2_vitl14_pretrain.pth: also FD-DINOv2 statistics")
    parser.add_argument("--inception-mode", default="clean", choices=INCEPTION_MODES)
    parser.add_argument("--force", action="store_true", help="recompute even if an up-to-date file exists")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inception-path", default=None, help="inception-2015-12-05.pt (file or folder)")
    parser.add_argument("--cache-dir", default=None, help="folder searched for the weights before /tmp")
    parser.add_argument("--download", action="store_true", help="download the weights if missing")
    args = parser.parse_args(argv)
    try:
        if args.resolution is not None and args.resolution < 1:  # (0 used to mean "the shards' resolution")
            raise PixditError(
                f"--resolution must be >= 1 (pixels), got {args.resolution}; leave it out to use the "
                f"shards' own resolution"
            )
        weights = resolve_inception_path(args.inception_path, args.cache_dir, args.download, config_prefix="--")
        dinov2_weights = resolve_dinov2_path(args.dinov2_path, args.download, "--") if args.dinov2_path else None
        extractor = InceptionFeatureExtractor(
            weights, device=args.device, config_prefix="--", mode=args.inception_mode, spatial=args.sfid
        )
        dinov2 = (
            DINOv2FeatureExtractor(dinov2_weights, device=args.device, config_prefix="--") if dinov2_weights else None
        )
        make_reference_stats(
            args.shards,
            extractor,
            resolution=args.resolution,
            split=args.split,
            batch_size=args.batch_size,
            kid=args.kid,
            out=args.out,
            force=args.force,
            max_images=args.max_images,
            dinov2=dinov2,
        )
    except PixditError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
