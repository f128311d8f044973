"""What the tests share: the repository root, configs, meshes, random weights, subprocess setup.

Tests run JAX on the CPU (`JAX_PLATFORMS=cpu`, set before JAX starts) so that
an installed libtpu or CUDA plugin neither slows nor changes them; the TPU
compile tests choose their platform themselves.

The suite compiles hundreds of small programs and runs each for a few steps,
so XLA's CPU backend compiles them at optimisation level 0 (LLVM's cheapest;
the same HLO programs and fusions): 445 -> 275 CPU-seconds on four
compile-heavy test files. Child processes inherit it. A caller's own
`--xla_backend_optimization_level` wins: CI runs the equivalence tests again at
XLA's default level 2 (and held to AVX2), so the optimised code is tested too.
"""

import atexit
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = ' '.join(
    [*os.environ.get('XLA_FLAGS', '').split(), '--xla_backend_optimization_level=0']
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from vit_jax import models  # noqa: E402
from vit_jax.configs import architectures  # noqa: E402
from vit_jax.configs import model_spec  # noqa: E402
from vit_jax.configs.data import add_data_config
from vit_jax.core import sharding  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def batch_sharding():
  """Batches laid out over all devices, on the trainer's own mesh."""
  return sharding.batch_sharding(sharding.make_mesh())


def data_config(dataset=None, **overrides):
  """The data fields of a run; keys may be dotted (`**{'pp.crop': 8}`)."""
  config = add_data_config(ml_collections.ConfigDict())
  if dataset is not None:
    config.dataset = str(dataset)
  for key, value in overrides.items():
    *parents, last = key.split('.')
    target = config
    for part in parents:
      target = target[part]
    target[last] = value
  return config


def small_vit_config(name='ViT-Ti_16', hybrid_units=None, **overrides):
  """A released architecture shrunk in depth and width; hybrids get `hybrid_units` per stage."""
  config = architectures.MODEL_CONFIGS[name]
  config.hidden_size = 24
  config.transformer.update(num_layers=2, num_heads=3, mlp_dim=48)
  if hybrid_units:
    config.resnet = ml_collections.ConfigDict({'num_layers': hybrid_units, 'width_factor': 0.5})
  config.update(overrides)
  return config


def small_arch(
  name='ViT-Ti_16', hybrid_units=None, naflex_grid=None, resample='bilinear', **changes
):
  """`small_vit_config` as a typed `Architecture` with `changes` (its or its block's fields);
  with `naflex_grid`, a NaFlex ViT whose 2D table has those (rows, columns), resampled by
  `resample`."""
  arch = model_spec.Architecture.of(small_vit_config(name, hybrid_units)).changed(**changes)
  return model_spec.naflex_of(arch, naflex_grid, resample) if naflex_grid else arch


def param_shapes(config, num_classes, size, module=None):
  """The parameter tree of a ViT (or `module`) at `size` px, as shape structs."""
  module = module or models.VisionTransformer(num_classes=num_classes, **config)
  return jax.eval_shape(
    lambda: module.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False)
  )['params']


def map_head_parameter_count(d, m):
  """A MAP head's parameters at width d and MLP width m, written out: the probe, q/k/v/out
  with biases, a LayerNorm, the MLP."""
  return d + (4 * d * d + 4 * d) + 2 * d + (d * m + m + m * d + d)


def random_like(shapes, seed=0, scale=1.0):
  """Normal(0, scale) float32 arrays shaped like `shapes`."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: (scale * rng.normal(size=s.shape)).astype(np.float32), shapes)


# The one tiny training run of the tests: the demo config with the `testing`
# model (1 layer, width 10) at 16 px on the built-in digits, a few seconds of
# training. SGD: Adam turns the rounding noise of zero-gradient parameters
# (the key bias) into full-size steps, which would hide real differences
# between runs that the resume and equivalence tests compare.
TINY_RUN = {
  'model': 'testing',
  'pp.crop': 16,
  'batch': 32,
  'batch_eval': 64,
  'total_steps': 24,
  'warmup_steps': 4,
  'optimizer': 'sgd',
  'base_lr': 0.1,
  'progress_every': 4,
  'eval_every': 12,
  'checkpoint_every': 8,
  'tensorboard': False,
  'dropout_rate': 0.1,
}


def tiny_run_config(**overrides):
  """The demo config with TINY_RUN and `overrides` (dotted keys: `**{'mesh.fsdp': 2}`), as
  `python -m vit_jax.main` builds it from `tiny_run_flags(**overrides)`."""
  from vit_jax.configs import demo

  config = demo.get_config()
  for key, value in {**TINY_RUN, **overrides}.items():
    *parents, last = key.split('.')
    target = config
    for part in parents:
      target = target[part]
    target[last] = value
  return config


def tiny_run_flags(**overrides) -> list:
  """TINY_RUN and `overrides` as `--config.FIELD=VALUE` flags of `python -m vit_jax.main`."""
  return [f'--config.{key}={value}' for key, value in {**TINY_RUN, **overrides}.items()]


def gpu_plugin_notice(line: str) -> bool:
  """A line that the `jax[cuda12]` plugin (which CI installs for the GPU compile tests) writes
  as JAX starts where no GPU driver is: "Could not find cuda drivers on your machine", after
  absl's notice that native logging is not initialised yet."""
  return 'cudart_stub.cc' in line or line.startswith('WARNING: All log messages before absl::')


# absl's format: our progress lines at INFO, `I1123 05:40:37.529582 139918316010368 x.py:56] `.
_INFO_LINE = re.compile(r'I\d{4} [\d:.]+ +\d+ \S+:\d+\] ')
_HEARTBEAT_LINE = re.compile(r'.*: (\d+h\d\dm|\d+m\d\ds) so far$')


def heartbeat_line(line: str) -> bool:
  """A line `vit_jax.core.console.heartbeat` prints during a long wait (`compiling ...: 0m20s so
  far`): on a busy machine a small compile or evaluation may take that long too."""
  return bool(_HEARTBEAT_LINE.match(line))


def said(stderr) -> list:
  """The non-blank lines of a child process's stderr, less INFO lines, the GPU plugin's and the
  heartbeat's."""
  if isinstance(stderr, bytes):
    stderr = stderr.decode('utf-8', 'replace')
  return [
    x
    for x in stderr.splitlines()
    if x.strip() and not _INFO_LINE.match(x) and not gpu_plugin_notice(x) and not heartbeat_line(x)
  ]


def command_error(main, argv, capsys) -> str:
  """The one `error:` line of a command's `main(argv)` that must fail (vit_jax.core.cli), after
  checking its exit status (2) and that it says nothing else on stderr."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  return lines[0]


# One persistent compilation cache for the child processes of a test session:
# the whole-run tests start the same small programs again and again, and each
# is compiled once. The programs are the same either way; only the time goes.
COMPILATION_CACHE = tempfile.mkdtemp(prefix='vit_jax_tests_xla_cache_')
atexit.register(shutil.rmtree, COMPILATION_CACHE, True)


def subprocess_env(devices=1, **extra):
  """Environment for a child `python`: this checkout first, the CPU with `devices` devices,
  the session's compilation cache, and the caller's other XLA flags (so that
  `XLA_FLAGS=--xla_cpu_max_isa=AVX2 pytest` holds the children to AVX2 too)."""
  inherited = [
    flag
    for flag in os.environ.get('XLA_FLAGS', '').split()
    if not flag.startswith('--xla_force_host_platform_device_count')
  ]
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    XLA_FLAGS=' '.join([*inherited, f'--xla_force_host_platform_device_count={devices}']),
    JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    **extra,
  )
  env['PYTHONPATH'] = os.pathsep.join(
    [str(ROOT)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
  )
  return env


def child_json(script: str, devices=1, timeout=600):
  """Runs `python -c script` on `devices` CPU devices (`subprocess_env`); the JSON of the last
  line it prints."""
  result = subprocess.run(
    [sys.executable, '-c', script],
    capture_output=True,
    text=True,
    env=subprocess_env(devices=devices),
    timeout=timeout,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# Comparing two configurations of one computation (8 devices vs 1, scan vs
# unrolled, remat, accumulation, ...). They differ only in the order of float32
# sums, which XLA picks per CPU (AVX2 vs AVX-512 vectors, fusion, threads): a
# sum's rounding error grows with its terms' magnitudes, not its result's, so an
# element near zero (a bias whose true gradient is 0) can differ by 100% while
# the tensor as a whole agrees to a few ulps. These helpers compare each tensor
# normwise: its largest difference over its largest magnitude, that magnitude
# floored at `floor` times the largest of the whole tree (a tensor that is pure
# rounding noise, exactly 0 in real arithmetic, is measured against the tree).
# Every comparison appends what it measured to $VIT_JAX_SPREAD_LOG (JSON lines),
# which is how the tolerances in the tests were chosen (benchmarks/equivalence_spread.py).


def tree_errors(got, want, floor=1e-2):
  """{path: max |got - want| / max(max |want|, floor * the tree's max |want|)} per tensor."""
  pairs = {
    jax.tree_util.keystr(path): (np.asarray(a, np.float64), np.asarray(b, np.float64))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want))
  }
  assert len(pairs) == len(jax.tree.leaves(want)), 'the trees differ in structure'
  stats = {
    k: (float(np.max(np.abs(a - b), initial=0)), float(np.max(np.abs(b), initial=0)))
    for k, (a, b) in pairs.items()
  }
  return errors_from_stats(stats, floor)


def errors_from_stats(stats, floor=1e-2):
  """`tree_errors` from {path: (max |got - want|, max |want|)}, as a child process reports them."""
  top = max((scale for _, scale in stats.values()), default=0.0)
  return {k: diff / max(scale, floor * top, 1e-30) for k, (diff, scale) in stats.items()}


def assert_close(errors, tolerance, what):
  """Asserts every normwise error in `errors` (a dict, or one float) is at most `tolerance`."""
  if not isinstance(errors, dict):
    errors = {'': float(errors)}
  worst = max(errors, key=errors.get)
  log = os.environ.get('VIT_JAX_SPREAD_LOG')
  if log:
    test = os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]
    with open(log, 'a', encoding='utf-8') as f:
      f.write(
        json.dumps(
          {
            'test': test,
            'what': what,
            'error': errors[worst],
            'tolerance': tolerance,
            'flags': os.environ.get('XLA_FLAGS', ''),
          }
        )
        + '\n'
      )
  assert errors[worst] <= tolerance, (
    f'{what}: {worst} differs by {errors[worst]:.3g} > {tolerance:g}'
  )


def assert_trees_close(got, want, tolerance, what, floor=1e-2):
  """`tree_errors(got, want, floor)` all at most `tolerance`."""
  assert_close(tree_errors(got, want, floor), tolerance, what)


# ---------------------------------------------------------------------------
# A prepared TFDS dataset, made by TFDS itself (which needs TensorFlow to write).


def fake_tfds_dataset(data_dir, name, features, example, splits, file_format='array_record'):
  """Prepares TFDS dataset `name` (a real name such as cifar10 is fine: it is not registered)
  in `data_dir` with TFDS's own builder code; `features(tfds)` gives its FeaturesDict entries,
  `example(split, i)` its i-th example. Skips the test without TensorFlow."""
  import pytest

  pytest.importorskip('tensorflow')
  tfds = pytest.importorskip('tensorflow_datasets')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features(tfds)))

  def _split_generators(self, dl_manager):
    return {split: _generate_examples(split, n) for split, n in splits.items()}

  def _generate_examples(split, n):
    for i in range(n):
      yield i, example(split, i)

  methods = {'name': name, 'VERSION': tfds.core.Version('1.0.0'), '_info': _info}
  methods.update(_split_generators=_split_generators, _generate_examples=_generate_examples)
  with tfds.core.registered.skip_registration():
    builder_class = type('Fake', (tfds.core.GeneratorBasedBuilder,), methods)
  builder = builder_class(data_dir=str(data_dir), file_format=file_format)
  builder.download_and_prepare()
  return builder
