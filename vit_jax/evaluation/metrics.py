"""Exact accuracy: per-batch counts on the devices, summed on the host, then divided.

Padded examples (mask 0) are never counted, so every example of a split
counts exactly once whatever the batch size and device count.
"""

import jax
import jax.numpy as jnp
import numpy as np


def classification_counts(logits, labels, mask, multi_label: bool) -> dict:
  """Correct top-1 (and top-5) predictions among real (unmasked) examples.

  Multi-label data counts precision@1: the top class is one of the labels.
  """
  top1 = jnp.argmax(logits, axis=-1)
  if multi_label:
    correct = jnp.take_along_axis(labels, top1[:, None], axis=-1)[:, 0] > 0
    return {'correct': jnp.sum(correct * mask), 'count': jnp.sum(mask)}
  counts = {'correct': jnp.sum((top1 == labels) * mask), 'count': jnp.sum(mask)}
  if logits.shape[-1] >= 5:
    top5 = jax.lax.top_k(logits, 5)[1]
    counts['correct_top5'] = jnp.sum(jnp.any(top5 == labels[:, None], axis=-1) * mask)
  return counts


def accuracy(eval_fn, params, batches) -> dict:
  """Exact accuracy over `batches`: `eval_fn`'s counts summed, then divided.

  Returns {'accuracy', 'examples'} and 'accuracy_top5' when `eval_fn` counts it.
  """
  sums = {}
  for batch in batches:
    for key, value in eval_fn(params, batch).items():
      sums[key] = sums.get(key, 0.0) + float(value)
  count = max(sums.get('count', 0.0), 1.0)
  result = {'accuracy': sums.get('correct', 0.0) / count, 'examples': int(sums.get('count', 0))}
  if 'correct_top5' in sums:
    result['accuracy_top5'] = sums['correct_top5'] / count
  return result


def top_k(logits: np.ndarray, k: int) -> tuple:
  """(indices [B, k], softmax probabilities [B, k]), best first."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
  probs /= probs.sum(axis=-1, keepdims=True)
  idx = np.argsort(-logits, axis=-1, kind='stable')[:, :k]
  return idx, np.take_along_axis(probs, idx, axis=-1)
