"""Hugging Face `transformers` ViT folders: `config.json` + `model.safetensors`, and back.

We write the canonical Hub layout of the published ViT checkpoints
(google/vit-base-patch16-224): `vit.encoder.layer.N.attention.attention.query`,
`...intermediate.dense`, `...output.dense`, `classifier`. transformers 5.x
renames these to its own (`vit.layers.N.attention.q_proj`, `mlp.fc1`, ...) on
load and back on `save_pretrained`, so one folder loads in 4.x and 5.x.
Import reads either naming.

Numerics: `hidden_act='gelu_new'` is the tanh approximation of GELU, as the
original code (and every transformers version has it; the Hub's ViT configs
say `gelu`, the exact one), and `layer_norm_eps=1e-6` as ours (the Hub's
configs say 1e-12).

transformers' ViT always has a class token and no ResNet stem, so only
`classifier='token'` ViTs export. A checkpoint with `pre_logits` exports as a
`ViTModel` whose pooler is the pre-logits layer (Dense + tanh), as
google/vit-base-patch16-224-in21k; its head is dropped, since
`ViTForImageClassification` classifies the class token directly.
"""

import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from vit_jax import checkpoint
from vit_jax.interop import torch_layout

# transformers' file names for a model's config (not a training run's, though the same name).
CONFIG_FILE = 'config.json'
HIDDEN_ACT = 'gelu_new'
_TANH_GELUS = ('gelu_new', 'gelu_pytorch_tanh', 'gelu_python_tanh', 'gelu_fast')

_LAYER = r'^Transformer/encoderblock_(\d+)/'
_RULES = (
  (r'^cls$', 'vit.embeddings.cls_token'),
  (r'^Transformer/posembed_input/pos_embedding$', 'vit.embeddings.position_embeddings'),
  (r'^embedding/', 'vit.embeddings.patch_embeddings.projection.'),
  (r'^Transformer/encoder_norm/', 'vit.layernorm.'),
  (_LAYER + r'LayerNorm_0/', r'vit.encoder.layer.\1.layernorm_before.'),
  (_LAYER + r'LayerNorm_2/', r'vit.encoder.layer.\1.layernorm_after.'),
  (
    _LAYER + r'MultiHeadDotProductAttention_1/(query|key|value)/',
    r'vit.encoder.layer.\1.attention.attention.\2.',
  ),
  (
    _LAYER + r'MultiHeadDotProductAttention_1/out/',
    r'vit.encoder.layer.\1.attention.output.dense.',
  ),
  (_LAYER + r'MlpBlock_3/Dense_0/', r'vit.encoder.layer.\1.intermediate.dense.'),
  (_LAYER + r'MlpBlock_3/Dense_1/', r'vit.encoder.layer.\1.output.dense.'),
  (r'^pre_logits/', 'vit.pooler.dense.'),
  (r'^head/', 'classifier.'),
)
# transformers 5.x names -> the Hub's (4.x) names.
_FROM_V5 = (
  (r'^vit\.layers\.', 'vit.encoder.layer.'),
  (r'\.attention\.q_proj\.', '.attention.attention.query.'),
  (r'\.attention\.k_proj\.', '.attention.attention.key.'),
  (r'\.attention\.v_proj\.', '.attention.attention.value.'),
  (r'\.attention\.o_proj\.', '.attention.output.dense.'),
  (r'\.mlp\.fc1\.', '.intermediate.dense.'),
  (r'\.mlp\.fc2\.', '.output.dense.'),
)


def hf_name(key: str) -> Tuple[Optional[str], None]:
  return torch_layout.rename(key, _RULES), None


def check_exportable(arch) -> None:
  """ExportError unless transformers' ViT holds `arch`: the paper's ViT with a class token."""
  if arch.resnet is not None:
    raise torch_layout.ExportError(
      f'{arch.name}: transformers has no R+ViT hybrid (ViTHybrid '
      'was removed in 5.0); use --format=timm or --format=onnx'
    )
  if arch.classifier != 'token':
    raise torch_layout.ExportError(
      f"{arch.name}: transformers' ViT pools with a class token "
      f'only, not classifier={arch.classifier}; use --format=timm'
    )
  if arch.num_registers:
    raise torch_layout.ExportError(
      f"{arch.name}: transformers' ViT has no register tokens; use --format=timm"
    )


def hf_config(
  arch,
  num_classes: Optional[int],
  image_size: int,
  class_names: Optional[Sequence[str]],
  representation_size: Optional[int],
) -> dict:
  """config.json of the Hub's ViT checkpoints, with our numerics."""
  patch = arch.patch_size[0]
  out = {
    'architectures': ['ViTModel' if num_classes is None else 'ViTForImageClassification'],
    'model_type': 'vit',
    'hidden_size': arch.hidden_size,
    'num_hidden_layers': arch.num_layers,
    'num_attention_heads': arch.block.num_heads,
    'intermediate_size': arch.block.mlp_dim,
    'hidden_act': HIDDEN_ACT,
    'layer_norm_eps': 1e-6,
    'image_size': image_size,
    'patch_size': patch,
    'num_channels': 3,
    'qkv_bias': True,
    'hidden_dropout_prob': 0.0,
    'attention_probs_dropout_prob': 0.0,
    'initializer_range': 0.02,
    'encoder_stride': patch,
  }
  if representation_size is not None:
    out.update(pooler_output_size=representation_size, pooler_act='tanh')
  if num_classes is not None:
    names = list(class_names) if class_names else [f'LABEL_{i}' for i in range(num_classes)]
    out['id2label'] = {str(i): n for i, n in enumerate(names)}
    # Names may repeat (ImageNet-1k has two 'crane's); the first index wins.
    out['label2id'] = {n: i for i, n in reversed(list(enumerate(names)))}
  return out


def preprocessor_config(image_size: int) -> dict:
  """ViTImageProcessor doing our eval preprocessing: bilinear resize, x / 127.5 - 1."""
  return {
    'image_processor_type': 'ViTImageProcessor',
    'do_resize': True,
    'size': {'height': image_size, 'width': image_size},
    'resample': 2,
    'do_rescale': True,
    'rescale_factor': 1 / 255,
    'do_normalize': True,
    'image_mean': [0.5, 0.5, 0.5],
    'image_std': [0.5, 0.5, 0.5],
  }


def save(
  flat: Dict[str, np.ndarray],
  arch,
  image_size: int,
  output: str,
  class_names: Optional[Sequence[str]] = None,
) -> List[str]:
  """Writes the folder of architecture `arch`; returns notes on what did not carry over (a
  dropped head)."""
  check_exportable(arch)
  notes = []
  flat = dict(flat)
  representation_size = None
  if 'pre_logits/kernel' in flat:
    representation_size = int(flat['pre_logits/kernel'].shape[-1])
    if 'head/kernel' in flat:
      flat.pop('head/kernel'), flat.pop('head/bias')
      notes.append(
        'head dropped: ViTForImageClassification has no pre-logits layer; the folder is '
        'a ViTModel whose pooler_output is the pre-logits'
      )
  num_classes = int(flat['head/kernel'].shape[-1]) if 'head/kernel' in flat else None
  if num_classes is None and representation_size is None:
    notes.append('no head: the folder is a ViTModel without a pooler')
  state = torch_layout.to_torch_state(flat, hf_name)
  if num_classes is None:
    # A ViTModel's weights live at the root, as in the Hub's feature-extractor checkpoints.
    state = {k.removeprefix('vit.'): v for k, v in state.items()}
  if class_names is not None and num_classes is not None and len(class_names) != num_classes:
    raise torch_layout.ExportError(
      f'{len(class_names)} class names for a head of {num_classes}; pass one name per class'
    )
  os.makedirs(output, exist_ok=True)
  torch_layout.save_safetensors(
    state, os.path.join(output, 'model.safetensors'), {'vit_jax_model': arch.name or ''}
  )
  files = {
    CONFIG_FILE: hf_config(arch, num_classes, image_size, class_names, representation_size),
    'preprocessor_config.json': preprocessor_config(image_size),
  }
  for name, content in files.items():
    with open(os.path.join(output, name), 'w', encoding='utf-8') as f:
      json.dump(content, f, indent=2, ensure_ascii=False)
      f.write('\n')
  return notes


def canonical_names(state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """Either naming, with or without the `vit.` prefix -> the Hub's names."""
  out = {}
  for key, value in state.items():
    if not key.startswith(('vit.', 'classifier.')):
      key = 'vit.' + key
    for pattern, replacement in _FROM_V5:
      key = re.sub(pattern, replacement, key)
    out[key] = value
  return out


def read_config(folder: str) -> dict:
  """A transformers ViT folder's config.json."""
  path = os.path.join(folder, CONFIG_FILE)
  try:
    with open(path, encoding='utf-8') as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise checkpoint.CheckpointError(f'{path}: not a readable config.json ({e})') from None
  if hf.get('model_type') != 'vit':
    raise checkpoint.CheckpointError(
      f'{path}: model_type is {hf.get("model_type")!r}, not '
      "'vit'; only transformers ViT folders convert"
    )
  return hf


def read_folder(path: str) -> Tuple[Dict[str, np.ndarray], dict, dict]:
  """(state_dict in the Hub's names, config.json, safetensors metadata) of a ViT folder."""
  hf = read_config(path)
  weights, metadata = os.path.join(path, 'model.safetensors'), {}
  if os.path.exists(weights):
    state, metadata = torch_layout.load_safetensors(weights)
  elif os.path.exists(os.path.join(path, 'pytorch_model.bin')):
    state = torch_layout.load_torch_file(os.path.join(path, 'pytorch_model.bin'))
  else:
    raise checkpoint.CheckpointError(
      f'{path}: neither model.safetensors nor pytorch_model.bin; '
      'sharded folders: load and save_pretrained them as one file'
    )
  return canonical_names(state), hf, metadata


def from_hf(state: Dict[str, np.ndarray], hf: dict, arch, what: str) -> Tuple[dict, List[str]]:
  """(our flat parameters, notes) from a transformers ViT state_dict and its config.json, for
  the architecture `arch` (a `model_spec.Architecture`)."""
  check_exportable(arch)
  mismatches = [
    f'{theirs}={hf.get(theirs)} vs {ours}'
    for theirs, ours in (
      ('hidden_size', arch.hidden_size),
      ('num_hidden_layers', arch.num_layers),
      ('num_attention_heads', arch.block.num_heads),
      ('intermediate_size', arch.block.mlp_dim),
      ('patch_size', arch.patch_size[0]),
    )
    if theirs in hf and hf[theirs] != ours
  ]
  if mismatches:
    raise checkpoint.CheckpointError(
      f'{what}: config.json has {mismatches[0]} of {arch.name}; check --model'
    )
  notes = []
  if hf.get('hidden_act', 'gelu') not in _TANH_GELUS:
    notes.append(
      f'its hidden_act is {hf.get("hidden_act", "gelu")!r}; this model computes the '
      'tanh approximation of GELU (logits differ slightly)'
    )
  if hf.get('layer_norm_eps', 1e-12) != 1e-6:
    notes.append(f'its layer_norm_eps is {hf.get("layer_norm_eps", 1e-12)}; this model uses 1e-6')
  if 'vit.embeddings.position_embeddings' not in state:
    raise checkpoint.CheckpointError(f'{what}: no embeddings.position_embeddings; is it a ViT?')
  if 'vit.pooler.dense.weight' in state:
    arch = arch.changed(representation_size=int(state['vit.pooler.dense.weight'].shape[0]))
  if 'classifier.weight' in state and 'vit.pooler.dense.weight' in state:
    # ViTForImageClassification never reads the pooler; our model would.
    state = {k: v for k, v in state.items() if not k.startswith('vit.pooler.')}
    arch = arch.changed(representation_size=None)
    notes.append('pooler dropped: ViTForImageClassification classifies the class token directly')
  num_classes = int(state['classifier.weight'].shape[0]) if 'classifier.weight' in state else None
  tokens = int(state['vit.embeddings.position_embeddings'].shape[1])
  expected = torch_layout.expected_shapes(arch, num_classes, tokens, what)
  return torch_layout.from_torch_state(state, expected, hf_name, what), notes


def class_names(hf: dict) -> Optional[List[str]]:
  """id2label in index order, or None when they are transformers' LABEL_<i> defaults."""
  id2label = hf.get('id2label') or {}
  names = [id2label.get(str(i), id2label.get(i)) for i in range(len(id2label))]
  defaults = [f'LABEL_{i}' for i in range(len(names))]
  if not names or any(n is None for n in names) or names == defaults:
    return None
  return names
