"""The model a checkpoint holds: what predict, evaluate, fewshot, analyze and export load.

`load_model` builds the `VisionTransformer` that a `.npz` (or a workdir's
`params.npz`) holds: the head size and pre-logits width come from the file,
the resolution from its position embeddings, the model name from --model or
the workdir (`vit_jax.workdir.recorded`). Errors a user can cause raise
`checkpoint.CheckpointError` or `InputError`, each one line; the commands
print them without a traceback (`vit_jax.core.cli`).
"""

import math
import os
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import workdir
from vit_jax.configs import architectures
from vit_jax.core.errors import UserError
from vit_jax.models import flexi
from vit_jax.models import naflex
from vit_jax.models import vit_checkpoint

_BLOCK = re.compile(r'^Transformer/encoderblock_(\d+)/')
# Layers of masked patch prediction (vit_jax.models.mpp); the backbone is analysed without them.
_MPP_ONLY = ('mask_token', 'mpp_head/')


class InputError(UserError, ValueError):
  """A bad command-line input (model name, image, label file); one line."""


class LoadedModel(NamedTuple):
  model: models.VisionTransformer
  params: Any
  config: Any  # the MODEL_CONFIGS entry, with the checkpoint's representation_size
  image_size: int
  grid_size: int  # patches per side
  pixels_per_patch: int  # input pixels per patch step (the backbone stride for hybrids)
  num_prefix_tokens: int


def pixels_per_patch(config) -> int:
  """Input pixels per token step: the patch size, times the ResNet's stride for hybrids."""
  patch = config.patches.size[0]
  if config.get('resnet') is not None:
    # Root conv /2 and max-pool /2, then /2 in every stage after the first
    # (R+ViT-Ti_16 has the root only).
    return patch * 4 * 2 ** max(len(config.resnet.num_layers) - 1, 0)
  return patch


def model_config(model_name: str):
  """A fresh MODEL_CONFIGS entry; InputError naming close matches for a wrong name."""
  try:
    return architectures.MODEL_CONFIGS[model_name]
  except KeyError as e:
    raise InputError(f'--model: {e.args[0]}') from None


def resolve_model_name(name: Optional[str], path: str, metadata: Optional[dict] = None) -> str:
  """`name`, else the one the checkpoint records (a workdir's summary, file metadata)."""
  path = os.fspath(path)
  name = name or (metadata or {}).get('vit_jax_model') or workdir.recorded(path, 'model')
  if not name:
    raise InputError(
      f'{path}: pass --model (a vit_jax.configs.architectures.MODEL_CONFIGS name such as '
      'ViT-B_16); only a training workdir records its model'
    )
  return name


def load_model(
  path: str,
  model_name: Optional[str] = None,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
) -> LoadedModel:
  """The model a checkpoint holds, checked key by key and shape by shape.

  Args:
    path: a `.npz`, or a workdir holding its final parameters (local or gs://).
    model_name: a `MODEL_CONFIGS` name (`ViT-B_16`, `testing`, ...); None
      for a workdir, whose summary names it.
    patch_size: load it at this patch size (FlexiViT's PI-resize, `models.flexi`),
      at the checkpoint's resolution; None: its own.
    resample: see `model_from_flat`; None: a NaFlex run's own (its `naflex_resample`).
  """
  path = os.fspath(path)
  step = unfinished_run_step(path)
  if step is None:
    checkpoint.resolve(path)  # a missing file is named as such, before a missing --model
  model_name = resolve_model_name(model_name, path)
  _ = model_config(model_name)  # a wrong name fails before the file is read
  resample = resample or workdir.recorded(path, 'naflex_resample')
  if step is None:
    flat = checkpoint.flatten(checkpoint.load(path))
    return model_from_flat(flat, model_name, path, patch_size, resample)
  what = f'{path} (the checkpoint at step {step} of an unfinished run)'
  return model_from_flat(_checkpoint_params(path, step), model_name, what, patch_size, resample)


def check_resolution(loaded: LoadedModel, crop: Optional[int]) -> int:
  """`crop`, or the checkpoint's resolution when None; InputError for another one (its
  position embeddings fix the number of patches), except for NaFlex ViTs, which take
  any multiple of their patch size."""
  if crop is None or crop == loaded.image_size:
    return loaded.image_size
  if isinstance(loaded.model, naflex.NaFlexViT):
    if crop % loaded.pixels_per_patch == 0:
      return crop
    raise InputError(
      f'--crop={crop}: use a multiple of the patch size {loaded.pixels_per_patch} '
      '(the NaFlex ViT takes any)'
    )
  raise InputError(
    f'--crop={crop}: the checkpoint takes {loaded.image_size} px images (its position '
    f'embeddings hold a {loaded.grid_size}x{loaded.grid_size} patch grid); leave --crop out, '
    f'or fine-tune it at {crop} px (--config.pretrained_path resizes them)'
  )


def unfinished_run_step(path: str) -> Optional[int]:
  """The step of the newest checkpoint of a workdir whose run has no params.npz yet (stopped
  or still training), else None."""
  if not workdir.is_workdir(path) or workdir.has_params(path):
    return None
  steps = workdir.saved_steps(path)
  return steps[-1] if steps else None


def unfinished_note(path: str) -> str:
  """What `load_model(path)` reads when `path` is an unfinished run's workdir, else ''."""
  step = unfinished_run_step(os.fspath(path))
  if step is None:
    return ''
  return f'{path} has no params.npz (its run has not finished): using its checkpoint at step {step}'


def _checkpoint_params(path: str, step: int) -> dict:
  """{'a/b/c': array}: the parameters of a training checkpoint (`training.hooks`)."""
  import numpy as np
  import orbax.checkpoint as ocp

  item = os.path.join(workdir.checkpoints_dir(path, absolute=True), str(step), 'state')
  try:
    state = ocp.StandardCheckpointer().restore(item)
  except Exception as e:  # noqa: BLE001  unreadable files surface as many error types
    raise checkpoint.CheckpointError(
      f'{item}: the checkpoint does not restore ({type(e).__name__}); pass a finished run or '
      'an .npz file'
    ) from None
  return checkpoint.flatten(jax.tree.map(np.asarray, state['params']))


def _naflex_from_flat(flat, config, num_classes, what, patch_size, resample) -> LoadedModel:
  """A NaFlex ViT (2D grid of position embeddings, `models.naflex`) whose table is resampled
  to each image's grid by `resample`; at `patch_size` its kernel is PI-resized (over the
  same resize) and the grid, resampled per image anyway, kept."""
  table = flat['Transformer/posembed_input/pos_embedding']
  grid = tuple(int(g) for g in table.shape[1:3])
  registers = config.get('num_registers', 0)
  image_size = grid[0] * config.patches.size[0]
  config.posemb_resample = resample or config.get('posemb_resample', 'bilinear')
  if patch_size is not None and patch_size != config.patches.size[0]:
    size = (patch_size, patch_size)
    kernel = vit_checkpoint.resize_patch_embedding(
      flat['embedding/kernel'], size, resample or 'bilinear'
    )
    flat = {**flat, 'embedding/kernel': kernel}
    config.patches.size = size
  if config.classifier not in naflex.CLASSIFIERS:
    raise checkpoint.CheckpointError(
      f'{what} is a NaFlex ViT (2D position embeddings); {config.model_name} pools with '
      f'{config.classifier!r}, NaFlex with one of {naflex.CLASSIFIERS}: check --model'
    )
  model = naflex.NaFlexViT(num_classes=num_classes, posemb_grid=grid, **config)
  patch = config.patches.size[0]
  expected = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, patch, patch, 3)), train=False)
  )['params']
  params = checkpoint.unflatten(flat)
  checkpoint.check_tree(params, expected, what=what)
  num_prefix = (1 if config.classifier == 'token' else 0) + registers
  return LoadedModel(model, params, config, image_size, image_size // patch, patch, num_prefix)


def model_from_flat(
  flat: dict,
  model_name: str,
  what: str,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
) -> LoadedModel:
  """`load_model` for parameters already in memory ({'a/b/c': array}, public names).

  `what` names their source in errors (a path, or a converted file). A plain
  ViT's patch size is its kernel's (a run may train at another than the
  model name's: `--config.patch_size`). `resample` (`vit_checkpoint.PATCH_RESIZE`; timm's
  default 'bicubic_antialias') is how tables and kernels are resampled: at another
  `patch_size` the kernel's PI-resize and the position table's resize (None: FlexiViT's
  'bilinear' and the official 'zoom'), and a NaFlex ViT's table to each image's grid
  (None: the model's, else 'bilinear').
  """
  config = model_config(model_name)
  flat = {k: v for k, v in flat.items() if not k.startswith(_MPP_ONLY)}
  # A run with --config.depth holds fewer (or more) blocks than its model name.
  blocks = {m.group(1) for m in map(_BLOCK.match, flat) if m}
  if blocks:
    config.transformer.num_layers = len(blocks)
  kernel = flat.get('embedding/kernel')
  if config.get('resnet') is None and kernel is not None and kernel.ndim == 4:
    config.patches.size = tuple(int(n) for n in kernel.shape[:2])
  if 'pre_logits/kernel' in flat:
    config.representation_size = int(flat['pre_logits/kernel'].shape[-1])
  num_classes = int(flat['head/kernel'].shape[-1]) if 'head/kernel' in flat else None
  num_prefix = 1 if config.classifier in ('token', 'token_unpooled') else 0
  if 'registers' in flat:  # register tokens (models.vit.prepend_tokens)
    config.num_registers = int(flat['registers'].shape[1])
    num_prefix += config.num_registers

  posemb = flat.get('Transformer/posembed_input/pos_embedding')
  if posemb is not None and posemb.ndim == 4:
    return _naflex_from_flat(flat, config, num_classes, what, patch_size, resample)
  if posemb is None or posemb.ndim != 3:
    raise checkpoint.CheckpointError(
      f'{what}: no Transformer/posembed_input/pos_embedding of '
      'shape [1, tokens, width]; is it a ViT checkpoint?'
    )
  num_patches = posemb.shape[1] - num_prefix
  grid = math.isqrt(max(num_patches, 0))
  if num_patches < 1 or grid * grid != num_patches:
    raise checkpoint.CheckpointError(
      f'{what}: {posemb.shape[1]} position embeddings are not {num_prefix} class token(s) + a '
      f'square patch grid, as {model_name} (classifier={config.classifier}) needs; check --model'
    )
  stride = pixels_per_patch(config)
  image_size = grid * stride
  if patch_size is not None and patch_size != stride:
    try:
      flexi.check_patch_sizes(config, image_size, [patch_size])
    except flexi.PatchSizeError as e:
      raise InputError(f'--patch_size={patch_size}: {e}') from None
    flat = flexi.at_patch_size(
      flat, patch_size, image_size, num_prefix, resample or 'zoom', resample or 'bilinear'
    )
    config.patches.size = (patch_size, patch_size)
    stride, grid = patch_size, image_size // patch_size

  model = models.VisionTransformer(num_classes=num_classes, **config)
  expected = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, image_size, image_size, 3)), train=False)
  )['params']
  params = checkpoint.unflatten(flat)
  checkpoint.check_tree(params, expected, what=what)
  return LoadedModel(model, params, config, image_size, grid, stride, num_prefix)
