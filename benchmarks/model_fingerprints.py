"""Fingerprints of every registered model: what a refactoring of the model code must not change.

For each name of the registry (one encoder block, at the smallest resolution its patches tile
twice; ViT-22B at a reduced width), SHA-256 digests of: the initial parameters, the eval
logits, the training loss and gradients (dropout on), the logits of the parameters saved as an
`.npz` and loaded back by name, and the timm and transformers exports where the model has one;
for a few models also under other compute options (bfloat16, scan, remat, FP8, XLA's
attention), as NaFlex and as masked patch prediction. Two runs on the same machine and versions
give the same digests, so

    python benchmarks/model_fingerprints.py --out before.json      # on the old code
    python benchmarks/model_fingerprints.py --compare before.json  # on the new code

lists every digest that moved (exit 1) or none (exit 0). Digests are of float32 bytes: they
hold on one machine and library build, not across them.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vit_jax import checkpoint  # noqa: E402
from vit_jax.configs import architectures  # noqa: E402
from vit_jax.configs import common  # noqa: E402
from vit_jax.configs.model_spec import ModelSpec  # noqa: E402
from vit_jax.evaluation import loader  # noqa: E402
from vit_jax.training import steps  # noqa: E402

NUM_CLASSES = 5
# Other compute options, each on these models.
VARIANTS = {
  'bf16': {'dtype': 'bfloat16'},
  'scan': {'scan_layers': True},
  'remat': {'remat': True},
  'fp8': {'fp8': True},
  'xla': {'attention': 'xla'},
}
VARIANT_MODELS = ('testing', 'ViT-B_16', 'eva02_tiny_patch14_224', 'ViT-22B_14', 'R+ViT-Ti_16')
NAFLEX_MODELS = ('testing', 'ViT-S_16-gap')
MPP_MODELS = ('testing', 'ViT-Ti_16')
# Too wide for one block on a CPU: the width, MLP and heads they are fingerprinted at.
NARROWED = {'ViT-22B_14': (256, 1024, 4), 'ViT-22B_14-map': (256, 1024, 4)}


def digest(tree) -> str:
  """SHA-256 of a tree's leaves in key order: names, shapes, dtypes and bytes."""
  h = hashlib.sha256()
  flat = checkpoint.flatten(tree) if isinstance(tree, dict) else {'': tree}
  for key in sorted(flat):
    x = np.asarray(flat[key])
    h.update(f'{key}{x.shape}{x.dtype}'.encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()[:16]


def narrowed(spec: ModelSpec, width: int, mlp_dim: int, heads: int) -> ModelSpec:
  """`spec` at another width (the typed architecture, or the older ConfigDict one)."""
  arch = spec.architecture
  if hasattr(arch, 'block'):
    return spec.changed(hidden_size=width, mlp_dim=mlp_dim, num_heads=heads)
  transformer = dict(arch.transformer)
  transformer.update(mlp_dim=mlp_dim, num_heads=heads)
  return spec.changed(hidden_size=width, transformer=transformer)


def image_size(name: str) -> int:
  config = common.get_config()
  config.model = name
  config.depth = 1
  config.pp.crop = 10**6  # not a multiple: the error names the stride
  patch = architectures.MODEL_CONFIGS[name].patches.size[0]
  resnet = architectures.MODEL_CONFIGS[name].get('resnet')
  stride = patch if resnet is None else patch * 4 * 2 ** max(len(resnet.num_layers) - 1, 0)
  return 2 * stride


def run_config(name: str, **fields):
  config = common.get_config()
  config.model = name
  config.depth = 1
  config.pp.crop = image_size(name)
  for key, value in fields.items():
    *parents, last = key.split('.')
    target = config
    for part in parents:
      target = target[part]
    target[last] = value
  return config


def fingerprint(name: str, fields: dict, load: bool, export: bool) -> dict:
  config = run_config(name, **fields)
  spec = ModelSpec.of(config)
  if name in NARROWED:
    spec = narrowed(spec, *NARROWED[name])
  task = steps.make_task(config, NUM_CLASSES, False, spec)
  size = spec.image_size
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.uniform(-1, 1, (2, size, size, 3)).astype(np.float32))
  labels = jnp.asarray([0, 3], jnp.int32)
  params = task.model.init(jax.random.key(0), images, train=False)['params']
  out = {'init': digest(params)}
  # Away from the zero-initialised head, class token and biases, so that every one counts.
  keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape), params)
  batch = {'image': images, 'label': labels, 'mask': jnp.ones((2,), jnp.float32)}

  def item(key, fn):
    try:
      out[key] = digest(fn())
    except Exception as e:  # noqa: BLE001  a model that cannot do it is a fingerprint too
      out[key] = f'error: {type(e).__name__}: {str(e)[:120]}'

  if config.task == 'classification':
    item('logits', lambda: task.model.apply({'params': params}, images, train=False))
    item('features', lambda: task.features.apply({'params': params}, images, train=False))
  item('loss', lambda: task.loss_fn(params, batch, jax.random.key(1), True))
  item('grads', lambda: jax.grad(task.loss_fn)(params, batch, jax.random.key(1), True))
  if load:
    with tempfile.TemporaryDirectory() as tmp:
      path = checkpoint.save_npz(params, os.path.join(tmp, 'params.npz'))
      loaded = loader.load_model(path, name)
      out['loaded'] = digest(loaded.model.apply({'params': loaded.params}, images, train=False))
      if export:
        out.update(exports(path, name, tmp))
  return out


def exports(path: str, name: str, tmp: str) -> dict:
  """Digests of the timm and transformers exports that `name` has (absent where refused)."""
  from vit_jax.interop import export as export_lib

  out = {}
  for fmt in ('timm', 'hf'):
    target = os.path.join(tmp, 'model.safetensors' if fmt == 'timm' else fmt)
    try:
      export_lib.export(path, fmt, target, name)
    except Exception as e:  # noqa: BLE001  a refusal is part of the fingerprint
      out[fmt] = f'refused: {type(e).__name__}'
      continue
    out[fmt] = digest_folder(target)
  return out


def digest_folder(path: str) -> str:
  """SHA-256 of the tensors (safetensors, torch) and JSON of an export."""
  h = hashlib.sha256()
  files = (
    [path]
    if os.path.isfile(path)
    else sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names)
  )
  for file in files:
    if file.endswith('.safetensors'):
      from safetensors import safe_open
      from safetensors.numpy import load_file

      tensors = load_file(file)
      h.update(digest({k: tensors[k] for k in sorted(tensors)}).encode())
      with safe_open(file, 'np') as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
    elif file.endswith(('.bin', '.pth', '.pt')):
      import torch

      state = torch.load(file, map_location='cpu')
      h.update(digest({k: v.numpy() for k, v in sorted(state.items())}).encode())
    elif file.endswith('.json'):
      with open(file) as f:
        h.update(json.dumps(json.load(f), sort_keys=True).encode())
  return h.hexdigest()[:16]


def cases():
  for name in architectures.MODEL_CONFIGS:
    yield name, name, {}, name not in NARROWED, name not in NARROWED
  for name in VARIANT_MODELS:
    for variant, fields in VARIANTS.items():
      yield f'{name}/{variant}', name, fields, False, False
  for name in NAFLEX_MODELS:
    yield f'{name}/naflex', name, {'naflex_tokens': (4,)}, False, False
  for name in MPP_MODELS:
    yield f'{name}/mpp', name, {'task': 'mpp'}, False, False


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', help='write the fingerprints here (JSON)')
  parser.add_argument('--compare', help='compare with fingerprints written before')
  parser.add_argument('--only', default='', help='a substring of the case names to run')
  args = parser.parse_args(argv)
  found = {}
  start = time.time()
  for case, name, fields, load, export in cases():
    if args.only not in case:
      continue
    try:
      found[case] = fingerprint(name, fields, load, export)
    except Exception as e:  # noqa: BLE001  a model that cannot be built is a fingerprint too
      found[case] = {'error': f'{type(e).__name__}: {str(e)[:200]}'}
    print(f'{time.time() - start:7.1f}s {case}: {found[case]}', flush=True)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(found, f, indent=1, sort_keys=True)
  if args.compare:
    with open(args.compare) as f:
      before = json.load(f)
    moved = [
      f'{case}: {key} {before[case].get(key)} -> {value}'
      for case, items in found.items()
      if case in before
      for key, value in items.items()
      if before[case].get(key) != value
    ]
    moved += [f'{case}: missing now' for case in before if case not in found and args.only in case]
    print('\n'.join(moved) or 'every fingerprint as before')
    return 1 if moved else 0
  return 0


if __name__ == '__main__':
  sys.exit(main())
