"""The bundled demo dataset: random crops of the sample photographs that ship inside scikit-image.

    python scripts/make_quickstart_data.py --out data/quickstart      # (`make train` runs it when missing)

Nothing is downloaded: `skimage.data` keeps these photographs inside the installed package. Each image is a random
square crop (seeded: random size between `min_crop` and 100% of the photo's short side, random position, random
horizontal flip) resized to 32x32 with the same high-quality resizer prepare_data.py uses (box halvings, then bicubic),
and written by the same shard writer users run for FFHQ. The `val` split holds different random crops (another seed):
the photographs are shared with `train`, the crops are not. Same arguments -> byte-identical shards. Takes seconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from pixdit.data.imageops import center_crop_arr, encode_image
from pixdit.data.shards import ShardWriter, write_manifest

# Photographs bundled inside scikit-image (no pooch download); grey ones are replicated to RGB.
SKIMAGE_PHOTOS = (
    "astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
    "camera", "coins", "grass",
)


def load_photos() -> dict[str, Image.Image]:
    """The scikit-image sample photographs as RGB PIL images."""
    import skimage.data

    photos = {}
    for name in SKIMAGE_PHOTOS:
        pixels = np.asarray(getattr(skimage.data, name)())
        if pixels.ndim == 2:
            pixels = np.stack([pixels] * 3, axis=-1)
        photos[name] = Image.fromarray(np.ascontiguousarray(pixels[..., :3], dtype=np.uint8))
    return photos


def random_crops(photos: dict[str, Image.Image], count: int, resolution: int, seed: int, min_crop: float = 0.2):
    """Yield `count` (photo name, uint8 [resolution, resolution, 3]) random crops, a pure function of the arguments."""
    rng = np.random.default_rng(seed)
    names = sorted(photos)
    for _ in range(count):
        name = names[rng.integers(len(names))]
        photo = photos[name]
        short = min(photo.size)
        # log-uniform crop size: as many close-ups as wide views
        side = int(round(short * np.exp(rng.uniform(np.log(min_crop), 0.0))))
        side = max(resolution, min(short, side))
        left = int(rng.integers(photo.width - side + 1))
        top = int(rng.integers(photo.height - side + 1))
        crop = photo.crop((left, top, left + side, top + side))
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        yield name, center_crop_arr(crop, resolution)


def make_quickstart_dataset(out_dir: str | Path = "data/quickstart", train_count: int = 4096, val_count: int = 256,
                            resolution: int = 32, maxcount: int = 1024, seed: int = 0) -> dict:
    """Write the quickstart shards + manifest.json into `out_dir`; returns the manifest."""
    out_dir = Path(out_dir)
    photos = load_photos()
    splits = {}
    # different seeds -> val crops differ from train crops
    for split, count, split_seed in (("train", train_count, seed), ("val", val_count, seed + 1_000_003)):
        if count == 0:
            continue
        with ShardWriter(out_dir, split, maxcount=maxcount) as writer:
            for index, (name, pixels) in enumerate(random_crops(photos, count, resolution, split_seed)):
                writer.write(f"{index:08d}", encode_image(pixels, "png"), "png", source=f"skimage.data.{name}")
        splits[split] = writer.split_info()
    return write_manifest(
        out_dir, resolution=resolution, image_format="png", splits=splits,
        source="scikit-image sample photographs: " + ", ".join(SKIMAGE_PHOTOS),
        options={"builder": "pixdit.data.quickstart", "train_count": train_count, "val_count": val_count,
                 "seed": seed, "maxcount": maxcount},
    )
