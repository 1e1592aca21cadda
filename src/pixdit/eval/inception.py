"""The Inception feature network of clean-fid, and the clean resize in front of it.

Pipeline for one batch (generated or real images, uint8 [b, 3, H, W]):
  uint8 image -> clean-fid `build_resizer("clean")` (PIL bicubic to 299x299 on float32, no re-quantisation)
  -> clean-fid `InceptionV3W` (the TorchScript translation of TF's inception-2015-12-05; normalises (x-128)/128 and
  runs `layers`) -> 2048-d pool features.
The Inception Score needs class logits of the *same* forward: the TorchScript module's `output` is the 2048 -> 1008
linear classifier; we apply its weight without the bias to the pool features, which is exactly what the module's
own `forward(img, no_output_bias=True)` does (the setting StyleGAN2-ADA / torch-fidelity use to match the original
TF Inception Score), but without its built-in bilinear resize.

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


def resolve_inception_path(inception_path: str | None = None, cache_dir: str | None = None,
                           download: bool = False, config_prefix: str = "eval") -> Path:
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
    if download:
        try:
            download_file(INCEPTION_URL, target)
            return target
        except Exception as error:  # noqa: BLE001 - any network / disk failure becomes the message below
            reason = f"the download failed ({type(error).__name__}: {error})"
    else:
        reason = f"downloading is off ({option_name(config_prefix, 'download')} not set)"
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
    """uint8 images [b, 3, H, W] -> (pool features [b, 2048], class logits without bias [b, 1008]), float32.

    Uses clean-fid's own `build_resizer("clean")` and `InceptionV3W`; resizing runs on CPU threads (PIL releases the
    GIL), the network on `device`.
    """

    def __init__(self, weights_path: str | Path, device: torch.device | str = "cpu", resize_threads: int = 8,
                 config_prefix: str = "eval"):
        from cleanfid.inception_torchscript import InceptionV3W
        from cleanfid.resize import build_resizer

        weights_path = Path(weights_path)
        if weights_path.name != INCEPTION_FILENAME:
            raise PixditError(
                f"{option_name(config_prefix, 'inception_path')}={weights_path}: clean-fid loads the weights by their file name; "
                f"rename the file to {INCEPTION_FILENAME} (or point {option_name(config_prefix, 'inception_path')} at its folder)"
            )
        self.device = torch.device(device)
        # download=False: clean-fid would otherwise fetch the file without a timeout; we resolved it already.
        try:
            network = InceptionV3W(str(weights_path.parent), download=False, resize_inside=False)
        except RuntimeError as error:  # torch.jit.load of a truncated / wrong file
            raise PixditError(
                f"{weights_path} is not a loadable TorchScript Inception file ({str(error).splitlines()[0]}); "
                f"download it again from {INCEPTION_URL}"
            ) from None
        self.network = network.to(self.device)
        self.network.eval()
        self.classifier_weight = self.network.base.output.weight.detach().float().to(self.device)
        self.num_classes = self.classifier_weight.shape[0]  # 1008 for the real network
        self.resize = build_resizer("clean")
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(resize_threads, os.cpu_count() or 1)))

    def resize_batch(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """clean-fid's resize of each image: uint8 [b, 3, H, W] -> float32 [b, 3, 299, 299] in [0, 255] (CPU)."""
        if images_uint8.dtype != torch.uint8 or images_uint8.ndim != 4 or images_uint8.shape[1] != 3:
            raise ValueError(f"expected uint8 [b, 3, H, W] images, got {images_uint8.dtype} {tuple(images_uint8.shape)}")
        hwc = images_uint8.permute(0, 2, 3, 1).cpu().numpy()
        resized = list(self._pool.map(self.resize, list(hwc)))
        return torch.from_numpy(np.stack(resized).transpose(0, 3, 1, 2).copy())

    @torch.no_grad()
    def __call__(self, images_uint8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.resize_batch(images_uint8).to(self.device)
        with torch.autocast(self.device.type, enabled=False):  # float32 always, also inside a bf16 training step
            features = self.network(batch).float()
            logits = F.linear(features, self.classifier_weight)
        return features, logits
