"""The losses of self-distillation as DINOv2 computes them, on whole global batches.

- The teacher's targets, from its head's logits at temperature T: Sinkhorn-Knopp (DINOv2,
  from SwAV, Caron et al. 2020: three rounds balancing the prototypes over the batch), or a
  softmax after subtracting a running centre of the teacher's logits (DINO, Caron et al.
  2021; the centre moves by `centre_momentum` per step).
- The DINO loss: the cross-entropy between the teacher's targets of one view and the
  student's softmax at `student_temp` of another view of the same image, averaged over every
  (student view, teacher view) pair of different views: each global crop against the other
  global crop, each local crop against both.
- iBOT's loss (Zhou et al. 2022): the same cross-entropy between teacher and student on the
  patches masked in the student's global crops, averaged over each crop's masked patches,
  then over crops.
- KoLeo (Sablayrolles et al. 2019): -mean log of each feature's distance to its nearest
  neighbour in the batch, on L2-normalised features, spreading them apart.

Every function takes global arrays: under a mesh a sum over the batch is a sum over all
devices, which DINOv2 writes as all-reduces. Where DINOv2 packs the masked patches of a batch
into one list, these take a fixed number of slots per crop with a `valid` mask, so every
shape is static; an invalid slot counts nowhere.
"""

import jax
import jax.numpy as jnp


def sinkhorn_knopp(logits, temp, valid=None, iterations: int = 3):
  """Targets [..., K] of `logits` [..., K]: exp(logits / temp) scaled so that, over the valid
  rows, every prototype gets equal mass and every row sums to one (DINOv2's
  `sinkhorn_knopp_teacher`). `valid` ([...] bool): rows that count (others come out zero)."""
  shape = logits.shape
  x = logits.reshape(-1, shape[-1]).astype(jnp.float32) / temp
  w = jnp.ones(x.shape[0], jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
  # The largest valid logit out before exp, for range; every later step normalises it away.
  top = jnp.max(jnp.where(w[:, None] > 0, x, -jnp.inf))
  q = jnp.exp(x - jnp.where(jnp.isfinite(top), top, 0.0)) * w[:, None]
  rows, prototypes = jnp.sum(w), shape[-1]
  q = q / jnp.sum(q)
  safe = lambda s: jnp.where(s > 0, s, 1.0)
  for _ in range(iterations):
    q = q / safe(jnp.sum(q, axis=0, keepdims=True)) / prototypes  # each prototype: 1 / K
    q = q / safe(jnp.sum(q, axis=1, keepdims=True)) / rows  # each row: 1 / rows
  return (q * rows).reshape(shape)


def centred_softmax(logits, centre, temp):
  """DINO's targets: softmax((logits - centre) / temp) over the prototypes."""
  return jax.nn.softmax((logits.astype(jnp.float32) - centre) / temp, axis=-1)


def updated_centre(centre, logits, momentum, valid=None):
  """The running centre [K] after a batch: momentum * centre + (1 - momentum) * the mean of the
  valid rows of `logits` [..., K] (unchanged when none is valid)."""
  x = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
  w = jnp.ones(x.shape[0], jnp.float32) if valid is None else valid.reshape(-1).astype(jnp.float32)
  count = jnp.sum(w)
  mean = jnp.sum(x * w[:, None], axis=0) / jnp.maximum(count, 1.0)
  return jnp.where(count > 0, momentum * centre + (1.0 - momentum) * mean, centre)


def cross_entropy(targets, student_logits, student_temp):
  """-sum targets * log_softmax(student_logits / student_temp) over the last axis."""
  log_probs = jax.nn.log_softmax(student_logits.astype(jnp.float32) / student_temp, axis=-1)
  return -jnp.sum(targets * log_probs, axis=-1)


def dino_loss(teacher_targets, student_logits, student_temp):
  """The mean cross-entropy over every (student view, teacher view) pair of different views.

  Args:
    teacher_targets: [B, Vt, K], the teacher's views (the global crops).
    student_logits: [B, Vs, K], the student's views, whose first Vt are the teacher's views
      (pairs of the same view do not count).
    student_temp: the student's temperature.
  """
  batch, views_t = teacher_targets.shape[:2]
  views_s = student_logits.shape[1]
  log_probs = jax.nn.log_softmax(student_logits.astype(jnp.float32) / student_temp, axis=-1)
  pairs = -jnp.einsum('btk,bsk->ts', teacher_targets, log_probs) / batch
  different = jnp.arange(views_t)[:, None] != jnp.arange(views_s)[None, :]
  return jnp.sum(jnp.where(different, pairs, 0.0)) / jnp.sum(different)


def ibot_loss(teacher_targets, student_logits, valid, student_temp):
  """iBOT's loss: per crop the mean cross-entropy over its masked patches (its valid slots),
  summed over crops and divided by their number (crops without masks count as zero).

  Args:
    teacher_targets, student_logits: [B, C, S, K] at each crop's S slots.
    valid: [B, C, S] bool, the slots that hold masked patches.
  """
  weight = valid.astype(jnp.float32)
  per_slot = cross_entropy(teacher_targets, student_logits, student_temp) * weight
  per_crop = jnp.sum(per_slot, axis=-1) / jnp.maximum(jnp.sum(weight, axis=-1), 1.0)
  return jnp.mean(per_crop)


def koleo_loss(features, eps: float = 1e-8):
  """KoLeo of features [N, D]: -mean log(|x - nearest other x + eps| + eps) of the
  L2-normalised rows (torch's `pairwise_distance` adds eps to the difference)."""
  x = features.astype(jnp.float32)
  x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)
  dots = x @ x.T
  n = x.shape[0]
  dots = jnp.where(jnp.eye(n, dtype=bool), -1.0, dots)
  nearest = jnp.argmax(jax.lax.stop_gradient(dots), axis=1)
  distance = jnp.linalg.norm(x - x[nearest] + eps, axis=-1)
  return -jnp.mean(jnp.log(distance + eps))


def entropy(probs, valid=None):
  """Mean entropy (nats) of the distributions `probs` [..., K] (of the valid rows)."""
  h = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
  if valid is None:
    return jnp.mean(h)
  w = valid.astype(jnp.float32)
  return jnp.sum(h * w) / jnp.maximum(jnp.sum(w), 1.0)


def prototype_usage(probs):
  """exp(entropy of the batch's mean distribution) / K: 1 when the batch uses every prototype
  alike, 1 / K when it uses one (a collapse)."""
  mean = jnp.mean(probs.reshape(-1, probs.shape[-1]), axis=0)
  return jnp.exp(entropy(mean)) / probs.shape[-1]


def feature_spread(features):
  """The standard deviation over the batch of L2-normalised features [N, D], averaged over
  dimensions and scaled by sqrt(D): about 1 for features spread over the sphere, 0 when every
  image maps to one point."""
  x = features.astype(jnp.float32)
  x = x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  return jnp.mean(jnp.std(x, axis=0)) * jnp.sqrt(jnp.float32(x.shape[-1]))
