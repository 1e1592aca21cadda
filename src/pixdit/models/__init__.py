"""Model registry: ``build_model("DiT-S", input_size=(128, 128), attention={"name": "llsa"}, ...)``.

`name` picks depth / hidden size / heads from `DIT_MODELS`; every other keyword is a `DiT` constructor argument
(configs/model/*.yaml hold them; the training code adds the image size from the data config).
"""

from __future__ import annotations

from pixdit.config import construct
from pixdit.errors import PixditError
from pixdit.models.dit import DIT_MODELS, DiT

__all__ = ["DIT_MODELS", "DiT", "build_model"]


def build_model(name: str = "DiT-S", **overrides) -> DiT:
    if name not in DIT_MODELS:
        raise PixditError(f"model name={name!r} is not known; available: {', '.join(DIT_MODELS)}")
    # construct names an unknown key, or a word where a number / flag is expected (model.patch_size=abc).
    return construct(DiT, {**DIT_MODELS[name], **overrides}, "model")
