"""Feature statistics and the metrics computed from them: FID, Inception Score, KID.

* `FeatureStatistics` keeps a running count, sum and sum of outer products of feature vectors in float64, so the
  50k x 2048 features of an FID run never need to be kept; `merge` / `all_reduce` combine ranks exactly (the sums add).
* `frechet_distance(mu1, sigma1, mu2, sigma2)`: the Fréchet distance between two Gaussians, computed with symmetric
  eigen-decompositions, so it stays finite and real for singular or near-singular covariances (few samples).
* `inception_score(probs, num_splits=10)`: mean and std over splits, as in the original TF implementation.
* `kernel_inception_distance(feats1, feats2)`: clean-fid's `kernel_distance`, made reproducible by a seed.
* `precision_recall(real, fake, k=3)`: improved precision and recall (Kynkäänniemi et al. 2019), batched in torch.

    from pixdit.eval import frechet_distance
    fid = frechet_distance(mu_gen, sigma_gen, mu_ref, sigma_ref)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from scipy import linalg
from scipy.special import xlogy

from pixdit.errors import PixditError
from pixdit.runtime import rank_and_world_size


class FeatureStatistics:
    """Streaming mean / covariance of feature vectors (rows), accumulated in float64 on `device`."""

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.dim = dim
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)
        self.outer_sum = torch.zeros(dim, dim, dtype=torch.float64, device=device)

    def update(self, features: torch.Tensor) -> None:
        """Add a batch of feature vectors `[n, dim]`."""
        if features.ndim != 2 or features.shape[1] != self.dim:
            raise ValueError(f"features must be [n, {self.dim}], got {tuple(features.shape)}")
        x = features.to(device=self.sum.device, dtype=torch.float64)
        self.count += x.shape[0]
        self.sum += x.sum(dim=0)
        self.outer_sum += x.T @ x

    def merge(self, other: FeatureStatistics) -> FeatureStatistics:
        """Add another accumulator's sums into this one (what the sum over ranks does)."""
        self.count += other.count.to(self.count.device)
        self.sum += other.sum.to(self.sum.device)
        self.outer_sum += other.outer_sum.to(self.outer_sum.device)
        return self

    def all_reduce(self) -> FeatureStatistics:
        """Sum the statistics over all ranks of the default process group (no-op without one)."""
        if rank_and_world_size()[1] > 1:
            for tensor in (self.count, self.sum, self.outer_sum):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return self

    def mean_and_covariance(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) as float64 numpy arrays; sigma is the unbiased covariance (divides by n - 1, like np.cov)."""
        n = int(self.count.item())
        if n < 2:
            raise PixditError(f"need at least 2 feature vectors for a covariance, got {n}")
        mean = self.sum / n
        covariance = (self.outer_sum - n * torch.outer(mean, mean)) / (n - 1)
        covariance = 0.5 * (covariance + covariance.T)  # exact symmetry for the eigen-solvers
        return mean.cpu().numpy(), covariance.cpu().numpy()


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix (negative round-off eigenvalues clipped to 0)."""
    eigenvalues, eigenvectors = linalg.eigh(matrix, driver="evd")  # divide and conquer: the fastest for all vectors
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ eigenvectors.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Squared Fréchet (2-Wasserstein) distance between N(mu1, sigma1) and N(mu2, sigma2).

    d² = |mu1 - mu2|² + tr(sigma1) + tr(sigma2) - 2 tr((sigma1 sigma2)^(1/2)).
    tr((s1 s2)^(1/2)) is the sum of square roots of the eigenvalues of s1^(1/2) s2 s1^(1/2), which is symmetric
    positive semi-definite, so the symmetric eigen-solver gives real, non-negative eigenvalues even when the
    covariances are singular (where scipy's sqrtm of the non-symmetric product needs an eps offset and can go complex).
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, dtype=np.float64)), np.atleast_1d(np.asarray(mu2, dtype=np.float64))
    sigma1 = np.atleast_2d(np.asarray(sigma1, dtype=np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, dtype=np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.shape[0], mu1.shape[0]):
        raise PixditError(
            f"frechet_distance: shapes do not match: mu1 {mu1.shape}, mu2 {mu2.shape}, sigma1 {sigma1.shape}, "
            f"sigma2 {sigma2.shape} (the reference statistics must come from the same feature network)"
        )
    diff = mu1 - mu2
    mean_term = diff @ diff
    # Dimensions without variance in either set have zero rows and columns in both (PSD) and add nothing to the trace
    # terms: dropping them is exact and makes the eigen-solvers cheaper.
    keep = (np.diag(sigma1) > 0) | (np.diag(sigma2) > 0)
    sigma1 = 0.5 * (sigma1 + sigma1.T)[np.ix_(keep, keep)]
    sigma2 = 0.5 * (sigma2 + sigma2.T)[np.ix_(keep, keep)]
    sqrt_sigma1 = _psd_sqrt(sigma1)
    middle = sqrt_sigma1 @ sigma2 @ sqrt_sigma1
    eigenvalues = linalg.eigvalsh(0.5 * (middle + middle.T))
    trace_sqrt_product = np.sqrt(np.clip(eigenvalues, 0.0, None)).sum()
    distance = mean_term + np.trace(sigma1) + np.trace(sigma2) - 2.0 * trace_sqrt_product
    return float(max(distance, 0.0))


def inception_score(probs, num_splits: int = 10) -> tuple[float, float]:
    """Inception Score of class probabilities `[n, classes]` (rows in sample-index order): mean and std of
    exp(E_x KL(p(y|x) || p(y))) over `num_splits` contiguous splits, as in the original implementation."""
    probs = probs.detach().cpu().double().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs, np.float64)
    n = probs.shape[0]
    if num_splits < 1:
        raise PixditError(f"inception_score: num_splits (eval.inception_splits) must be >= 1, got {num_splits}")
    if n < num_splits:
        raise PixditError(f"inception_score: need at least num_splits={num_splits} samples, got {n}")
    scores = []
    for split in range(num_splits):
        part = probs[split * n // num_splits : (split + 1) * n // num_splits]
        marginal = part.mean(axis=0, keepdims=True)
        kl = (xlogy(part, part) - xlogy(part, marginal)).sum(axis=1).mean()
        scores.append(np.exp(kl))
    return float(np.mean(scores)), float(np.std(scores))


def kernel_inception_distance(feats1, feats2, num_subsets: int = 100, max_subset_size: int = 1000, seed: int = 0):
    """KID (cubic polynomial kernel MMD², clean-fid's `kernel_distance`) with a fixed seed for its subset draws."""
    from cleanfid.fid import kernel_distance

    feats1 = feats1.detach().cpu().double().numpy() if isinstance(feats1, torch.Tensor) else np.asarray(feats1)
    feats2 = feats2.detach().cpu().double().numpy() if isinstance(feats2, torch.Tensor) else np.asarray(feats2)
    state = np.random.get_state()  # clean-fid draws subsets from numpy's global generator
    try:
        np.random.seed(seed)
        return float(kernel_distance(feats1, feats2, num_subsets=num_subsets, max_subset_size=max_subset_size))
    finally:
        np.random.set_state(state)


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances [len(a), len(b)] (|a|^2 - 2 a.b + |b|^2, clamped at 0)."""
    return (a.square().sum(1, keepdim=True) - 2 * a @ b.T + b.square().sum(1)[None]).clamp_min_(0)


DISTANCE_BLOCK_ELEMENTS = 2**27  # entries of one block of pairwise distances (512 MB in fp32)


def _row_chunks(num_rows: int, num_cols: int):
    """Row ranges whose distance block [rows, num_cols] has at most DISTANCE_BLOCK_ELEMENTS entries."""
    step = max(1, DISTANCE_BLOCK_ELEMENTS // max(1, num_cols))
    return [(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def knn_radii(features: torch.Tensor, k: int = 3) -> torch.Tensor:
    """Squared distance of each row to its k-th nearest neighbour among the other rows."""
    if features.shape[0] <= k:
        raise PixditError(
            f"precision/recall with k={k} needs more than {k} feature vectors per set, got {features.shape[0]}"
        )
    radii = torch.empty(features.shape[0], dtype=features.dtype, device=features.device)
    for start, end in _row_chunks(features.shape[0], features.shape[0]):
        distances = _squared_distances(features[start:end], features)
        # the k+1 smallest include the row itself (distance 0): the k-th neighbour is the last of them
        radii[start:end] = distances.topk(k + 1, dim=1, largest=False).values[:, k]
    return radii


def _fraction_inside(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor) -> float:
    """Fraction of `points` inside at least one ball (centre, radius), radii squared; boundary counts as inside."""
    inside = torch.zeros(points.shape[0], dtype=torch.bool, device=points.device)
    for start, end in _row_chunks(points.shape[0], centres.shape[0]):
        inside[start:end] = (_squared_distances(points[start:end], centres) <= radii[None]).any(dim=1)
    return float(inside.double().mean())


def precision_recall(real, fake, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019), as the ADM evaluation suite computes them.

    Each set's manifold is the union of balls around its feature vectors with radius = distance to the k-th nearest
    neighbour in the same set. precision = fraction of `fake` inside the real manifold, recall = fraction of `real`
    inside the fake manifold. Distances are computed in batches on the features' device (float32, or float64 when
    the inputs are); the ADM suite uses 10k reference and 50k generated Inception pool features, k = 3.
    """
    real = torch.as_tensor(real)
    fake = torch.as_tensor(fake).to(device=real.device)
    dtype = torch.float64 if torch.float64 in (real.dtype, fake.dtype) else torch.float32
    real, fake = real.to(dtype), fake.to(dtype)
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise PixditError(
            f"precision_recall: features must be [n, d] with the same d, got {tuple(real.shape)} and "
            f"{tuple(fake.shape)} (the reference features must come from the same network)"
        )
    real_radii, fake_radii = knn_radii(real, k), knn_radii(fake, k)
    return _fraction_inside(fake, real, real_radii), _fraction_inside(real, fake, fake_radii)
