"""pixdit: pixel-space diffusion transformers with swappable full / sparse (LLSA, VSA, SLA) attention."""

__version__ = "0.1.0"
