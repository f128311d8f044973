"""Export a checkpoint to timm, transformers, TF SavedModel or ONNX; import timm / transformers.

`load` reads any checkpoint this project knows (public `.npz`, a workdir, a
timm state_dict, a transformers folder) as a `LoadedModel`; `export` writes
it in one of `FORMATS`. `python -m vit_jax.export` is the command line.
"""

import json
import os
from typing import List, NamedTuple, Optional

from vit_jax import checkpoint
from vit_jax import workdir
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.core import console
from vit_jax.core import files
from vit_jax.core.errors import UserError
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader
from vit_jax.interop import hf
from vit_jax.interop import timm
from vit_jax.interop import timm_files
from vit_jax.interop import torch_layout

FORMATS = ('timm', 'hf', 'npz', 'savedmodel', 'onnx')
# Formats written as one file -> its name inside a folder given as the output.
_FILE_NAMES = {'timm': 'model.safetensors', 'npz': workdir.PARAMS_FILE, 'onnx': 'model.onnx'}
_TORCH_SUFFIXES = ('.safetensors', '.pth', '.pt', '.bin')


class Source(NamedTuple):
  loaded: loader.LoadedModel
  class_names: Optional[List[str]]  # what the source itself names (a transformers folder)
  notes: List[str]


# ---------------------------------------------------------------------------
# Reading any source.


def _timm_model_name(model_name: Optional[str], path: str, state, metadata: dict) -> tuple:
  """(the model of a timm file, how it was recognised or None where named): --model, else the
  name our export recorded, else what lies with the file names (`timm_files.where`), else the
  model its tensors fit (`timm_files.model_name`). A --model that what lies with a file of
  another tool, or its tensors, contradicts is refused (`timm_files.check_model`)."""
  how = None
  if not metadata.get('vit_jax_model'):
    place = timm_files.where(path)
    if model_name:
      timm_files.check_model(model_name, state, place, path)
    elif place is not None:
      model_name = timm_files.our_name(place.name)
      timm_files.check_model(model_name, state, place, path)  # a name we do not have: one line
      how = f'{place.source} names it'
    else:
      model_name = timm_files.model_name(state, path)
      how = 'its tensors fit that model'
  return loader.resolve_model_name(model_name, path, metadata), how


def _read_torch_file(path: str):
  if path.endswith('.safetensors'):
    return torch_layout.load_safetensors(path)
  return torch_layout.load_torch_file(path), {}


def load(
  path: str,
  model_name: Optional[str] = None,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
  tag: Optional[str] = None,
) -> Source:
  """The model that a checkpoint of any supported kind holds, checked against `model_name`;
  at `patch_size` when given (FlexiViT's PI-resize). `resample`: `loader.model_from_flat`'s;
  a timm NaFlexVit file needs it unless our export wrote it (its metadata records it). `tag`:
  timm's weights that a timm file holds ('TAG' or 'NAME.TAG'), which decide its preprocessing
  where nothing with the file does (`timm_files.preprocessing`)."""
  path = os.fspath(path)
  local = not files.is_remote(path)
  timm_file = local and path.endswith(_TORCH_SUFFIXES)
  if tag and not timm_file:
    raise loader.InputError(
      f"--tag={tag}: {path} is not a timm file; only timm's weights have a tag (a checkpoint "
      'of ours records its preprocessing); leave --tag out'
    )
  # A transformers folder: its config.json without a run's final parameters (a
  # training workdir records its config under the same name).
  if (
    local
    and os.path.isdir(path)
    and os.path.exists(os.path.join(path, hf.CONFIG_FILE))
    and not workdir.has_params(path)
  ):
    state, hf_config, metadata = hf.read_folder(path)
    model_name = loader.resolve_model_name(model_name, path, metadata)
    return _from_hf(state, hf_config, model_name, path, patch_size, resample)
  if timm_file:
    if not os.path.exists(path):
      raise checkpoint.CheckpointError(f'{path}: no such file')
    state, metadata = _read_torch_file(path)
    if 'patch_embed.proj.weight' in state or 'embeds.proj.weight' in state:
      model_name, how = _timm_model_name(model_name, path, state, metadata)
      notes = [f'recognised {path} as {model_name} ({how})'] if how else []
      config = model_spec.registered(model_name)
      if 'embeds.proj.weight' in state:  # timm's NaFlexVit
        # A NaFlex model under timm's own name resamples as timm's model of it does.
        own = config.posemb_resample if model_name in families.MODELS else None
        resample = resample or metadata.get(timm.RESAMPLE_METADATA) or own
        flat = timm.from_timm_naflex(state, config, path, resample)
      else:
        flat = timm.from_timm(state, config, path)
      preprocessing = _preprocessing(model_name, state, path, metadata, tag)
      loaded = loader.model_from_flat(flat, model_name, path, patch_size, resample, preprocessing)
      return Source(loaded, None, notes)
    if any(k.startswith(('vit.', 'embeddings.')) for k in state):
      folder = os.path.dirname(os.path.abspath(path))
      hf_config = (
        hf.read_config(folder) if os.path.exists(os.path.join(folder, hf.CONFIG_FILE)) else {}
      )
      model_name = loader.resolve_model_name(model_name, path, metadata)
      return _from_hf(hf.canonical_names(state), hf_config, model_name, path, patch_size, resample)
    raise checkpoint.CheckpointError(
      f'{path}: neither timm (patch_embed.proj.weight) nor '
      'transformers (vit.embeddings...) ViT weights'
    )
  return Source(loader.load_model(path, model_name, patch_size, resample), None, [])


def _preprocessing(model_name: str, state, path: str, metadata: dict, tag: Optional[str]):
  """The preprocessing of a timm file's weights, for a family's model: what our export recorded,
  else what lies with the file, --tag or its head say (`timm_files.preprocessing`). None for the
  paper's models, which keep the official resize."""
  if model_name not in families.MODELS:
    if tag:
      raise loader.InputError(
        f"--tag={tag}: {model_name} is the paper's model, fed as the paper's (the official "
        'resize to [-1, 1] pixels) whatever its tag; leave --tag out'
      )
    return None
  recorded = timm_files.recorded(metadata)
  if recorded is not None:
    return recorded
  place = None if metadata.get('vit_jax_model') else timm_files.where(path)
  return timm_files.preprocessing(model_name, state, path, place, tag)


def _from_hf(state, hf_config, model_name, what, patch_size=None, resample=None) -> Source:
  config = model_spec.registered(model_name)
  flat, notes = hf.from_hf(state, hf_config, config, what)
  loaded = loader.model_from_flat(flat, model_name, what, patch_size, resample)
  return Source(loaded, hf.class_names(hf_config), notes)


# ---------------------------------------------------------------------------
# Writing each format.


def _save_naflex_timm(loaded: loader.LoadedModel, output: str) -> List[str]:
  """A NaFlex ViT as timm NaFlexVit's state_dict."""
  flat = checkpoint.flatten(loaded.params)
  resample = loaded.spec.architecture.posemb_resample
  metadata = {
    'vit_jax_model': loaded.spec.architecture.name or '',
    'timm_model': 'naflexvit',
    timm.RESAMPLE_METADATA: resample,
  }
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  torch_layout.save_safetensors(timm.to_timm_naflex(flat), output, metadata)
  mode, antialias = timm.NAFLEX_RESAMPLE[resample]
  return [
    f'load: vit_jax.interop.export.timm_naflex_model({output!r}) (timm NaFlexVit, built as '
    f'the file records it: registers, depth, LayerScale; position table resampled with '
    f"pos_embed_interp_mode='{mode}', pos_embed_antialias={antialias})"
  ]


def timm_naflex_model(path: str):
  """timm's `NaFlexVit` holding a NaFlex ViT that `--format=timm` wrote, its architecture read
  back from the file (the run's registers, depth, LayerScale, resampling: what the model
  name's registry entry does not say), the weights loaded strictly."""
  torch = torch_layout.require('torch')
  loaded = load(path).loaded
  state, _ = torch_layout.load_safetensors(path)
  model = timm.build_naflex_model(loaded.spec.architecture, loaded.model.num_classes)
  model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
  return model


def _save_timm(loaded: loader.LoadedModel, output: str) -> List[str]:
  flat, notes = checkpoint.flatten(loaded.params), []
  if timm.is_naflex(flat):
    return _save_naflex_timm(loaded, output)
  num_classes = loaded.model.num_classes
  if 'pre_logits/kernel' in flat:
    flat = {k: v for k, v in flat.items() if not k.startswith(('pre_logits/', 'head/'))}
    num_classes = None
    notes.append(
      "pre_logits and head dropped: timm's ViT has no pre-logits layer; the file is "
      "a features-only model (num_classes=0), as timm's *.orig_in21k weights"
    )
  name = timm.registered_name(loaded.spec.architecture, loaded.spec.image_size)
  kwargs = timm.create_model_kwargs(loaded.spec.architecture, num_classes, loaded.spec.image_size)
  metadata = {
    'vit_jax_model': loaded.spec.architecture.name or '',
    'timm_model': name or '',
    'timm_kwargs': json.dumps(kwargs),
  }
  if loaded.preprocessing is not None:
    metadata[timm_files.PREPROCESSING_METADATA] = json.dumps(loaded.preprocessing.to_json())
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  torch_layout.save_safetensors(timm.to_timm(flat, loaded.spec.architecture), output, metadata)
  if name:
    call = ', '.join([repr(name)] + [f'{k}={v!r}' for k, v in kwargs.items()])
    notes.append(
      f'load: timm.create_model({call}).load_state_dict(safetensors.torch.load_file({output!r}))'
    )
  else:
    notes.append(
      'no timm name for this architecture: build it with '
      'vit_jax.interop.timm.build_model(config, num_classes, image_size)'
    )
  if loaded.spec.architecture.resnet is not None:
    notes.append(
      "timm.create_model's hybrids standardise kernels by sqrt(var + 1e-8) and use GroupNorm "
      'eps 1e-5 (ours, as the original code: std + 1e-5 and 1e-6); '
      'vit_jax.interop.timm.build_model matches ours'
    )
  return notes


def _class_names(source: Source, path: str, labels: Optional[str]) -> Optional[List[str]]:
  """--labels, else the source's names, else those predict gives (`classify.class_names`: a
  run's own, its dataset's, ImageNet's for a file or an ImageNet run); None for none."""
  num_classes = source.loaded.model.num_classes
  if num_classes is None:
    return None
  if labels:
    return classify.class_names(num_classes, labels)
  if source.class_names is not None and len(source.class_names) == num_classes:
    return source.class_names
  names, why = classify.class_names_and_why(num_classes, None, path)
  return None if why else names


def _npz_record(source: Source, path: str, labels: Optional[str]) -> tuple:
  """(what an exported .npz records, `checkpoint.read_metadata`; the note saying it): the
  model's name, and the class names of --labels, a transformers folder, the run (its record
  or dataset) or the file's own record, never names assumed from the head's size alone."""
  loaded = source.loaded
  num_classes = loaded.model.num_classes
  dataset = workdir.recorded(path, 'dataset') or checkpoint.read_metadata(path).get('dataset')
  names, why = None, ''
  if num_classes is not None:
    if labels:
      names = classify.class_names(num_classes, labels)
    elif source.class_names is not None and len(source.class_names) == num_classes:
      names = list(source.class_names)
    else:
      found = classify.class_names_of(num_classes, None, path)
      if found.source in ('run', 'file', 'dataset') or (found.source == 'imagenet' and dataset):
        names = found.names
      elif found.source == 'imagenet':
        why = f"ImageNet's would be assumed from its {num_classes}-way head alone"
      else:  # 'classes named class_<i>: REASON; pass --labels=FILE, ...'
        why = found.why.split(': ', 1)[-1].split('; pass --labels')[0]
  record = {'model': loaded.spec.architecture.name, 'class_names': names, 'dataset': dataset}
  if loaded.preprocessing is not None:  # a family's weights': predict and evaluate apply it
    record['preprocessing'] = loaded.preprocessing.to_json()
  said = [f'model {record["model"]}']
  if names:
    said.append(f'{len(names)} class names')
  if dataset:
    said.append(f'dataset {dataset}')
  note = f'recorded in the .npz (predict and export read it): {", ".join(said)}'
  if num_classes is not None and not names:
    note += f'; no class names ({why or "none known"}): pass --labels=FILE to record them'
  return record, note


def output_path(fmt: str, output: str) -> str:
  """Where `export` writes: a one-file format given a folder (existing, or a path ending in
  a slash) writes `_FILE_NAMES[fmt]` inside it; a folder format refuses an existing file.
  Never over a run's work (`workdir.check_output`: a WorkdirError)."""
  output = os.fspath(output)
  if fmt in _FILE_NAMES and (os.path.isdir(output) or output.endswith(('/', os.sep))):
    output = os.path.join(output, _FILE_NAMES[fmt])
  if fmt not in _FILE_NAMES and os.path.isfile(output):
    raise loader.InputError(f'--output {output} is a file; --format={fmt} writes a folder')
  workdir.check_output(output, '--output', folder=fmt not in _FILE_NAMES)
  return output


def export(
  checkpoint_path: str,
  fmt: str,
  output: str,
  model_name: Optional[str] = None,
  labels: Optional[str] = None,
  patch_size: Optional[int] = None,
  resample: Optional[str] = None,
  tag: Optional[str] = None,
) -> List[str]:
  """Converts `checkpoint_path` (at `patch_size`, when given; `resample`, `tag`: `load`'s) to
  `fmt` at `output`; notes."""
  if fmt not in FORMATS:
    raise loader.InputError(f'--format={fmt!r}: use one of {", ".join(FORMATS)}')
  output = output_path(fmt, output)
  source = load(checkpoint_path, model_name, patch_size, resample, tag)
  loaded, notes = source.loaded, list(source.notes) + _resample_notes(source.loaded, fmt)
  if loaded.preprocessing is not None:  # what predict, evaluate and fine-tuning will apply
    notes.insert(0, loaded.preprocessing.line())
  if timm.is_naflex(checkpoint.flatten(loaded.params)) and fmt in ('hf', 'onnx'):
    raise torch_layout.ExportError(
      f'a NaFlex ViT has no {fmt} counterpart here; use --format=timm (timm NaFlexVit), '
      'npz or savedmodel'
    )
  arch = loaded.spec.architecture
  if fmt == 'timm':  # timm builds what its name for the model has; its ViT has LayerScale too
    named = arch.name in families.MODELS
    reference = model_spec.registered(arch.name) if named else None
    writes = timm.WRITES + (('posemb',) if arch.posemb == 'grid' else ())  # NaFlexVit's table
    torch_layout.check_writes(arch, 'timm', writes, reference)
  elif fmt in ('hf', 'onnx'):
    torch_layout.check_writes(arch, 'transformers' if fmt == 'hf' else fmt)
  names = _class_names(source, checkpoint_path, labels) if fmt == 'hf' else None
  record = None
  if fmt == 'npz':
    record, note = _npz_record(source, checkpoint_path, labels)
    notes.append(note)
  # Written whole or not at all: a full disk or a kill leaves nothing at `output`, and the
  # temporary files are removed (a killed export's by the next one; `files.staged`).
  try:
    with files.staged(output) as staging:
      notes += _write(fmt, loaded, staging, names, record)
  except Exception as e:
    failure = workdir.storage_failure(e)
    if failure is None or isinstance(e, UserError):
      raise
    space = failure[0] in ('no space left on device', 'disk quota exceeded')
    raise torch_layout.ExportError(
      f'{output}: cannot write it ({failure[0]}); nothing was written there. '
      + (
        'Free space there, or pass another --output' if space else 'Pass an --output you can write'
      )
    ) from None
  return [note.replace(staging, output) for note in notes]


def _resample_notes(loaded: loader.LoadedModel, fmt: str) -> List[str]:
  """What a file of `fmt` cannot record: a NaFlex ViT's resampling other than the default
  (a model under timm's name has its own in the registry)."""
  resample = loaded.spec.architecture.posemb_resample
  name = loaded.spec.name
  own = name in families.MODELS and model_spec.registered(name).posemb_resample == resample
  if fmt == 'timm' or resample == 'bilinear' or own:
    return []
  return [
    f'the NaFlex ViT resamples its position table by {resample}, which only a timm export '
    f'records: pass --resample={resample} to predict, evaluate, fewshot and export, and '
    f'--config.naflex_resample={resample} to fine-tune'
  ]


def _said_in_one_line(error: BaseException) -> bool:
  return isinstance(error, UserError) or workdir.storage_failure(error) is not None


def _write(fmt: str, loaded: loader.LoadedModel, output: str, names, record=None) -> List[str]:
  """Writes `loaded` in `fmt` at `output` (an npz with `record`: `checkpoint.read_metadata`);
  notes for the user."""
  if fmt == 'npz':
    checkpoint.save_npz(loaded.params, output, metadata=record)
    return []
  if fmt == 'timm':
    return _save_timm(loaded, output)
  if fmt == 'hf':
    return hf.save(
      checkpoint.flatten(loaded.params),
      loaded.spec.architecture,
      loaded.spec.image_size,
      output,
      names,
    )
  # TensorFlow's and torch's start-up and progress lines.
  with console.library_output_hidden(quiet_on=_said_in_one_line):
    if fmt == 'savedmodel':
      from vit_jax.interop import savedmodel

      savedmodel.save(loaded, output)
    else:
      from vit_jax.interop import onnx

      onnx.save(loaded, output)
  return []
