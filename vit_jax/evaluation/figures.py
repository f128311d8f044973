"""The paper's analyses of a checkpoint as figures and numbers (Figure 7, Appendix D.7-D.8).

`compute` gathers the numbers (`vit_jax.evaluation.analysis`) for a loaded
checkpoint and a batch of images; `write_outputs` draws them and writes
`analysis.json`. `python -m vit_jax.analyze` is the command line.
"""

import json
import os
from typing import List, Optional
import warnings

import jax
import numpy as np

from vit_jax.core import files
from vit_jax.evaluation import analysis
from vit_jax.evaluation import loader

_BATCH = 8


def attention_weights(loaded: loader.LoadedModel, images: np.ndarray) -> List[np.ndarray]:
  """Per layer, first to last: [B, heads, T, T] attention weights."""
  return _attention(loaded, images)[0]


def _attention(loaded: loader.LoadedModel, images: np.ndarray):
  """(per layer [B, heads, T, T], the MAP head's probe attention [B, heads, 1, T] or None)."""
  model = loaded.model.clone(num_classes=None)
  params = {k: v for k, v in loaded.params.items() if k != 'head'}

  @jax.jit
  def sow(params, x):
    _, state = model.apply({'params': params}, x, train=False, mutable=['intermediates'])
    blocks = state['intermediates']['Transformer']
    layers = [
      blocks[f'encoderblock_{i}']['MultiHeadDotProductAttention_1']['attention_weights'][0]
      for i in range(len(blocks))
    ]
    head = state['intermediates'].get('MAPHead_0')
    return layers + (
      [head['MultiHeadDotProductAttention_0']['attention_weights'][0]] if head else []
    )

  per_batch = [sow(params, images[i : i + _BATCH]) for i in range(0, len(images), _BATCH)]
  stacked = [
    np.concatenate([np.asarray(b[i], np.float32) for b in per_batch])
    for i in range(len(per_batch[0]))
  ]
  if 'MAPHead_0' in params:
    return stacked[:-1], stacked[-1]
  return stacked, None


def compute(loaded: loader.LoadedModel, images: np.ndarray, num_components: int) -> dict:
  """Every analysis as numpy arrays (None where it does not apply)."""
  g = loaded.spec.grid
  attentions, probe = _attention(loaded, images)
  distances = np.stack(
    [
      analysis.mean_attention_distance(a, (g, g), loaded.spec.stride, loaded.spec.num_prefix_tokens)
      for a in attentions
    ]
  )
  readout = None if probe is None else probe.mean(axis=1)[:, 0]  # heads averaged
  rollout = analysis.rollout_maps(
    analysis.attention_rollout(attentions), (g, g), loaded.spec.num_prefix_tokens, readout
  )
  posemb = np.asarray(loaded.params['Transformer']['posembed_input']['pos_embedding'])
  # A NaFlex ViT's are a grid of their own [1, rows, columns, D], the prefix tokens without any;
  # a 1D table has rows for the prefix tokens unless they have none (posemb='patches').
  embedded = loaded.spec.posemb_prefix
  table, prefix = ((g, g), embedded) if posemb.ndim == 3 else (posemb.shape[1:3], 0)
  kernel = np.asarray(loaded.params['embedding']['kernel'])
  components = ratio = None
  if kernel.shape[2] == 3:  # hybrids embed ResNet features, not RGB pixels
    components, ratio = analysis.embedding_filter_components(kernel, num_components)
  return {
    'attention_distance': distances,
    'rollout': rollout,
    'posemb_similarity': analysis.posemb_similarity(posemb, table, prefix),
    'filter_components': components,
    'filter_explained_variance': ratio,
  }


# ---------------------------------------------------------------------------
# Figures.


def _pyplot():
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  # File names in any script: a letter the font lacks is drawn as a box, not warned about.
  warnings.filterwarnings('ignore', message='Glyph .* missing from font', category=UserWarning)
  return plt


def plot_attention_distance(distances: np.ndarray, title: str, path: str) -> None:
  plt = _pyplot()
  num_layers, num_heads = distances.shape
  fig, ax = plt.subplots(figsize=(5.2, 4.2))
  colours = plt.get_cmap('tab20' if num_heads > 10 else 'tab10')
  depth = np.arange(1, num_layers + 1)
  for h in range(num_heads):
    ax.scatter(depth, distances[:, h], s=14, color=colours(h % colours.N), label=f'Head {h + 1}')
  ax.set_xlabel('Network depth (layer)')
  ax.set_ylabel('Mean attention distance (pixels)')
  ax.set_title(title)
  ax.set_ylim(0, 1.1 * max(float(distances.max()), 1e-6))
  ax.set_xticks(depth if num_layers <= 16 else depth[::2])
  ax.grid(alpha=0.3)
  if num_heads <= 16:
    ax.legend(loc='center left', bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
  fig.savefig(path, dpi=150, bbox_inches='tight')
  plt.close(fig)


def _mosaic(tiles: np.ndarray, columns: int, gap: int = 1) -> np.ndarray:
  """[n, h, w, ...] tiles -> one image, `columns` per row, NaN gaps between."""
  n, h, w = tiles.shape[:3]
  rows = -(-n // columns)
  out = np.full((rows * (h + gap) - gap, columns * (w + gap) - gap, *tiles.shape[3:]), np.nan)
  for i, tile in enumerate(tiles):
    r, c = divmod(i, columns)
    out[r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = tile
  return out


def plot_posemb_similarity(similarity: np.ndarray, title: str, path: str) -> None:
  plt = _pyplot()
  g = similarity.shape[0]
  mosaic = _mosaic(similarity.reshape(g * g, g, g), columns=g)
  cmap = plt.get_cmap('viridis').with_extremes(bad='white')
  fig, ax = plt.subplots(figsize=(6.0, 5.2))
  im = ax.imshow(np.ma.masked_invalid(mosaic), cmap=cmap, vmin=-1, vmax=1, interpolation='nearest')
  centres = np.arange(g) * (g + 1) + (g - 1) / 2
  step = 1 if g <= 16 else 2
  ax.set_xticks(centres[::step], [str(i + 1) for i in range(0, g, step)], fontsize=7)
  ax.set_yticks(centres[::step], [str(i + 1) for i in range(0, g, step)], fontsize=7)
  ax.tick_params(length=0)
  ax.set_xlabel('Input patch column')
  ax.set_ylabel('Input patch row')
  ax.set_title(title)
  for spine in ax.spines.values():
    spine.set_visible(False)
  fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label='Cosine similarity')
  fig.savefig(path, dpi=150, bbox_inches='tight')
  plt.close(fig)


def plot_filters(components: np.ndarray, ratio: np.ndarray, title: str, path: str) -> None:
  plt = _pyplot()
  # Each component is shown on its own scale: its weights mapped to [0, 1].
  lo = components.min(axis=(1, 2, 3), keepdims=True)
  hi = components.max(axis=(1, 2, 3), keepdims=True)
  tiles = (components - lo) / np.maximum(hi - lo, 1e-12)
  columns = 7 if len(tiles) >= 7 else len(tiles)
  mosaic = _mosaic(tiles, columns=columns)
  fig, ax = plt.subplots(figsize=(1.0 * columns + 0.5, 1.0 * -(-len(tiles) // columns) + 0.8))
  ax.imshow(np.nan_to_num(mosaic, nan=1.0), interpolation='nearest')
  ax.set_axis_off()
  ax.set_title(
    f'{title}\nRGB embedding filters (first {len(tiles)} principal components, '
    f'{100 * ratio.sum():.0f}% of variance)',
    fontsize=9,
  )
  fig.savefig(path, dpi=150, bbox_inches='tight')
  plt.close(fig)


def _upsample(grid_map: np.ndarray, size: int) -> np.ndarray:
  from PIL import Image

  image = Image.fromarray(grid_map.astype(np.float32))  # mode F
  return np.asarray(image.resize((size, size), Image.BILINEAR))


def plot_rollout(
  images: np.ndarray, maps: np.ndarray, names: List[str], title: str, path: str
) -> None:
  plt = _pyplot()
  n, size = len(images), images.shape[1]
  fig, axes = plt.subplots(n, 3, figsize=(8.4, 2.45 * n + 0.7), squeeze=False)
  for row, (image, grid_map, name) in enumerate(zip(images, maps, names)):
    pixels = (image + 1) / 2
    heat = _upsample(grid_map / max(grid_map.max(), 1e-12), size)
    axes[row, 0].imshow(pixels)
    axes[row, 0].set_ylabel(files.text(os.path.basename(name)), fontsize=8)
    axes[row, 1].imshow(pixels)
    axes[row, 1].imshow(heat, cmap='inferno', alpha=0.6, vmin=0, vmax=1)
    axes[row, 2].imshow(pixels * heat[..., None])
    for ax in axes[row]:
      ax.set_xticks([])
      ax.set_yticks([])
  for ax, heading in zip(axes[0], ('Input', 'Attention rollout', 'Input x attention')):
    ax.set_title(heading, fontsize=10)
  colours = plt.cm.ScalarMappable(plt.Normalize(0, 1), 'inferno')
  fig.colorbar(
    colours,
    ax=axes.ravel().tolist(),
    shrink=min(0.8, 1.6 / n),
    pad=0.02,
    label='Attention rollout (fraction of the image maximum)',
  )
  fig.suptitle(title)
  fig.savefig(path, dpi=120, bbox_inches='tight')
  plt.close(fig)


# ---------------------------------------------------------------------------
# Command line.


def _rounded(x) -> Optional[list]:
  return None if x is None else np.round(np.asarray(x, np.float64), 6).tolist()


def test_digits(size: int, count: int = 4):
  """(names, [count, size, size, 3] in [-1, 1]): the first test digits of the demo's dataset,
  as its evaluation pipeline gives them."""
  from vit_jax.data import images
  from vit_jax.data.readers import builtin

  pixels, labels = builtin.load_digits()
  index = builtin.digits_split_indices()[1][:count]
  names = [f'test digit #{i} (a {labels[i]})' for i in index]
  return names, images.to_float(images.eval_array(pixels[index], size))


def write_outputs(
  result: dict, loaded: loader.LoadedModel, images: np.ndarray, names: List[str], args
) -> List[str]:
  os.makedirs(args.output, exist_ok=True)
  out = lambda name: os.path.join(args.output, name)
  model = loaded.spec.architecture.name or args.model
  title = f'{model} ({loaded.spec.image_size}x{loaded.spec.image_size})'
  written = []
  plot_attention_distance(result['attention_distance'], title, out('attention_distance.png'))
  plot_rollout(images, result['rollout'], names, title, out('attention_rollout.png'))
  plot_posemb_similarity(
    result['posemb_similarity'],
    f'{title}\nPosition embedding similarity',
    out('posemb_similarity.png'),
  )
  written += ['attention_distance.png', 'attention_rollout.png', 'posemb_similarity.png']
  if result['filter_components'] is not None:
    plot_filters(
      result['filter_components'],
      result['filter_explained_variance'],
      title,
      out('embedding_filters.png'),
    )
    written.append('embedding_filters.png')

  distances = result['attention_distance']
  summary = {
    'checkpoint': files.text(args.checkpoint),
    'model': model,
    'image_size': loaded.spec.image_size,
    'patch_grid': [loaded.spec.grid, loaded.spec.grid],
    'pixels_per_patch': loaded.spec.stride,
    'images': [files.text(name) for name in names],
    'mean_attention_distance': {
      'about': 'pixels; [layer][head], mean over images and query patches; class token '
      "excluded, each query's attention over patches renormalised",
      'per_layer_head': _rounded(distances),
      'per_layer_mean': _rounded(distances.mean(axis=1)),
    },
    'attention_rollout': {
      'about': '[image][row][col]: rollout of the token the classifier reads onto the patches',
      'maps': _rounded(result['rollout']),
    },
    'posemb_similarity': {
      'about': '[row][col][row][col] cosine similarity of patch position embeddings',
      'values': _rounded(result['posemb_similarity']),
    },
    'embedding_filters': None
    if result['filter_components'] is None
    else {
      'about': '[component][y][x][rgb], centred PCA of the embedding filters',
      'explained_variance_ratio': _rounded(result['filter_explained_variance']),
      'components': _rounded(result['filter_components']),
    },
  }
  with open(out('analysis.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f)
  return written + ['analysis.json']
