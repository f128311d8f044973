r"""How ViT's training step compiles on a GPU with each attention: the evidence for attention='auto'.

  python benchmarks/gpu_attention.py [--gpu=h100-1] [--model=ViT-B_16] [--batch=64]

Compiles the gradient of a ViT's loss (bfloat16, training mode, one GPU) with
the GPU compiler for each attention implementation, at 224 px (197 tokens)
and 384 px (577): cuDNN as JAX offers it, cuDNN with the odd sequence padded
by one masked token (what `attention='auto'` does, `models.attention.pads_sequence`),
JAX's XLA implementation, and ours written out ('explicit'). Records whether
it compiles (or JAX's refusal), the temporaries the compiler allots and the
library kernels in the program, in `benchmarks/gpu/attention_<model>_<gpu>.json`.
Compiler figures on a CPU machine, kernels chosen without autotuning: not
measurements of speed or of memory on the card.
"""

import argparse
import datetime
import json
import os
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from vit_jax import models  # noqa: E402
from vit_jax.bench import gpus  # noqa: E402
from vit_jax.bench import hlo  # noqa: E402
from vit_jax.configs import architectures  # noqa: E402
from vit_jax.core import hardware  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, implementation, pad odd sequences)
VARIANTS = [
  ('cudnn', 'cudnn', False),
  ('cudnn, padded (auto)', 'cudnn', True),
  ('xla', 'xla', False),
  ('explicit', 'explicit', False),
]


def compile_gradient(model_name, implementation, pad, size, batch, devices) -> dict:
  """One training step's gradient compiled for `devices`: temporaries and kernels, or the refusal."""
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ('batch',))
  arch = architectures.MODEL_CONFIGS[model_name]
  model = models.VisionTransformer(
    num_classes=1000, dtype=jnp.bfloat16, attention=implementation, pad_odd=pad, **arch
  )
  try:
    with jax.set_mesh(mesh):
      images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
      # Traced, not run: this machine cannot make arrays on the mesh's GPUs.
      init = lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)  # noqa: E731
      params = jax.eval_shape(init)['params']

      def loss(p, x):
        logits = model.apply({'params': p}, x, train=True, rngs={'dropout': jax.random.key(1)})
        return jnp.mean(logits**2)

      start = time.perf_counter()
      lowered = jax.jit(jax.grad(loss)).lower(params, images)
      compiled = lowered.compile(compiler_options=gpus.COMPILER_OPTIONS)
  except NotImplementedError as e:  # JAX's own check, at trace time
    return {'compiles': False, 'error': str(e).splitlines()[0]}
  memory = compiled.memory_analysis()
  return {
    'compiles': True,
    'temp_bytes': int(memory.temp_size_in_bytes),
    'argument_bytes': int(memory.argument_size_in_bytes),
    'library_kernels': hlo.custom_calls(compiled.as_text()),
    'compile_seconds': time.perf_counter() - start,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gpu', default='h100-1')
  parser.add_argument('--model', default='ViT-B_16')
  parser.add_argument('--batch', type=int, default=64)
  args = parser.parse_args()
  devices = gpus.describe(args.gpu).devices
  results = {}
  for size in (224, 384):
    tokens = (size // 16) ** 2 + 1
    for name, implementation, pad in VARIANTS:
      result = compile_gradient(args.model, implementation, pad, size, args.batch, devices)
      results.setdefault(f'{tokens} tokens ({size} px)', {})[name] = result
      print(size, name, json.dumps(result), flush=True)
  record = {
    'benchmark': 'benchmarks/gpu_attention.py',
    'time_utc': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
    'gpu': args.gpu,
    'model': args.model,
    'batch': args.batch,
    'dtype': 'bfloat16',
    'versions': hardware.library_versions(('jax', 'jaxlib', 'jax_cuda12_plugin', 'flax')),
    'compiler_options': gpus.COMPILER_OPTIONS,
    'results': results,
    'estimate': 'GPU compiler on a CPU machine, no autotuning: whether it compiles, and the '
    "compiler's temporaries; not measured on a GPU",
  }
  model = 'vit_' + args.model.split('-', 1)[-1].replace('_', '').lower()  # ViT-B_16 -> vit_b16
  path = os.path.join(ROOT, 'benchmarks', 'gpu', f'attention_{model}_{args.gpu}.json')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
