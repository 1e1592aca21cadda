"""Fréchet distance, streaming statistics and Inception Score against closed forms / independent computations."""

import numpy as np
import pytest
import torch

from pixdit.errors import PixditError
from pixdit.eval import FeatureStatistics, frechet_distance, inception_score, kernel_inception_distance
from pixdit.eval import stats as stats_module
from pixdit.eval.stats import precision_recall


def test_frechet_distance_diagonal_closed_form():
    # Commuting (diagonal) covariances: tr sqrt(S1 S2) = sum sqrt(a_i b_i), so d² = |dmu|² + sum (sqrt a - sqrt b)².
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.1, 3.0, 16), rng.uniform(0.1, 3.0, 16)
    mu1, mu2 = rng.normal(size=16), rng.normal(size=16)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-10)


def test_frechet_distance_2x2_non_commuting_closed_form():
    # For a 2x2 matrix M with real non-negative eigenvalues: tr sqrt(M) = sqrt(tr M + 2 sqrt(det M)).
    s1 = np.array([[2.0, 0.7], [0.7, 1.0]])
    s2 = np.array([[1.0, -0.4], [-0.4, 3.0]])
    product = s1 @ s2
    trace_sqrt = np.sqrt(np.trace(product) + 2 * np.sqrt(np.linalg.det(product)))
    expected = 0.5**2 + np.trace(s1) + np.trace(s2) - 2 * trace_sqrt
    assert frechet_distance([0.5, 0.0], s1, [0.0, 0.0], s2) == pytest.approx(expected, rel=1e-10)


def test_frechet_distance_near_singular_covariances():
    # Rank-deficient covariances (fewer samples than dimensions), as in a small FID run.
    rng = np.random.default_rng(1)
    basis = rng.normal(size=(64, 3))
    sigma = basis @ basis.T  # rank 3 in 64 dimensions
    mu1, mu2 = rng.normal(size=64), rng.normal(size=64)
    # Same covariance: the trace terms cancel exactly, only the mean term is left.
    assert frechet_distance(mu1, sigma, mu2, sigma) == pytest.approx(np.sum((mu1 - mu2) ** 2), rel=1e-6)
    # Diagonal with zeros plus tiny eigenvalues (near-singular): closed form of the commuting case.
    a = np.concatenate([np.zeros(8), np.full(8, 1e-12), rng.uniform(0.5, 2, 48)])
    b = np.concatenate([np.full(8, 1e-12), np.zeros(8), rng.uniform(0.5, 2, 48)])
    rotation, _ = np.linalg.qr(rng.normal(size=(64, 64)))  # rotate both: no longer diagonal, distance unchanged
    expected = np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    result = frechet_distance(mu1, rotation @ np.diag(a) @ rotation.T, mu1, rotation @ np.diag(b) @ rotation.T)
    assert np.isfinite(result) and result == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # Dimensions with no variance in either set (exact zeros) change nothing but the mean term.
    padded = [
        np.pad(m, ((0, 5), (0, 5))) for m in (rotation @ np.diag(a) @ rotation.T, rotation @ np.diag(b) @ rotation.T)
    ]
    mu_shift = np.concatenate([mu1, np.full(5, 0.5)])
    assert frechet_distance(mu_shift, padded[0], np.pad(mu1, (0, 5)), padded[1]) == pytest.approx(result + 5 * 0.25)


def test_frechet_distance_matches_cleanfid_on_well_conditioned_input():
    from cleanfid.fid import frechet_distance as cleanfid_frechet

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(500, 32)), rng.normal(size=(500, 32)) @ rng.normal(size=(32, 32)) * 0.3 + 0.2
    args = (x.mean(0), np.cov(x, rowvar=False), y.mean(0), np.cov(y, rowvar=False))
    ours = frechet_distance(args[0], args[1], args[2], args[3])
    assert ours == pytest.approx(cleanfid_frechet(args[0], args[1], args[2], args[3]), rel=1e-8)


def test_frechet_distance_shape_mismatch_is_a_user_error():
    with pytest.raises(PixditError, match="shapes do not match"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_streaming_statistics_equal_numpy_and_merge_across_simulated_ranks():
    rng = np.random.default_rng(3)
    features = torch.from_numpy(rng.normal(size=(103, 16)) * 2 + 5).float()
    single = FeatureStatistics(16)
    for chunk in features.split(10):
        single.update(chunk)
    mu, sigma = single.mean_and_covariance()
    np.testing.assert_allclose(mu, features.double().numpy().mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(features.double().numpy(), rowvar=False), rtol=1e-9, atol=1e-12)
    # Two ranks with uneven shares (strided like the sampler: rank r takes r, r+2, ...; then one short batch).
    rank0, rank1 = FeatureStatistics(16), FeatureStatistics(16)
    rank0.update(features[0::2])
    for chunk in features[1::2].split(7):
        rank1.update(chunk)
    merged_mu, merged_sigma = rank0.merge(rank1).mean_and_covariance()
    np.testing.assert_allclose(merged_mu, mu, rtol=1e-12)
    np.testing.assert_allclose(merged_sigma, sigma, rtol=1e-9, atol=1e-12)


def test_inception_score_known_answers():
    classes = 10
    one_hot = torch.eye(classes).repeat(20, 1)  # 200 confident predictions, every split covers all classes equally
    mean, std = inception_score(one_hot, num_splits=10)
    assert mean == pytest.approx(classes) and std == pytest.approx(0.0, abs=1e-12)
    uniform = torch.full((200, classes), 1.0 / classes)
    assert inception_score(uniform, num_splits=10)[0] == pytest.approx(1.0)
    # Per-split scores differ -> std is the std over splits (first half of splits: 2 classes, second half: 5).
    two = torch.eye(classes)[torch.arange(100) % 2]
    five = torch.eye(classes)[torch.arange(100) % 5]
    mean, std = inception_score(torch.cat([two, five]), num_splits=10)
    assert mean == pytest.approx(3.5) and std == pytest.approx(1.5)
    with pytest.raises(PixditError, match="num_splits"):
        inception_score(uniform[:5], num_splits=10)
    with pytest.raises(PixditError, match=r"num_splits \(eval.inception_splits\) must be >= 1, got 0"):
        inception_score(uniform, num_splits=0)  # was nan (mean of no splits)


def test_kid_is_reproducible_and_near_zero_for_same_distribution():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(300, 8)), rng.normal(size=(300, 8))
    state = np.random.get_state()
    first = kernel_inception_distance(a, b, num_subsets=10, max_subset_size=100, seed=5)
    assert np.random.get_state()[1][0] == state[1][0]  # the global numpy generator is left untouched
    assert first == kernel_inception_distance(a, b, num_subsets=10, max_subset_size=100, seed=5)
    shifted = kernel_inception_distance(a, b + 3.0, num_subsets=10, max_subset_size=100, seed=5)
    assert abs(first) < 0.05 < shifted


def brute_force_precision_recall(real, fake, k):
    from scipy.spatial.distance import cdist

    def radii(x):
        return np.sort(cdist(x, x, "sqeuclidean"), axis=1)[:, k]  # column 0 is the point itself

    precision = (cdist(fake, real, "sqeuclidean") <= radii(real)[None]).any(axis=1).mean()
    recall = (cdist(real, fake, "sqeuclidean") <= radii(fake)[None]).any(axis=1).mean()
    return precision, recall


@pytest.mark.parametrize("block_elements", [2**27, 37])  # one block, and many small row blocks
def test_precision_recall_equals_brute_force(monkeypatch, block_elements):
    monkeypatch.setattr(stats_module, "DISTANCE_BLOCK_ELEMENTS", block_elements)
    rng = np.random.default_rng(5)
    real = rng.normal(size=(120, 16))
    fake = rng.normal(size=(90, 16)) * 0.6 + 0.4  # narrower and shifted: precision and recall both below 1
    expected = brute_force_precision_recall(real, fake, 3)
    assert 0.05 < expected[0] < 0.99 and 0.05 < expected[1] < 0.99
    result = precision_recall(torch.from_numpy(real), torch.from_numpy(fake), k=3)
    assert result == pytest.approx(expected, abs=1e-12)
    result32 = precision_recall(torch.from_numpy(real).float(), torch.from_numpy(fake).float(), k=3)
    assert result32 == pytest.approx(expected, abs=2 / 90)  # float32 may flip a point on a ball's boundary


def test_precision_recall_known_answers():
    rng = np.random.default_rng(6)
    real = torch.from_numpy(rng.normal(size=(200, 8)))
    assert precision_recall(real, real.clone()) == (1.0, 1.0)  # same set: every point is inside its own ball
    assert precision_recall(real, real + 100.0) == (0.0, 0.0)  # far apart: neither covers the other
    # Mode collapse: fakes are copies of a few real points -> all realistic (precision 1), little coverage
    collapsed = real[:5].repeat(40, 1)
    precision, recall = precision_recall(real, collapsed)
    assert precision == 1.0 and recall < 0.2
    with pytest.raises(PixditError, match="k=3 needs more than 3"):
        precision_recall(real[:3], real)
