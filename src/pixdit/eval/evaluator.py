"""One evaluation: generate samples on every rank, extract Inception features, combine across ranks, compute metrics.

Each rank generates the indices rank, rank + W, ... (see pixdit.eval.sampling), accumulates FID statistics in a
streaming float64 `FeatureStatistics` (summed over ranks with all_reduce) and keeps only the 1008 logits per sample
(and the 2048-d features when KID is on); those are all_gathered (uneven counts are padded) and put back in
sample-index order, so the Inception Score splits are the same for any number of GPUs. Metrics are computed once, on
rank 0, and broadcast, so every rank returns (and logs) the same numbers.

    metrics = evaluate_generator(ema_model, flow, extractor, reference, num_samples=50_000, image_size=(256, 256),
                                 steps=20, seed=0, device="cuda", precision="bf16")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pixdit.errors import PixditError
from pixdit.eval.inception import FEATURE_DIM, InceptionFeatureExtractor
from pixdit.eval.reference import ReferenceStats
from pixdit.eval.sampling import generate_uint8, rank_indices
from pixdit.eval.stats import FeatureStatistics, frechet_distance, inception_score, kernel_inception_distance
from pixdit.runtime import rank_and_world_size


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one (a collective; just `flag` without a process group)."""
    if rank_and_world_size()[1] == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_by_index(rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """all_gather rows `[n_r, d]` with their global sample indices `[n_r]` from every rank (n_r may differ) and return
    all rows `[sum n_r, d]` sorted by index, on every rank."""
    rank, world_size = rank_and_world_size()
    indices = indices.to(rows.device)
    if world_size > 1:
        count = torch.tensor([rows.shape[0]], device=rows.device)
        counts = [torch.zeros_like(count) for _ in range(world_size)]
        dist.all_gather(counts, count)
        counts = [int(c.item()) for c in counts]
        max_count = max(counts)
        padded_rows = rows.new_zeros((max_count, *rows.shape[1:]))
        padded_rows[: rows.shape[0]] = rows
        padded_indices = indices.new_full((max_count,), -1)
        padded_indices[: indices.shape[0]] = indices
        all_rows = [torch.empty_like(padded_rows) for _ in range(world_size)]
        all_indices = [torch.empty_like(padded_indices) for _ in range(world_size)]
        dist.all_gather(all_rows, padded_rows)
        dist.all_gather(all_indices, padded_indices)
        rows = torch.cat([r[:c] for r, c in zip(all_rows, counts)])
        indices = torch.cat([i[:c] for i, c in zip(all_indices, counts)])
    order = torch.argsort(indices)
    if not torch.equal(indices[order], torch.unique(indices)):
        raise RuntimeError("gather_by_index: duplicate sample indices across ranks")
    return rows[order]


@torch.no_grad()
def evaluate_generator(
    model: torch.nn.Module,
    flow,
    extractor: InceptionFeatureExtractor,
    reference: ReferenceStats | None,
    *,
    num_samples: int,
    image_size: Sequence[int],
    steps: int,
    seed: int = 0,
    cfg_scale: float = 1.0,
    num_classes: int = 0,
    index_offset: int = 0,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    inception_splits: int = 10,
    kid: bool = False,
    on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> dict:
    """Generate samples index_offset .. index_offset + num_samples - 1 and return
    {"fid", "is_mean", "is_std", ["kid"], "num_samples"} (fid is None when `reference` is None).

    on_batch(indices, uint8 images) is called on each rank for its own batches (PNG grid / samples.npz writers).
    Collective: every rank of the default process group must call it with the same arguments.
    """
    rank, world_size = rank_and_world_size()
    if num_samples < max(2, inception_splits):
        raise PixditError(f"num_samples={num_samples} must be at least 2 and at least inception_splits "
                          f"({inception_splits})")
    was_training = model.training
    model.eval()
    stats = FeatureStatistics(FEATURE_DIM, device=extractor.device)
    local_indices, local_logits, local_features = [], [], []
    local_error = None
    try:
        for indices, images in generate_uint8(
            model, flow, rank_indices(num_samples, rank, world_size, index_offset),
            image_size=image_size, seed=seed, steps=steps, cfg_scale=cfg_scale, num_classes=num_classes,
            batch_size=batch_size, device=device, precision=precision,
        ):
            if on_batch is not None:
                on_batch(indices, images)
            features, logits = extractor(images)
            stats.update(features)
            local_indices.append(indices)
            local_logits.append(logits)
            if kid:
                local_features.append(features)
    except Exception as error:  # noqa: BLE001 - re-raised below, after the other ranks have been told
        local_error = error
    finally:
        model.train(was_training)
    # A rank that failed (e.g. out of memory at batch size 1) must not leave the others waiting in all_reduce.
    if _any_rank(local_error is not None, extractor.device):
        if local_error is not None:
            raise local_error
        raise PixditError("the evaluation failed on another rank (its log has the error)")

    stats.all_reduce()
    empty = torch.empty(0, dtype=torch.int64)
    indices = torch.cat(local_indices) if local_indices else empty
    logits = torch.cat(local_logits) if local_logits else torch.empty(0, extractor.num_classes, device=extractor.device)
    logits = gather_by_index(logits, indices)
    features = None
    if kid:
        features = torch.cat(local_features) if local_features else torch.empty(0, FEATURE_DIM, device=extractor.device)
        features = gather_by_index(features, indices)

    # Rank 0 computes; the result - or the error - goes to every rank, so no rank is left waiting in a collective.
    payload = [None, None]
    if rank == 0:
        try:
            payload[0] = _metrics(stats, logits, features, reference, inception_splits, kid)
        except Exception as error:  # noqa: BLE001 - re-raised below on every rank
            payload[1] = error
    if world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[1] is not None:
        raise payload[1]
    return payload[0]


def _metrics(stats: FeatureStatistics, logits: torch.Tensor, features: torch.Tensor | None,
             reference: ReferenceStats | None, inception_splits: int, kid: bool) -> dict:
    result = {"num_samples": int(stats.count.item())}
    mu, sigma = stats.mean_and_covariance()
    result["fid"] = frechet_distance(mu, sigma, reference.mu, reference.sigma) if reference is not None else None
    result["is_mean"], result["is_std"] = inception_score(torch.softmax(logits.double(), dim=1), inception_splits)
    if kid:
        if reference is None or reference.features is None:
            result["kid"] = None  # the reference has no stored features (make_fid_stats.py --kid stores them)
        else:
            result["kid"] = kernel_inception_distance(reference.features, features)
    return result
