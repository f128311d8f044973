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
import socket
import subprocess
import sys
import tempfile
import time

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

from vit_jax import checkpoint  # noqa: E402
from vit_jax import models  # noqa: E402
from vit_jax.configs import architectures  # noqa: E402
from vit_jax.configs import model_spec  # noqa: E402
from vit_jax.configs.data import add_data_config  # noqa: E402
from vit_jax.core import cli  # noqa: E402
from vit_jax.core import files  # noqa: E402
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


def random_flat_like(shapes, seed=0, scale=0.05):
  """Flat float32 parameters shaped like the tree `shapes`: Normal(0, scale), plus 1 for norm
  scales (LayerNorm and GroupNorm scales near 1 keep activations in a realistic range)."""
  rng = np.random.default_rng(seed)
  return {
    k: (scale * rng.normal(size=v.shape) + k.endswith('/scale')).astype(np.float32)
    for k, v in checkpoint.flatten(shapes).items()
  }


def random_flat(config, num_classes, size, seed=0):
  """`random_flat_like` the parameters of a ViT of `config` at `size` px."""
  return random_flat_like(param_shapes(config, num_classes, size), seed)


def random_images(size, n=2, seed=1):
  """`n` float32 images of `size` x `size` px, uniform in [-1, 1]."""
  return np.random.default_rng(seed).uniform(-1, 1, (n, size, size, 3)).astype(np.float32)


def relative_error(a, b):
  """max |a - b| / max |b|: logits against a peer's."""
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def current_flax_names(flat):
  """Flat parameters under the names current Flax gives the official model's layers (its
  MlpBlock_0 where this package and the released files have MlpBlock_3, ...)."""
  renames = {
    'LayerNorm_2': 'LayerNorm_1',
    'MultiHeadDotProductAttention_1': 'MultiHeadDotProductAttention_0',
    'MlpBlock_3': 'MlpBlock_0',
  }
  return {'/'.join(renames.get(part, part) for part in k.split('/')): v for k, v in flat.items()}


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


def run_module(name, *args, env=None, timeout=300):
  """`python -m vit_jax.NAME ARGS` from the checkout's root (where configs/ is), as a user runs
  it, in `env` (default `subprocess_env()`): its CompletedProcess, output as text."""
  return subprocess.run(
    [sys.executable, '-m', f'vit_jax.{name}', *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env or subprocess_env(),
    timeout=timeout,
  )


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


def timm_naflex_logits(model, packed):
  """The logits of timm's NaFlexVit `model` on a packed batch ([batch, tokens, pixels + 3]:
  each token's pixels, then its patch row and column and 1 where it is real)."""
  import torch

  with torch.no_grad():
    return model(
      torch.from_numpy(packed[..., :-3]),
      patch_coord=torch.from_numpy(packed[..., -3:-1].astype(np.int64)),
      patch_valid=torch.from_numpy(packed[..., -1] > 0),
    ).numpy()


def save_timm_file(model, path) -> str:
  """A torch `model`'s state dict written as a safetensors file at `path` (folders made)."""
  from safetensors import torch as safetensors_torch

  os.makedirs(os.path.dirname(path), exist_ok=True)
  safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
  return str(path)


def timm_hub_file(tmp_path, name, tag, model) -> str:
  """`model` saved where `timm.create_model(name.tag, pretrained=True)` leaves its download."""
  return save_timm_file(
    model, tmp_path / f'models--timm--{name}.{tag}' / 'snapshots' / 'c0' / 'model.safetensors'
  )


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


@pytest.fixture(scope='session')
def torch_process_group(tmp_path_factory):
  """A one-process gloo group of torch.distributed: DINOv2's reference losses all-reduce (its
  iBOT Sinkhorn-Knopp even without a group)."""
  dist = pytest.importorskip('torch.distributed')
  if not dist.is_initialized():
    store = tmp_path_factory.mktemp('torch_dist') / 'store'
    dist.init_process_group('gloo', init_method=f'file://{store}', rank=0, world_size=1)
  yield dist
  if dist.is_initialized():
    dist.destroy_process_group()


def fake_image_dataset(data_dir, name, shape, classes, example, splits, label='label', **kw):
  """`fake_tfds_dataset` of an image of `shape` and a class label named `label`: `classes` is
  their number or their names; `example(split, i)` gives the i-th example."""
  kind = 'names' if isinstance(classes, (list, tuple)) else 'num_classes'
  return fake_tfds_dataset(
    data_dir,
    name,
    lambda t: {
      'image': t.features.Image(shape=shape),
      label: t.features.ClassLabel(**{kind: classes}),
    },
    example,
    splits,
    **kw,
  )


def write_photo_folder(root, per_class, classes):
  """An image folder at `root` of crops of scikit-learn's photos (`input_speed.write_photos`:
  JPEGs of several sizes), with a PNG and a grey JPEG added to train's first two classes."""
  from PIL import Image
  from sklearn.datasets import load_sample_images

  from vit_jax.bench import input_speed

  input_speed.write_photos(root, per_class, classes=classes)
  flower = load_sample_images().images[1]
  Image.fromarray(flower[::4, ::4]).save(os.path.join(root, 'train', 'class0', 'png.png'))
  Image.fromarray(flower[::3, ::3, 1]).save(os.path.join(root, 'train', 'class1', 'grey.jpg'))
  return root


# ---------------------------------------------------------------------------
# What a user has: the `testing` model's weights, finished and stopped workdirs, a folder of
# digits named in three scripts, and the commands run as `python -m` runs them.

TESTING_SIZE = 32  # the `testing` model (16 px patches) at a 2 x 2 grid
# A folder named in three scripts and with spaces; classes and files likewise, and one file
# whose name is Latin-1 bytes (not UTF-8: Python sees surrogate escapes, in any locale).
FOLDER = 'données данные 数据'
CLASSES = ['zéro', 'один', '二 two']
LATIN1_FILE = b'caf\xe9 latin-1.png'
# What the host lookup of `vit_jax.core.files` answers for gs:// under the `offline` fixture.
OFFLINE = ('storage.googleapis.com', 'Temporary failure in name resolution')


def digit_pngs(root, per_split=(('train', 12), ('test', 4))):
  """DIR/<split>/<class>/<file> of digits 0, 1, 2 under the non-ASCII names above."""
  from PIL import Image

  from vit_jax.data.readers import builtin

  pixels, labels = builtin.load_digits()
  for split, count in per_split:
    for label, name in enumerate(CLASSES):
      folder = os.path.join(os.fsencode(root), os.fsencode(split), name.encode('utf-8'))
      os.makedirs(folder)
      members = np.flatnonzero(labels == label)[: 2 * count]
      for i, index in enumerate(members[:count] if split == 'train' else members[count:]):
        name_bytes = LATIN1_FILE if (split, i) == ('train', 0) else f'échantillon {i} 图.png'
        if isinstance(name_bytes, str):
          name_bytes = name_bytes.encode('utf-8')
        Image.fromarray(pixels[index]).save(os.path.join(folder, name_bytes), format='PNG')
  return str(root)


@pytest.fixture(scope='module')
def digit_folder(tmp_path_factory):
  """A folder dataset of three digits (12 train, 4 test images each) under FOLDER's names."""
  return digit_pngs(tmp_path_factory.mktemp('data') / FOLDER)


def tiny_params(num_classes, favourite=None):
  """Random parameters of the `testing` model; with `favourite`, a head that prefers that
  class whatever the image."""
  shapes = param_shapes(architectures.MODEL_CONFIGS['testing'], num_classes, TESTING_SIZE)
  params = random_like(shapes, scale=0.02)
  if favourite is not None:
    params['head']['kernel'] = np.zeros_like(params['head']['kernel'])
    params['head']['bias'] = np.where(np.arange(num_classes) == favourite, 20.0, 0.0)
  return params


def tiny_workdir(path, dataset, *, finished=True, favourite=1, num_classes=len(CLASSES)):
  """A training workdir of the `testing` model on `dataset`: finished (params.npz) or
  stopped (only a checkpoint at step 5, as a preempted run leaves it)."""
  import orbax.checkpoint as ocp

  from vit_jax import workdir as workdir_lib

  os.makedirs(path)
  (path / 'config.json').write_text(json.dumps({'model': 'testing', 'dataset': dataset}))
  params = tiny_params(num_classes, favourite)
  if finished:
    checkpoint.save_npz(params, path / 'params.npz')
  else:
    manager = ocp.CheckpointManager(workdir_lib.checkpoints_dir(str(path), absolute=True))
    state = {'params': params, 'step': np.asarray(5, np.int32)}  # (orbax 0.11: no numpy scalars)
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    manager.close()
  return str(path)


def dataset_record(dataset, classes, *, registered=False):
  """dataset.json as a run writes it (`vit_jax.data.datasets.record`)."""
  path = None if registered else os.path.realpath(dataset)
  return {
    'dataset': dataset,
    'path': path,
    'registered': registered,
    'num_classes': len(classes) if isinstance(classes, list) else classes,
    'class_names': classes if isinstance(classes, list) else None,
  }


def run_command(main, argv, capsys):
  """(exit status, stdout, stderr) of a command's `main(argv)` as `python -m` runs it."""
  capsys.readouterr()
  try:
    code = cli.run(main, argv)
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture
def offline(monkeypatch):
  """gs:// out of reach, as on a machine without network, whatever this one has."""
  monkeypatch.setattr(
    files, '_unreachable', lambda scheme: OFFLINE if scheme == 'gs' else None, raising=False
  )


@pytest.fixture
def user_files(tmp_path):
  """Files a user passes to the commands: {'tmp': a folder, 'npz': a checkpoint of the
  `testing` model, 'png': an image, 'file': a text file}; beside them empty.png,
  text.jpg (text), notes/ (no image) and latin1.txt (labels not in UTF-8)."""
  from PIL import Image

  npz = checkpoint.save_npz(tiny_params(3), tmp_path / 'model.npz')
  png = tmp_path / 'images' / 'digit.png'
  png.parent.mkdir()
  Image.fromarray(np.zeros((8, 8), np.uint8)).save(png)
  (tmp_path / 'file.txt').write_text('a file')
  (tmp_path / 'empty.png').write_bytes(b'')
  (tmp_path / 'text.jpg').write_text('not an image')
  (tmp_path / 'notes').mkdir()
  (tmp_path / 'notes' / 'a.txt').write_text('not an image')
  (tmp_path / 'latin1.txt').write_bytes('café\nthé\nlait\n'.encode('latin-1'))
  return {'tmp': tmp_path, 'npz': npz, 'png': png, 'file': tmp_path / 'file.txt'}


# A run of the `testing` model long enough (400 steps) to be stopped by a signal midway, as
# flags of python -m vit_jax.main.
STOPPABLE_RUN = [
  '--config.model=testing',
  f'--config.pp.crop={TESTING_SIZE}',
  '--config.batch=12',
  '--config.batch_eval=12',
  '--config.total_steps=400',
  '--config.warmup_steps=2',
  '--config.progress_every=2',
  '--config.eval_every=1000',
  '--config.checkpoint_every=1000',
  '--config.tensorboard=True',
]


def wait_for_child(predicate, process, timeout=300, check=True):
  """Polls `predicate` until it holds or `timeout` s pass; with `check`, fails at once if the
  child `process` ends first."""
  deadline = time.time() + timeout
  while time.time() < deadline and not predicate():
    if check and process.poll() is not None:
      raise AssertionError(f'ended early: {process.communicate()[1][-3000:]}')
    time.sleep(0.002 if not check else 0.05)


# ---------------------------------------------------------------------------
# Runs of several processes, as SLURM or a TPU pod starts them (jax.distributed on 127.0.0.1,
# CPU, gloo), and their results compared bit for bit.

MAIN = [sys.executable, '-m', 'vit_jax.main']


def free_port() -> int:
  """A TCP port of 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def coordinator_flags(address, num_processes, process_id) -> list:
  """The flags of python -m vit_jax.main that make it rank `process_id` of `num_processes`."""
  return [
    f'--coordinator_address={address}',
    f'--num_processes={num_processes}',
    f'--process_id={process_id}',
  ]


def start_ranks(argv, num_processes=2, devices=1, logs=None):
  """Starts python -m vit_jax.main once per rank with `argv` (a list, or a function of the
  rank) and the coordinator flags of one run, on `devices` CPU devices each; each rank's
  stdout and stderr go to `logs`/rank{i}.out and .err, or to text pipes without `logs`."""
  address = f'127.0.0.1:{free_port()}'
  if logs:
    os.makedirs(logs, exist_ok=True)
  processes = []
  for i in range(num_processes):
    args = argv(i) if callable(argv) else argv
    if logs:
      out = open(os.path.join(logs, f'rank{i}.out'), 'w')
      err = open(os.path.join(logs, f'rank{i}.err'), 'w')
    else:
      out = err = subprocess.PIPE
    processes.append(
      subprocess.Popen(
        [*MAIN, *args, *coordinator_flags(address, num_processes, i)],
        env=subprocess_env(devices=devices),
        stdout=out,
        stderr=err,
        text=True,
      )
    )
    if logs:
      out.close()
      err.close()
  return processes


def final_params(workdir) -> dict:
  """The flat parameters a finished run wrote (its params.npz)."""
  return checkpoint.flatten(checkpoint.load(os.path.join(workdir, 'params.npz')))


def assert_bitwise_equal(a, b):
  """Two flat parameter dicts hold the same names and the same bits."""
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
