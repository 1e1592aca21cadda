"""Image resizing and encoding shared by every dataset builder (prepare_data.py, the quickstart builder).

One resizing pipeline for all datasets, ADM's `center_crop_arr` (guided-diffusion, the ImageNet convention):
halve the image with a 2x2 box filter while its short side is at least twice the target, then bicubic-resize so the
short side equals the target, then take the centre square. For FFHQ (square, 1024 px) at 512/256/128/64/32 px this is
pure box filtering (exact power-of-two halvings, the bicubic step is then an identity), which avoids aliasing.
FID reference statistics must be computed from images made by this same pipeline (see docs/data.md).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def center_crop_arr(image: Image.Image, size: int) -> np.ndarray:
    """Resize `image` so its short side is `size` (box halvings, then bicubic) and return the centre `size x size`
    square as a uint8 array [size, size, 3]."""
    image = image.convert("RGB")
    # Box-filter halvings first: bicubic alone aliases when shrinking by more than 2x.
    while min(image.size) >= 2 * size:
        image = image.resize((image.width // 2, image.height // 2), resample=Image.BOX)
    scale = size / min(image.size)
    new_size = (max(size, round(image.width * scale)), max(size, round(image.height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, resample=Image.BICUBIC)
    pixels = np.asarray(image)
    top = (pixels.shape[0] - size) // 2
    left = (pixels.shape[1] - size) // 2
    return pixels[top : top + size, left : left + size]


def encode_image(pixels: np.ndarray, image_format: str = "png", quality: int = 95) -> bytes:
    """Encode uint8 [H, W, 3] pixels as PNG (lossless) or JPEG (`quality` 1..100, 4:4:4 chroma)."""
    buffer = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8))
    if image_format == "png":
        image.save(buffer, format="PNG", compress_level=6)
    elif image_format == "jpg":
        image.save(buffer, format="JPEG", quality=quality, subsampling=0)
    else:
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    return buffer.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    """Decode PNG/JPEG bytes to uint8 [H, W, 3] (grey and RGBA images are converted to RGB)."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))
