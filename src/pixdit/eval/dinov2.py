"""DINOv2 ViT-L/14 features for FD-DINOv2, the EDM2 protocol (Karras et al. 2024, after Stein et al.'s dgm-eval).

Per batch of uint8 images [b, 3, H, W]:
  float -> bicubic resize to 224x224 (torch, antialias=True) -> /255 -> ImageNet mean / std normalisation
  -> DINOv2 ViT-L/14 -> the class token after the final LayerNorm (1024-d; what the official torch.hub model's
  forward returns and EDM2 uses).
FD-DINOv2 is the Fréchet distance between Gaussians fitted to these features (`pixdit.eval.stats.frechet_distance`).

The architecture is timm's `vit_large_patch14_dinov2` built for 224 px input; the weights come from a local file
(`eval.dinov2_path`): the official checkpoint `dinov2_vitl14_pretrain.pth` (DINOV2_URL) or timm's conversion of it.
The checkpoint's position embeddings are for 518 px (37 x 37 patches); the official model resamples them to the
input's 16 x 16 grid at every forward (bicubic, scale factor (16 + 0.1) / 37, no antialiasing); we do the same
once at load time, so the features equal the torch.hub model's. pixdit never downloads the file implicitly; a missing
file is a PixditError at start-up naming the file, its URL and the setting.

    extractor = DINOv2FeatureExtractor(resolve_dinov2_path("/data/dinov2_vitl14_pretrain.pth"), device="cuda")
    features = extractor(images_uint8)          # [b, 1024] float32
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from pixdit.errors import PixditError
from pixdit.eval.inception import fetch_missing, option_name

DINOV2_FILENAME = "dinov2_vitl14_pretrain.pth"
DINOV2_URL = "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth"
DINOV2_ARCHITECTURE = "vit_large_patch14_dinov2"  # timm's name of DINOv2 ViT-L/14
INPUT_SIZE = 224
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
POS_EMBED_OFFSET = 0.1  # the official model's interpolate_offset


def resolve_dinov2_path(dinov2_path: str | None, download: bool = False, config_prefix: str = "eval") -> Path:
    """The DINOv2 weights file (`<config_prefix>.dinov2_path`: the file, or a folder holding dinov2_vitl14_pretrain.pth);
    a PixditError naming the file, its URL and the setting when it is missing (downloads only when allowed)."""
    key = option_name(config_prefix, "dinov2_path")
    if not dinov2_path:
        raise PixditError(
            f"fd_dinov2 needs the DINOv2 ViT-L/14 weights: set {key}=/path/to/{DINOV2_FILENAME} (download it from "
            f"{DINOV2_URL} on a machine with network access), or leave fd_dinov2 out of the metrics"
        )
    path = Path(os.path.expanduser(str(dinov2_path)))
    if path.is_dir():
        path = path / DINOV2_FILENAME
    if path.is_file():
        return path
    reason = fetch_missing(DINOV2_URL, path, download, config_prefix)
    if reason is None:
        return path
    raise PixditError(
        f"DINOv2 weights for fd_dinov2 not found at {path}; {reason}.\n"
        f"  The file is {DINOV2_FILENAME} from {DINOV2_URL} (timm's conversion of it works too)\n"
        f"  Fix: download it on a machine with network access and set {key}=/path/to/{DINOV2_FILENAME}, or leave "
        f"fd_dinov2 out of the metrics."
    )


def resample_pos_embed_like_dinov2(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """Position embeddings [1, 1 + M*M, d] -> [1, 1 + grid*grid, d] exactly as the official DINOv2 model does for a
    grid x grid input (class token unchanged; patch embeddings bicubic with scale factor (grid + 0.1) / M)."""
    num_patches = pos_embed.shape[1] - 1
    side = int(round(num_patches**0.5))
    if side * side != num_patches:
        raise PixditError(f"DINOv2 pos_embed has {num_patches} patch positions, not a square grid")
    if side == grid:
        return pos_embed
    dtype, dim = pos_embed.dtype, pos_embed.shape[-1]
    patches = pos_embed[:, 1:].float().reshape(1, side, side, dim).permute(0, 3, 1, 2)
    scale = (grid + POS_EMBED_OFFSET) / side
    patches = F.interpolate(patches, scale_factor=(scale, scale), mode="bicubic")
    if patches.shape[-2:] != (grid, grid):
        raise PixditError(f"DINOv2 pos_embed resampling gave {tuple(patches.shape[-2:])}, expected {(grid, grid)}")
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid * grid, dim)
    return torch.cat([pos_embed[:, :1].float(), patches], dim=1).to(dtype)


def load_dinov2_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (.pth / .bin via torch.load(weights_only=True), or .safetensors)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a truncated or wrong file is a user error
        raise PixditError(
            f"{path} is not a loadable DINOv2 checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); download it again from {DINOV2_URL}"
        ) from None
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise PixditError(f"{path}: expected a state dict of DINOv2 weights, found {type(state).__name__}")
    return state


class DINOv2FeatureExtractor:
    """uint8 images [b, 3, H, W] -> DINOv2 class-token features [b, 1024] (float32), EDM2's FD-DINOv2 protocol.

    `architecture_overrides` change timm's ViT-L/14 hyper-parameters (depth, embed_dim, ...): for tests with a small
    random-weight network only; real evaluations use the defaults.
    """

    def __init__(
        self,
        weights_path: str | Path,
        device: torch.device | str = "cpu",
        config_prefix: str = "eval",
        **architecture_overrides,
    ):
        import timm

        self.device = torch.device(device)
        model = timm.create_model(
            DINOV2_ARCHITECTURE, pretrained=False, num_classes=0, img_size=INPUT_SIZE, **architecture_overrides
        )
        state = load_dinov2_state_dict(weights_path)
        state = {k: v for k, v in state.items() if k != "mask_token"}  # used only in DINOv2's masked training
        grid = model.patch_embed.grid_size[0]
        if "pos_embed" in state:
            state["pos_embed"] = resample_pos_embed_like_dinov2(state["pos_embed"], grid)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise PixditError(
                f"{option_name(config_prefix, 'dinov2_path')}={weights_path} does not hold DINOv2 ViT-L/14 weights "
                f"({str(error).splitlines()[0]} ...); the file is {DINOV2_FILENAME} from {DINOV2_URL}"
            ) from None
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.feature_dim = model.num_features
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).reshape(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).reshape(1, 3, 1, 1)

    @torch.no_grad()
    def __call__(self, images_uint8: torch.Tensor) -> torch.Tensor:
        if images_uint8.dtype != torch.uint8 or images_uint8.ndim != 4 or images_uint8.shape[1] != 3:
            raise ValueError(
                f"expected uint8 [b, 3, H, W] images, got {images_uint8.dtype} {tuple(images_uint8.shape)}"
            )
        with torch.autocast(self.device.type, enabled=False):
            x = images_uint8.to(self.device, torch.float32)
            x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bicubic", antialias=True)
            x = (x / 255 - self.mean) / self.std
            return self.model(x).float()
