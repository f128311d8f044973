"""Analyses on hand-built attention, embeddings and filters with known answers."""

import itertools
import math

import numpy as np
import pytest
from sklearn.decomposition import PCA

from vit_jax.evaluation import analysis


def with_class_token(patch_attention, to_class=0.0):
  """[..., N, N] patch attention -> [..., N+1, N+1], `to_class` of each row on the class token."""
  *lead, n, _ = patch_attention.shape
  out = np.zeros((*lead, n + 1, n + 1))
  out[..., 1:, 1:] = patch_attention * (1 - to_class)
  out[..., 1:, 0] = to_class
  out[..., 0, :] = 1.0 / (n + 1)
  return out


def test_one_hot_attention_to_a_known_patch():
  # 4x4 grid of 16 px patches; head 0 looks at patch (0, 0), head 1 at itself.
  g, p = 4, 16
  to_corner = np.zeros((g * g, g * g))
  to_corner[:, 0] = 1.0
  attention = with_class_token(np.stack([to_corner, np.eye(g * g)]), to_class=0.3)
  got = analysis.mean_attention_distance(attention, (g, g), p)
  expected = np.mean([p * math.hypot(i, j) for i in range(g) for j in range(g)])
  np.testing.assert_allclose(got, [expected, 0.0], rtol=1e-12)
  # The class token's own row does not count.
  attention[..., 0, :] = 0.0
  attention[..., 0, -1] = 1.0
  np.testing.assert_allclose(analysis.mean_attention_distance(attention, (g, g), p), got)


def test_one_hot_attention_to_the_right_neighbour():
  # Every query of a 3x3 grid (no class token) attends to the patch 2 columns
  # right, wrapping around: column 0 -> 2 (2 patches away), 1 -> 0 and 2 -> 1
  # (1 away). So 3 queries at 2p and 6 at p.
  g, p = 3, 10
  attention = np.zeros((1, g * g, g * g))
  for r, c in itertools.product(range(g), range(g)):
    attention[0, r * g + c, r * g + (c + 2) % g] = 1.0
  got = analysis.mean_attention_distance(attention, (g, g), p, num_prefix_tokens=0)
  np.testing.assert_allclose(got, [(3 * 2 * p + 6 * p) / 9])


def test_uniform_attention_gives_the_mean_pairwise_distance():
  g, p = 5, 8
  centres = [(p * (i + 0.5), p * (j + 0.5)) for i in range(g) for j in range(g)]
  pairwise = np.mean([math.dist(a, b) for a in centres for b in centres])
  uniform = np.full((2, 3, g * g + 1, g * g + 1), 1 / (g * g + 1))  # batch 2, 3 heads
  got = analysis.mean_attention_distance(uniform, (g, g), p)
  np.testing.assert_allclose(got, [pairwise] * 3, rtol=1e-12)
  # 1x2 grid: each query gives half its weight to the other patch, p away.
  np.testing.assert_allclose(
    analysis.mean_attention_distance(np.full((1, 2, 2), 0.5), (1, 2), p, 0), [p / 2]
  )
  with pytest.raises(ValueError, match=r'does not fit 1 prefix tokens \+ a 4x4 patch grid'):
    analysis.mean_attention_distance(uniform, (4, 4), p)


def test_rollout_of_identity_layers_keeps_every_token_in_place():
  n = 1 + 9
  eye = np.broadcast_to(np.eye(n), (2, 4, n, n))
  rollout = analysis.attention_rollout([eye] * 3)
  np.testing.assert_allclose(rollout, np.broadcast_to(np.eye(n), (2, n, n)))
  np.testing.assert_allclose(analysis.rollout_maps(rollout, (3, 3)), np.zeros((2, 3, 3)))


@pytest.mark.parametrize('num_layers', [1, 2, 5])
def test_rollout_of_uniform_layers(num_layers):
  # A = (U + I) / 2 with U the uniform matrix (U @ U = U), so
  # A^L = U + 2^-L (I - U).
  n = 1 + 4
  uniform = np.full((1, 2, n, n), 1 / n)
  rollout = analysis.attention_rollout([uniform] * num_layers)[0]
  u = np.full((n, n), 1 / n)
  np.testing.assert_allclose(rollout, u + 2.0**-num_layers * (np.eye(n) - u), rtol=1e-12)
  m = analysis.rollout_maps(rollout[None], (2, 2))
  np.testing.assert_allclose(m, np.full((1, 2, 2), (1 - 2.0**-num_layers) / n))


def test_rollout_averages_heads_and_multiplies_later_layers_on_the_left():
  # Layer 1: head 0 sends token 0 -> 1 entirely, head 1 keeps token 0 in place.
  # Layer 2: token 0 attends to token 2.
  n = 3
  l1 = np.stack([np.eye(n)[[1, 1, 2]], np.eye(n)])  # [heads, T, T]
  l2 = np.stack([np.eye(n)[[2, 1, 2]]] * 2)
  a1 = (l1.mean(0) + np.eye(n)) / 2
  a2 = (l2.mean(0) + np.eye(n)) / 2
  np.testing.assert_allclose(analysis.attention_rollout([l1, l2]), a2 @ a1)
  # Token 0 after two layers: 1/2 kept through layer 2 (of which 3/4 stayed
  # at 0 in layer 1 and 1/4 came from 1), 1/2 from token 2.
  np.testing.assert_allclose((a2 @ a1)[0], [3 / 8, 1 / 8, 1 / 2])
  # Without a class token the map averages the rows.
  np.testing.assert_allclose(analysis.rollout_maps(a2 @ a1, (1, 3), 0), (a2 @ a1).mean(0)[None])


def test_posemb_similarity_of_row_and_column_codes():
  # Embedding of patch (i, j) = one-hot(i) ++ one-hot(j): cosine similarity is
  # ([i == k] + [j == l]) / 2.
  rows, cols = 3, 4
  posemb = np.zeros((1, 1 + rows * cols, rows + cols))
  posemb[0, 0] = 5.0  # class token: ignored
  for i, j in itertools.product(range(rows), range(cols)):
    posemb[0, 1 + i * cols + j, [i, rows + j]] = [2.0, 2.0]
  sim = analysis.posemb_similarity(posemb, (rows, cols))
  assert sim.shape == (rows, cols, rows, cols)
  for i, j, k, l in itertools.product(range(rows), range(cols), range(rows), range(cols)):
    assert sim[i, j, k, l] == pytest.approx(((i == k) + (j == l)) / 2)


def test_filter_components_match_sklearn_pca():
  rng = np.random.default_rng(0)
  p, d = 4, 64
  a = rng.normal(size=(p, p, 3))
  b = rng.normal(size=(p, p, 3))
  # Filters = mean + 5 x (coefficient) a + 1 x (coefficient) b + small noise.
  coeffs = rng.normal(size=(2, d)) * np.array([[5.0], [1.0]])
  kernel = (
    0.3
    + np.einsum('hwc,d->hwcd', a, coeffs[0])
    + np.einsum('hwc,d->hwcd', b, coeffs[1])
    + 0.01 * rng.normal(size=(p, p, 3, d))
  )
  components, ratio = analysis.embedding_filter_components(kernel, num_components=5)
  assert components.shape == (5, p, p, 3)
  reference = PCA(n_components=5).fit(kernel.reshape(-1, d).T)
  for ours, theirs in zip(components.reshape(5, -1), reference.components_):
    np.testing.assert_allclose(abs(ours @ theirs), 1.0, rtol=1e-8)
  np.testing.assert_allclose(ratio, reference.explained_variance_ratio_, rtol=1e-8)
  # The first component is the high-variance pattern `a` (up to sign and scale).
  cosine = components[0].ravel() @ a.ravel() / np.linalg.norm(a)
  assert abs(cosine) > 0.99
  assert ratio[0] > 0.9
  # Sign convention: the largest-magnitude weight is positive.
  flat = components.reshape(5, -1)
  assert (flat[np.arange(5), np.abs(flat).argmax(1)] > 0).all()
