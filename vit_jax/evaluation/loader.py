"""The model a checkpoint holds: what predict, evaluate, fewshot, analyze and export load.

`load_model` builds the model that a `.npz` (or a workdir's `params.npz`)
holds: its `ModelSpec` read from the file's shapes once (`vit_checkpoint.spec_of`:
depth, patch size, pre-logits, registers, resolution; the head size too), the
model name from --model or the workdir (`vit_jax.workdir.recorded`). Errors a user can cause raise
`checkpoint.CheckpointError` or `InputError`, each one line; the commands
print them without a traceback (`vit_jax.core.cli`).
"""

import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import workdir
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.configs import timm_weights
from vit_jax.configs.model_spec import Compute
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core import cli
from vit_jax.core.errors import UserError
from vit_jax.models import flexi
from vit_jax.models import fp8 as fp8_lib
from vit_jax.models import naflex
from vit_jax.models import vit
from vit_jax.models import vit_checkpoint

# Layers of self-supervised pre-training (masked patch prediction, vit_jax.models.mpp;
# self-distillation's heads, vit_jax.models.dino); the backbone is analysed without them.
_PRETRAINING_ONLY = ('mask_token', 'mpp_head/', 'dino_head/', 'ibot_head/')


class InputError(UserError, ValueError):
  """A bad command-line input (model name, image, label file); one line."""


class LoadedModel(NamedTuple):
  """A checkpoint's model, its parameters and its `ModelSpec` (the registry entry with the
  checkpoint's shapes, at the resolution its position embeddings hold)."""

  model: Any  # a vit.VisionTransformer or naflex.NaFlexViT
  params: Any
  spec: ModelSpec
  # A family's weights: their preprocessing (`configs.timm_weights.Preprocessing`, at the
  # spec's resolution), which predict, evaluate and few-shot apply; None: the official resize.
  preprocessing: Any = None


def resolve_model_name(name: Optional[str], path: str, metadata: Optional[dict] = None) -> str:
  """`name`, else the one the checkpoint records (a workdir's summary, file metadata: a
  safetensors file's or an `.npz`'s that this package wrote, `checkpoint.read_metadata`)."""
  path = os.fspath(path)
  name = (
    name
    or (metadata or {}).get('vit_jax_model')
    or workdir.recorded(path, 'model')
    or (checkpoint.read_metadata(path).get('model') if path.endswith('.npz') else None)
  )
  if not name:
    raise InputError(
      f'{path}: records no model; pass --model naming the one it holds (a vit_jax.configs.'
      "architectures.MODEL_CONFIGS name: the paper's ViT-*, or timm's name of a family, whose "
      'GELU and input differ); a training workdir, and the .npz files it and the export write, '
      'record it'
    )
  try:
    model_spec.registered(name)
  except KeyError as e:  # an UnknownModelError, naming the closest names
    raise InputError(f'--model: {e.args[0]}') from None
  return name


def load_model(
  path: str,
  model_name: Optional[str] = None,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
  fp8: bool = False,
) -> LoadedModel:
  """The model a checkpoint holds, checked key by key and shape by shape.

  Args:
    path: a `.npz`, or a workdir holding its final parameters (local or gs://).
    model_name: a `MODEL_CONFIGS` name (`ViT-B_16`, `testing`, ...); None
      for a workdir, whose summary names it.
    patch_size: load it at this patch size (FlexiViT's PI-resize, `models.flexi`),
      at the checkpoint's resolution; None: its own.
    resample: see `model_from_flat`; None: a NaFlex run's own (its `naflex_resample`).
    fp8: for inference in bfloat16 with FP8 products (`model_from_flat`).
  """
  path = os.fspath(path)
  step = unfinished_run_step(path)
  metadata = {}
  if step is None:
    # A missing file, or a timm file to convert first, is named as such before --model is asked.
    checkpoint.refuse_torch_file(path)
    metadata = checkpoint.read_metadata(path)
  model_name = resolve_model_name(model_name, path)  # a wrong name fails before the file is read
  resample = resample or workdir.recorded(path, 'naflex_resample')
  preprocessing = recorded_preprocessing(path, metadata, model_name)
  if step is None:
    flat = checkpoint.flatten(checkpoint.load(path))
    return model_from_flat(flat, model_name, path, patch_size, resample, preprocessing, fp8)
  what = f'{path} (the checkpoint at step {step} of an unfinished run)'
  flat = _checkpoint_params(path, step)
  return model_from_flat(flat, model_name, what, patch_size, resample, preprocessing, fp8)


def recorded_preprocessing(path: str, metadata: dict, model_name: str):
  """The weights' preprocessing that a checkpoint records (`checkpoint.save_npz`'s metadata, a
  workdir's `workdir.read_preprocessing`) for `model_name`, else None. A record of another model
  than `model_name` (--model naming another) is not its."""
  record = metadata.get('preprocessing')
  if record is None and workdir.is_workdir(path):
    record = workdir.read_preprocessing(path)
  recorded_for = metadata.get('model') or workdir.recorded(path, 'model')
  if record is None or (recorded_for and recorded_for != model_name):
    return None
  return timm_weights.Preprocessing.from_json(record)


def load_from_flags(args, prog: str) -> LoadedModel:
  """The model of a command's `cli.add_checkpoint_flags` (an unfinished run's checkpoint said on
  stderr); where the command has --crop, `args.crop` becomes the resolution it runs at
  (`check_resolution`); where it has --fp8, the model runs in bfloat16 with FP8 products."""
  fp8 = bool(getattr(args, 'fp8', False))
  loaded = load_model(args.checkpoint, args.model, args.patch_size, args.resample, fp8)
  cli.note(prog, unfinished_note(args.checkpoint))
  if 'crop' in args:
    args.crop = check_resolution(loaded, args.crop)
  return loaded


def check_resolution(loaded: LoadedModel, crop: Optional[int]) -> int:
  """`crop`, or the checkpoint's resolution when None; InputError for another one (its
  position embeddings fix the number of patches), except for NaFlex ViTs, which take
  any multiple of their patch size."""
  if crop is None or crop == loaded.spec.image_size:
    return loaded.spec.image_size
  if isinstance(loaded.model, naflex.NaFlexViT):
    if crop % loaded.spec.stride == 0:
      return crop
    raise InputError(
      f'--crop={crop}: use a multiple of the patch size {loaded.spec.stride} '
      '(the NaFlex ViT takes any)'
    )
  raise InputError(
    f'--crop={crop}: the checkpoint takes {loaded.spec.image_size} px images (its position '
    f'embeddings hold a {loaded.spec.grid}x{loaded.spec.grid} patch grid); leave --crop out, '
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
  """{'a/b/c': array}: the parameters of a training checkpoint (`training.hooks`): its trained
  parameters, or a self-distillation run's teacher."""
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
  # A self-distillation run is its teacher, the EMA (what its params.npz will hold).
  evaluated = 'ema_params' if workdir.recorded(path, 'task') == 'dino' else 'params'
  return checkpoint.flatten(jax.tree.map(np.asarray, state[evaluated]))


def model_from_flat(
  flat: dict,
  model_name: str,
  what: str,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
  preprocessing=None,
  fp8: bool = False,
) -> LoadedModel:
  """`load_model` for parameters already in memory ({'a/b/c': array}, public names).

  `what` names their source in errors (a path, or a converted file). The model is what their
  shapes say (`vit_checkpoint.spec_of`: a run may train at another depth or patch size than
  its model name's). `resample` (`vit_checkpoint.PATCH_RESIZE`; timm's default 'bicubic_antialias') is how
  tables and kernels are resampled: at another `patch_size` the kernel's PI-resize and the
  position table's resize (None: FlexiViT's 'bilinear' and the official 'zoom'), and a NaFlex
  ViT's table to each image's grid (None: the model's, else 'bilinear'). `preprocessing`: the
  weights' (`configs.timm_weights.Preprocessing`) of a family's model, their statistics the
  model's input statistics and their resolution that of a model without a position table
  (None: timm's default weights' of the name); the paper's models take none. `fp8`: the model
  computes in bfloat16 with the encoder's dense layers as FP8 products (`models.fp8`), their
  kernels rounded to FP8 here, once (`fp8.quantise_params`), the activations per call.
  """
  flat = {k: v for k, v in flat.items() if not k.startswith(_PRETRAINING_ONLY)}
  # A model without a position table holds no resolution: its weights' is its.
  weights = preprocessing or (
    timm_weights.default(model_name) if model_name in families.MODELS else None
  )
  spec = vit_checkpoint.spec_of(flat, model_name, what, weights.size if weights else None)
  spec, preprocessing = with_weights(spec, preprocessing)
  if spec.naflex and resample:
    spec = spec.changed(posemb_resample=resample)
  if patch_size is not None and patch_size != spec.stride:
    try:
      flat, spec = flexi.load_at_patch_size(flat, spec, patch_size, resample)
    except flexi.PatchSizeError as e:
      raise InputError(f'--patch_size={patch_size}: {e}') from None
  num_classes = int(flat['head/kernel'].shape[-1]) if 'head/kernel' in flat else None
  compute = Compute(dtype='bfloat16', fp8=True) if fp8 else Compute()
  model = models.build(spec, num_classes, compute)
  size = spec.patch_size if spec.naflex else spec.image_size
  expected = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )['params']
  params = checkpoint.unflatten(flat)
  checkpoint.check_tree(params, expected, what=what)
  if fp8:
    params = fp8_lib.quantise_params(vit.compute_params(params, jnp.bfloat16), jnp.bfloat16)
  return LoadedModel(model, params, spec, preprocessing)


def with_weights(spec: ModelSpec, preprocessing=None) -> tuple:
  """(`spec` whose input statistics are the weights', their preprocessing at its resolution) for
  a family's model (`preprocessing` None: timm's default weights of its name); (spec, None) for
  the paper's models, which keep the official resize."""
  name = spec.name or ''
  if families.family_of(name) is None:
    return spec, None
  preprocessing = (preprocessing or timm_weights.default(name)).at(spec.image_size)
  return spec.changed(input_stats=preprocessing.input_stats), preprocessing
