"""Evaluation: FID / Inception Score / KID with clean-fid's "clean" pipeline, from the EMA model, on any number of GPUs.

    from pixdit.eval import frechet_distance, evaluate_generator, FIDCallback
    python scripts/evaluate.py ckpt=PATH num_samples=50000 sampler.steps=20    # from a checkpoint (docs/evaluation.md)
    python scripts/make_fid_stats.py --shards data/ffhq256                       # reference statistics of a dataset

Modules: stats (FeatureStatistics, frechet_distance, inception_score, kernel_inception_distance), inception (weights
lookup + clean-fid feature network), sampling (per-index seeded generation), reference (reference statistics),
evaluator (one distributed evaluation), callback (FIDCallback).
"""

from pixdit.eval.evaluator import evaluate_generator, gather_by_index
from pixdit.eval.inception import (
    INCEPTION_FILENAME,
    INCEPTION_URL,
    InceptionFeatureExtractor,
    images_to_uint8,
    resolve_inception_path,
)
from pixdit.eval.reference import ReferenceStats, default_stats_path, load_reference, save_reference
from pixdit.eval.sampling import generate_uint8, labels_for_indices, noise_for_indices, rank_indices
from pixdit.eval.stats import FeatureStatistics, frechet_distance, inception_score, kernel_inception_distance

__all__ = [
    "INCEPTION_FILENAME",
    "INCEPTION_URL",
    "FeatureStatistics",
    "InceptionFeatureExtractor",
    "ReferenceStats",
    "default_stats_path",
    "evaluate_generator",
    "frechet_distance",
    "gather_by_index",
    "generate_uint8",
    "images_to_uint8",
    "inception_score",
    "kernel_inception_distance",
    "labels_for_indices",
    "load_reference",
    "noise_for_indices",
    "rank_indices",
    "resolve_inception_path",
    "save_reference",
]
