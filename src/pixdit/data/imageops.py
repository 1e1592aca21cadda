"""Image conversion, resizing and encoding shared by every dataset builder (prepare_data.py, the quickstart builder).

Any image becomes 8-bit RGB first (`to_rgb8`), scaled by its bit depth, never clipped:
* 8-bit modes (1, L, P, LA, PA, La, RGB, RGBA, RGBa, RGBX, CMYK, YCbCr, LAB, HSV) through PIL's own conversion;
  alpha is dropped, not composited (as torchvision's and ADM's loaders do). 16-bit colour PNG / TIFF files are
  opened by PIL as 8-bit RGB(A) already (the high byte of each sample).
* 16-bit greyscale (I;16, I;16B, I;16L, I;16N): value * 255 / 65535, rounded.
* 32-bit integer greyscale (I): value * 255 / max, where max = 2**bits - 1 for the bits per sample the file declares
  (TIFF's BitsPerSample, one bit fewer when its SampleFormat is signed), or 65535 when it declares none (PIL holds
  16-bit PNG / PGM samples in mode I).
* 32-bit float greyscale (F): [0, 1] -> 0..255, rounded.
High-bit-depth images whose values fall outside that range (negative, NaN, a float image in 0..255), or whose
distinct values would all round to one 8-bit level (a faint image in a wide container), raise `UnsupportedImage`
with the reason: prepare_data skips them and lists the reason in the manifest instead of writing a wrong image.

Then one resizing pipeline for all datasets, ADM's `center_crop_arr` (guided-diffusion, the ImageNet convention):
halve the image with a 2x2 box filter while its short side is at least twice the target, then bicubic-resize so the
short side equals the target, then take the centre square. For FFHQ (square, 1024 px) at 512/256/128/64/32 px this is
pure box filtering (exact power-of-two halvings, the bicubic step is then an identity), which avoids aliasing.
FID reference statistics must be computed from images made by this same pipeline (see docs/data.md).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

_TIFF_BITS_PER_SAMPLE, _TIFF_SAMPLE_FORMAT, _TIFF_SIGNED = 258, 339, 2


class UnsupportedImage(ValueError):
    """An image with no faithful 8-bit RGB version under the rules above; the message says why."""


def _integer_range_top(image: Image.Image) -> int:
    """The value that maps to 255 for an integer greyscale image: the top of its range by the declared bit depth."""
    if image.mode.startswith("I;16"):
        return 2**16 - 1
    tags = getattr(image, "tag_v2", None) or {}  # TIFF files declare their sample layout; other formats do not
    bits, sample_format = (np.atleast_1d(tags.get(tag, default))[0] for tag, default in
                           ((_TIFF_BITS_PER_SAMPLE, 16), (_TIFF_SAMPLE_FORMAT, 1)))
    return 2 ** (int(bits) - (sample_format == _TIFF_SIGNED)) - 1


def to_rgb8(image: Image.Image) -> Image.Image:
    """The 8-bit RGB version of any PIL image, scaled by its bit depth (module docstring); raises UnsupportedImage."""
    mode = image.mode
    if mode not in ("F", "I") and not mode.startswith("I;16"):
        if mode == "La":  # premultiplied alpha: PIL converts it to RGB only through LA
            image = image.convert("LA")
        return image.convert("RGB")
    values = np.asarray(image)
    top = 1.0 if mode == "F" else _integer_range_top(image)
    kind = {"F": "32-bit float", "I": "32-bit integer"}.get(mode, "16-bit") + f" greyscale image (mode {mode})"
    finite = bool(np.isfinite(values).all())
    low, high = (values.min(), values.max()) if finite else (None, None)
    if not finite or low < 0 or high > top:
        found = "NaN or infinite values" if not finite else f"values in [{low:g}, {high:g}]"
        raise UnsupportedImage(f"{kind} with {found}; pixdit maps [0, {top}] to 0..255 (convert it to 8 or 16 "
                               f"bits yourself to choose another mapping)")
    grey = np.rint(values.astype(np.float64) * (255.0 / top)).astype(np.uint8)
    if low != high and grey.min() == grey.max():
        raise UnsupportedImage(f"{kind} with values in [{low:g}, {high:g}]: scaled from [0, {top}] "
                               f"to 0..255 it would be one flat grey level (convert it to 8 or 16 bits yourself)")
    return Image.fromarray(grey, "L").convert("RGB")


def center_crop_arr(image: Image.Image, size: int) -> np.ndarray:
    """Resize `image` so its short side is `size` (box halvings, then bicubic) and return the centre `size x size`
    square as a uint8 array [size, size, 3]. Any PIL mode; raises UnsupportedImage (see to_rgb8)."""
    image = to_rgb8(image)
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
