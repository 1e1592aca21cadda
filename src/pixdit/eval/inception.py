"""The Inception feature network of clean-fid, the resize in front of it, and the spatial (sFID) features.

Pipeline for one batch (generated or real images, uint8 [b, 3, H, W]), `mode` = clean-fid's mode name:
  clean              uint8 image -> clean-fid `build_resizer("clean")` (PIL bicubic to 299x299 on float32, no
                     re-quantisation) -> the network (default; clean-fid's protocol)
  legacy_tensorflow  the image as float at its own size -> the network's built-in resize (NVIDIA's port of the TF graph's
                     bilinear ResizeBilinear to 299x299). This is what the ADM evaluation suite (TF graph fed at
                     `ExpandDims`), StyleGAN2-ADA and EDM/EDM2 compute; use it to compare with their reference
                     statistics (an ADM reference batch's `mu`/`sigma`/`mu_s`/`sigma_s`).
The network is clean-fid's `InceptionV3W` (the TorchScript translation of TF's inception-2015-12-05; normalises
(x - 128) / 128 and runs `layers`) -> 2048-d pool features.
The Inception Score needs class logits of the *same* forward: the TorchScript module's `output` is the 2048 -> 1008
linear classifier; we apply its weight without the bias to the pool features, which is exactly what the module's
own `forward(img, no_output_bias=True)` does (the setting StyleGAN2-ADA / torch-fidelity use to match the original
TF Inception Score).

Spatial features (sFID, the ADM suite's definition): the output of the TF graph's node `mixed_6/conv` (the 1x1
conv + batch norm + ReLU branch of the 17x17 block mixed_6, [b, 192, 17, 17]), its first 7 channels, flattened in
TF's (h, w, c) order: 7 * 17 * 17 = 2023 dims. clean-fid's wrapper exposes only the pool output, but the TorchScript
file keeps the TF graph's names: `layers` is a sequence of named blocks (conv, ..., mixed_5, mixed_6, ..., pool) and
`layers.mixed_6.conv` is that node. `spatial=True` runs the blocks one by one and taps `mixed_6.conv` on the way;
because that relies on the file's structure, the extractor checks once at load time that the block-by-block pass
gives the same pool features as the network's own forward (else a PixditError says sFID is not available).

The weights file is a download (`INCEPTION_URL`). `resolve_inception_path` finds it from config
(`eval.inception_path`, or clean-fid's download location /tmp) and, when it is missing, fails at start-up with a
message naming the file, its URL and the config key; it downloads only when explicitly allowed (`eval.download=true`)
and then with a timeout, so an offline machine never hangs.
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pixdit.errors import PixditError
from pixdit.files import atomic_write

INCEPTION_FILENAME = "inception-2015-12-05.pt"
# Same URL as cleanfid.downloads_helper.inception_url (kept here so the error message works without importing it).
INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
CLEANFID_DEFAULT_DIR = "/tmp"  # where cleanfid.features.feature_extractor looks for / downloads the file on Linux
FEATURE_DIM = 2048
SPATIAL_BLOCK, SPATIAL_CHANNELS = "mixed_6", 7  # ADM's sFID: mixed_6/conv, first 7 channels (17 x 17 x 7 = 2023)
SPATIAL_DIM = 17 * 17 * SPATIAL_CHANNELS
INCEPTION_MODES = ("clean", "legacy_tensorflow")  # clean-fid's mode names (cleanfid.resize.build_resizer)
DOWNLOAD_TIMEOUT_S = 20


def option_name(config_prefix: str, name: str) -> str:
    """How the user sets option `name`: `eval.inception_path` (Hydra) or `--inception-path` (config_prefix="--")."""
    return f"--{name.replace('_', '-')}" if config_prefix == "--" else f"{config_prefix}.{name}"


def _candidate_paths(inception_path: str | None, cache_dir: str | None) -> list[Path]:
    if inception_path:
        path = Path(os.path.expanduser(str(inception_path)))
        return [path / INCEPTION_FILENAME if path.is_dir() else path]
    dirs = [cache_dir] if cache_dir else []
    return [Path(os.path.expanduser(str(d))) / INCEPTION_FILENAME for d in [*dirs, CLEANFID_DEFAULT_DIR]]


def download_file(url: str, destination: Path) -> None:
    """Download with a timeout to a temporary file, then rename (never leaves a half-written weights file)."""
    with atomic_write(destination) as f, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        shutil.copyfileobj(response, f)


def fetch_missing(url: str, destination: Path, download: bool, config_prefix: str) -> str | None:
    """Download a missing weights file when allowed. Returns None when it is now there, else why not (for the
    caller's one error message, which names the file and the fix)."""
    if not download:
        return f"downloading is off ({option_name(config_prefix, 'download')} not set)"
    try:
        download_file(url, destination)
        return None
    except Exception as error:  # noqa: BLE001 - any network / disk failure becomes the caller's message
        return f"the download failed ({type(error).__name__}: {error})"


def resolve_inception_path(
    inception_path: str | None = None, cache_dir: str | None = None, download: bool = False, config_prefix: str = "eval"
) -> Path:
    """Path of the Inception weights file; raise PixditError (at start-up) when it is missing.

    inception_path: the file, or a folder containing `inception-2015-12-05.pt` (config key `eval.inception_path`).
    cache_dir: a folder searched when inception_path is not set (config key `eval.cache_dir`), before clean-fid's /tmp.
    download: when the file is missing, download it (with a timeout) to the first candidate location.
    config_prefix: the config section the error message names (`eval` for evaluate.py, `callbacks.fid` in training).
    """
    candidates = _candidate_paths(inception_path, cache_dir)
    for path in candidates:
        if path.is_file():
            return path
    target = candidates[0]
    reason = fetch_missing(INCEPTION_URL, target, download, config_prefix)
    if reason is None:
        return target
    raise PixditError(
        f"Inception weights for FID/IS not found: looked for {', '.join(str(p) for p in candidates)}; {reason}.\n"
        f"  The file is {INCEPTION_FILENAME} from {INCEPTION_URL}\n"
        f"  Fix: download it on a machine with network access and set "
        f"{option_name(config_prefix, 'inception_path')}=/path/to/{INCEPTION_FILENAME} (or put it in "
        f"{option_name(config_prefix, 'cache_dir')}), or turn on {option_name(config_prefix, 'download')} on a "
        f"machine with network access."
    )


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] float images -> uint8 (what saving a PNG does: x*127.5+127.5, rounded, clamped)."""
    return (images.float() * 127.5 + 127.5).round().clamp(0, 255).to(torch.uint8)


class InceptionFeatureExtractor:
    """uint8 images [b, 3, H, W] -> pool features [b, 2048], class logits without bias [b, 1008] and, with
    spatial=True, sFID features [b, 2023]; all float32.

    Uses clean-fid's own `build_resizer` and `InceptionV3W`; the clean resize runs on CPU threads (PIL releases the
    GIL), the network on `device`.
    """

    def __init__(
        self,
        weights_path: str | Path,
        device: torch.device | str = "cpu",
        resize_threads: int = 8,
        config_prefix: str = "eval",
        mode: str = "clean",
        spatial: bool = False,
    ):
        from cleanfid.inception_torchscript import InceptionV3W
        from cleanfid.resize import build_resizer

        if mode not in INCEPTION_MODES:
            raise PixditError(
                f"{option_name(config_prefix, 'inception_mode')}={mode!r}; allowed: {', '.join(INCEPTION_MODES)}"
            )
        weights_path = Path(weights_path)
        if weights_path.name != INCEPTION_FILENAME:
            raise PixditError(
                f"{option_name(config_prefix, 'inception_path')}={weights_path}: clean-fid loads the weights by their file name; "
                f"rename the file to {INCEPTION_FILENAME} (or point {option_name(config_prefix, 'inception_path')} at its folder)"
            )
        self.device = torch.device(device)
        self.mode = mode
        # download=False: clean-fid would otherwise fetch the file without a timeout; we resolved it already.
        try:
            network = InceptionV3W(str(weights_path.parent), download=False, resize_inside=mode == "legacy_tensorflow")
        except RuntimeError as error:  # torch.jit.load of a truncated / wrong file
            raise PixditError(
                f"{weights_path} is not a loadable TorchScript Inception file ({str(error).splitlines()[0]}); "
                f"download it again from {INCEPTION_URL}"
            ) from None
        self.network = network.to(self.device)
        self.network.eval()
        self.classifier_weight = self.network.base.output.weight.detach().float().to(self.device)
        self.num_classes = self.classifier_weight.shape[0]  # 1008 for the real network
        self.resize = build_resizer(mode)
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(resize_threads, os.cpu_count() or 1)))
        self.spatial = spatial
        if spatial:
            self._check_blockwise_pass(weights_path)

    def resize_batch(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """The mode's resize of each image: uint8 [b, 3, H, W] -> float32 [b, 3, 299, 299] in [0, 255] (CPU) for
        `clean`; float32 at the input size for `legacy_tensorflow` (the network resizes)."""
        if images_uint8.dtype != torch.uint8 or images_uint8.ndim != 4 or images_uint8.shape[1] != 3:
            raise ValueError(
                f"expected uint8 [b, 3, H, W] images, got {images_uint8.dtype} {tuple(images_uint8.shape)}"
            )
        if self.mode == "legacy_tensorflow":
            return images_uint8.float()
        hwc = images_uint8.permute(0, 2, 3, 1).cpu().numpy()
        resized = list(self._pool.map(self.resize, list(hwc)))
        return torch.from_numpy(np.stack(resized).transpose(0, 3, 1, 2).copy())

    @torch.no_grad()
    def __call__(self, images_uint8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool features [b, 2048], bias-free class logits [b, 1008])."""
        features = self.extract(images_uint8)
        return features["pool"], features["logits"]

    @torch.no_grad()
    def extract(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        """{"pool": [b, 2048], "logits": [b, 1008]} and, when built with spatial=True, "spatial": [b, 2023]."""
        batch = self.resize_batch(images_uint8).to(self.device)
        with torch.autocast(self.device.type, enabled=False):  # float32 always, also inside a bf16 training step
            if self.spatial:
                pool, spatial = self._blockwise(batch)
            else:
                pool, spatial = self.network(batch).float(), None
            out = {"pool": pool, "logits": F.linear(pool, self.classifier_weight)}
        if spatial is not None:
            out["spatial"] = spatial
        return out

    # ------------------------------------------------------------------ sFID: the block-by-block pass
    def _network_input(self, batch: torch.Tensor) -> torch.Tensor:
        """What the network's `layers` see: resized to 299 (TF-style inside the network for legacy_tensorflow) and
        normalised to (x - 128) / 128, as InceptionV3W / the TorchScript forward do."""
        if self.mode == "legacy_tensorflow":
            batch = tensorflow_bilinear_resize(batch, 299)
        return (batch - 128) / 128

    def _blockwise(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._network_input(batch)
        spatial = None
        for name, block in self.network.layers.named_children():
            if name == SPATIAL_BLOCK:
                tapped = block.conv(x)[:, :SPATIAL_CHANNELS]  # [b, 7, 17, 17]
                spatial = tapped.permute(0, 2, 3, 1).reshape(x.shape[0], -1)  # TF's NHWC flattening order
            x = block(x)
        return x.reshape(x.shape[0], -1).float(), spatial.float()

    def _check_blockwise_pass(self, weights_path: Path) -> None:
        names = [name for name, _ in self.network.layers.named_children()]
        probe = torch.Generator().manual_seed(0)
        size = 299 if self.mode == "clean" else 64
        batch = (torch.rand(2, 3, size, size, generator=probe) * 255).to(self.device)
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            blockwise = self._blockwise(batch)[0] if SPATIAL_BLOCK in names else None
            reference = self.network(batch).float()
        if blockwise is None or not torch.allclose(blockwise, reference, rtol=1e-4, atol=1e-4):
            raise PixditError(
                f"{weights_path}: the network's blocks ({', '.join(names)}) run one by one do not reproduce its "
                f"output, so the sFID features (mixed_6/conv) cannot be read from this file; use the original "
                f"{INCEPTION_FILENAME} from {INCEPTION_URL}, or leave sfid out of the metrics"
            )


def tensorflow_bilinear_resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """TF1's ResizeBilinear (align_corners=False: source = destination * in / out, no half-pixel shift) of float
    images [b, c, H, W] to size x size, as the Inception TorchScript file's own forward emulates it (an affine grid
    shifted by half a pixel, sampled with border padding)."""
    b, c, height, width = images.shape
    theta = torch.eye(2, 3, device=images.device, dtype=torch.float32)
    theta[0, 2] += theta[0, 0] / width - theta[0, 0] / size
    theta[1, 2] += theta[1, 1] / height - theta[1, 1] / size
    theta = theta.unsqueeze(0).repeat(b, 1, 1)
    grid = F.affine_grid(theta, [b, c, size, size], align_corners=False)
    return F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
