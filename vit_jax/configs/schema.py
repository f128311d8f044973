"""Every config field of a run, declared once, and the rules its values obey.

A `Field` is a dotted name, its default, its type, the values it may take
(for a field with a set of choices) and a one-line doc. From `FIELDS` come
the defaults of every experiment config (`defaults`, which
`common.get_config` and `data.data_config` return), the names the command
line knows (`names`, `configs.flag.unknown_fields`), the tuples the code reads
(`allowed`: `attention.ATTENTION`, ...) and the table in
docs/training.md (`python -m vit_jax.configs.schema` prints it;
tests/test_configs.py holds the two equal).

`RULES` are the checks of the values, one named function each: the choices,
then what fields must agree on with each other and with the devices.
`validate` runs them all once, before a run builds anything
(`training.program.validate`); the input pipeline runs `DATA_RULES` for its
callers that skip the trainer. What only the data or the model can tell (a
multi-label dataset, a checkpoint's shapes, how heads split over devices) is
checked there.

Adding a field is an entry in `FIELDS` and the code that reads it. The
config files, the official-config translation and every
`--config.FIELD=...` flag see plain ConfigDict fields, as before.
"""

import dataclasses
from typing import Any, Optional, Tuple

import ml_collections

from vit_jax.configs import ConfigError


@dataclasses.dataclass(frozen=True)
class Field:
  name: str  # dotted: 'pp.crop' is `crop` in the section `pp`
  default: Any  # None: unset, a typed placeholder that --config.NAME=... can still set
  type: type
  doc: str
  allowed: Optional[Tuple[str, ...]] = None  # the values a field with choices may take
  data: bool = False  # read by the input pipeline (`data.data_config` holds these alone)
  # A number's interval, '[1, inf)' or '[0, 1)' (of each element, for a tuple): `numbers_in_bounds`.
  bounds: Optional[str] = None


_DTYPES = ('float32', 'bfloat16', 'float16')

FIELDS = (
  # The model: a `configs.architectures.MODEL_CONFIGS` name plus run-time choices.
  Field('model', 'ViT-B_16', str, 'the architecture, a `MODEL_CONFIGS` name'),
  Field(
    'task',
    'classification',
    str,
    'what is learnt: labels, masked patch prediction (paper B.1.2), or self-distillation as '
    'DINOv2 (`dino`: a student and its EMA teacher on multi-crops; labels unused by both)',
    ('classification', 'mpp', 'dino'),
  ),
  Field('dtype', 'float32', str, 'the compute dtype', _DTYPES),
  Field(
    'fp8',
    False,
    bool,
    "the encoder's dense layers (q/k/v/out, MLP) as FP8 products with current scaling "
    '(vit_jax.models.fp8): FP8 tensor cores on Hopper/Ada GPUs, emulated elsewhere',
  ),
  Field('remat', False, bool, 'recompute blocks in the backward pass'),
  Field(
    'remat_policy',
    'nothing_saveable',
    str,
    'what `remat` keeps of a block for the backward pass: nothing, every matmul output, or '
    'those without a batch dimension (big_vision for ViT-22B)',
    ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable'),
  ),
  Field(
    'scan_layers',
    False,
    bool,
    'the encoder blocks as one nn.scan: compile time and program size flat in depth; '
    'checkpoints and exports still name encoderblock_{i}',
  ),
  Field(
    'attention',
    'auto',
    str,
    "how attention is computed: 'auto' takes cuDNN's fused kernel where it applies "
    '(a CUDA GPU, bf16), else XLA; `explicit` keeps the weights (docs/speed_and_scale.md)',
    ('auto', 'xla', 'cudnn', 'explicit'),
  ),
  Field(
    'attention_chunk',
    0,
    int,
    'where attention is written out (CPUs, TPUs; `explicit`): queries per chunk, each '
    "chunk's logits recomputed in the backward pass, so a long sequence holds one chunk's "
    'logits instead of all; 0: all queries at once',
    bounds='[0, inf)',
  ),
  Field(
    'depth',
    None,
    int,
    "encoder blocks, overriding the model's (a shallower copy of a giant model; the compile "
    "command's depth extrapolation); None: the model's own",
    bounds='[1, inf)',
  ),
  # Block variants beyond the paper (ViT-22B), for any size (vit_jax.models.vit).
  Field('block.parallel_block', None, bool, "attention and MLP in parallel; None: the model's"),
  Field('block.qk_norm', None, bool, "LayerNorm of queries and keys; None: the model's"),
  Field(
    'block.biases',
    None,
    str,
    "which biases exist: 'all', 'no_key' (none in the keys' projection: EVA-02), 'no_qkv' "
    "(none in the q/k/v projections: DINOv3) or 'no_qkv_or_norm' (none there and in the "
    "LayerNorms: ViT-22B); None: the model's",
    ('all', 'no_key', 'no_qkv', 'no_qkv_or_norm'),
  ),
  Field(
    'block.layer_scale',
    None,
    float,
    'LayerScale (Touvron et al. 2021): each residual branch scaled by a learned gamma per '
    "channel (timm's ls1, ls2) that starts at this value, e.g. 1e-5; None: the model's (none)",
    bounds='(0, inf)',
  ),
  Field(
    'patch_size',
    None,
    int,
    "FlexiViT (vit_jax.models.flexi): the patch size to train at, a pretrained checkpoint's "
    'patch embedding PI-resized to it and its position embeddings to the new grid; None: the '
    "model's",
    bounds='[1, inf)',
  ),
  Field(
    'posemb_resize',
    'zoom',
    str,
    "how a pretrained checkpoint's position embeddings are resized to the run's grid (and "
    "FlexiViT's per step): 'zoom' as the official code, half-pixel 'bilinear', or torch's "
    "antialiased filters ('bicubic_antialias' is timm's default)",
    ('zoom', 'bilinear', 'bilinear_antialias', 'bicubic_antialias'),
  ),
  Field(
    'patch_resize',
    'bilinear',
    str,
    "the resize of a patch that FlexiViT's PI-resize of the patch embedding inverts: "
    "FlexiViT's 'bilinear', or an antialiased one ('bicubic_antialias' is timm's default)",
    ('bilinear', 'bilinear_antialias', 'bicubic_antialias'),
  ),
  Field(
    'flexi_patch_sizes',
    (),
    tuple,
    "patch sizes to draw one from per training step, the model's kernel and position "
    'embeddings resized to it on the fly (FlexiViT); evaluation at its own; () = off',
    bounds='[1, inf)',
  ),
  Field(
    'naflex_tokens',
    (),
    tuple,
    'NaFlex (vit_jax.models.naflex) token budgets: each training image keeps its aspect '
    'ratio, resized to fit a budget drawn from these; evaluation at pp.crop; () = off',
    bounds='[1, inf)',
  ),
  Field(
    'naflex_resample',
    'bilinear',
    str,
    "how a NaFlex ViT resamples its position table to each image's grid: 'bilinear' as "
    "big_vision, or torch's antialiased filters (timm NaFlexVit's default: 'bicubic_antialias')",
    ('bilinear', 'bilinear_antialias', 'bicubic_antialias'),
  ),
  Field(
    'num_registers',
    0,
    int,
    'register tokens (Darcet et al. 2023) after the class token, dropped before the head',
    bounds='[0, inf)',
  ),
  Field('dropout_rate', 0.0, float, "dropout of the encoder's activations", bounds='[0, 1)'),
  Field('attention_dropout_rate', 0.0, float, 'dropout of the attention weights', bounds='[0, 1)'),
  Field(
    'drop_path_rate',
    0.0,
    float,
    "stochastic depth: each block's residual branches dropped per example in training with "
    'this probability, the same in every block (DINOv2: 0.3-0.4)',
    bounds='[0, 1)',
  ),
  Field(
    'representation_size', None, int, "the pre-logits width; None: the model's", bounds='[1, inf)'
  ),
  Field(
    'head_bias_init',
    0.0,
    float,
    'the head bias at start: -10 with the sigmoid loss (B.1)',
    bounds='(-inf, inf)',
  ),
  Field('pretrained_path', None, str, 'weights to start from: a .npz or a workdir'),
  # The data (docs/data.md).
  Field(
    'dataset',
    'digits',
    str,
    "a TFDS name or preset ('cifar10', 'imagenet2012', 'vtab/dtd'), the built-in 'digits', "
    'a folder DIR/{train,test}/<class>/*, or a shard directory with info.json',
    data=True,
  ),
  Field(
    'tfds_data_dir',
    None,
    str,
    "where prepared TFDS datasets are; None: $TFDS_DATA_DIR or TFDS's default",
    data=True,
  ),
  Field(
    'tfds_manual_dir',
    None,
    str,
    'manual downloads (ImageNet tars, ImageNet-21k folders)',
    data=True,
  ),
  Field('pp.train', None, str, "train split, e.g. 'train[:98%]'; None: the preset's", data=True),
  Field('pp.test', None, str, "test split; None: the preset's", data=True),
  Field(
    'pp.crop',
    224,
    int,
    'train and eval resolution (paper B.1.1: 224 pre-train, 384 fine-tune)',
    data=True,
    bounds='[1, inf)',
  ),
  Field(
    'pp.resize',
    None,
    int,
    'eval: resize to this, then centre crop to `crop`; None: resize to the crop',
    data=True,
    bounds='[1, inf)',
  ),
  Field(
    'pp.inception_crop',
    None,
    bool,
    "train: random area/aspect crop, else resize like eval; None: the preset's",
    data=True,
  ),
  Field(
    'pp.area_min',
    None,
    float,
    "inception crop: the smallest crop area, in (0, 1]; None: the preset's (0.05)",
    data=True,
    bounds='(0, 1]',
  ),
  Field('pp.flip', None, bool, "train: random horizontal flip; None: the preset's", data=True),
  Field(
    'pp.randaug_layers',
    0,
    int,
    'RandAugment ops per image (AugReg: 2); 0 = off',
    data=True,
    bounds='[0, inf)',
  ),
  Field(
    'pp.randaug_magnitude',
    10,
    int,
    "RandAugment magnitude, 10 = the ops' full range",
    data=True,
    bounds='[0, 10]',
  ),
  Field(
    'pp.mixup', 0.0, float, 'Mixup Beta(alpha, alpha) alpha; 0 = off', data=True, bounds='[0, inf)'
  ),
  Field(
    'batch',
    512,
    int,
    'the global train batch, split evenly over processes',
    data=True,
    bounds='[1, inf)',
  ),
  Field('batch_eval', 512, int, 'the global eval batch', data=True, bounds='[1, inf)'),
  Field(
    'prefetch',
    2,
    int,
    'batches transferred to the devices ahead of use',
    data=True,
    bounds='[0, inf)',
  ),
  Field(
    'input_threads',
    0,
    int,
    'decode threads of the input pipeline; 0 = every core this process may use',
    data=True,
    bounds='[0, inf)',
  ),
  Field(
    'seed',
    0,
    int,
    'initialisation, data order and augmentation are pure functions of (seed, step)',
    data=True,
    bounds='[0, 4294967296)',
  ),
  Field(
    'allow_missing_classes',
    False,
    bool,
    'image folders: a class folder may be absent from a split (else a one-line error)',
    data=True,
  ),
  Field(
    'eval_cache_mb',
    1024,
    int,
    'keep preprocessed eval data in host memory when below this',
    data=True,
    bounds='[0, inf)',
  ),
  Field(
    'corrupt_images',
    'skip',
    str,
    'image folders and shards: an image that cannot be decoded is left out (logged and '
    'counted), or stops the run',
    ('skip', 'fail'),
    data=True,
  ),
  # Optimisation (paper Appendix B.1).
  Field(
    'optimizer',
    'adam',
    str,
    'Adam (pre-training) or SGD with momentum (fine-tuning), paper B.1',
    ('adam', 'sgd'),
  ),
  Field(
    'optim_dtype', 'float32', str, "the dtype of Adam's first moment / SGD's momentum", _DTYPES
  ),
  Field('b1', 0.9, float, "Adam's first-moment decay", bounds='[0, 1)'),
  Field('b2', 0.999, float, "Adam's second-moment decay", bounds='[0, 1)'),
  Field('momentum', 0.9, float, "SGD's momentum", bounds='[0, 1)'),
  Field('base_lr', 1e-3, float, 'the learning rate after warm-up', bounds='[0, inf)'),
  Field(
    'warmup_steps', 10_000, int, 'linear warm-up from 0, in [0, total_steps)', bounds='[0, inf)'
  ),
  Field('decay_type', 'linear', str, 'the learning rate after warm-up', ('linear', 'cosine')),
  Field(
    'linear_end',
    1e-5,
    float,
    "where the linear decay ends (the official schedule's floor)",
    bounds='[0, inf)',
  ),
  Field(
    'weight_decay',
    0.0,
    float,
    'decoupled weight decay, of what `weight_decay_on` names',
    bounds='[0, inf)',
  ),
  Field(
    'weight_decay_on',
    'kernels',
    str,
    'what weight decay shrinks: kernels only (big_vision, the official fine-tuning), or every '
    'parameter, biases, norms and embeddings too (an optimizer without a mask)',
    ('kernels', 'all'),
  ),
  Field(
    'layer_decay',
    1.0,
    float,
    'layer-wise learning-rate decay (Clark et al. 2020; as BEiT and EVA-02 fine-tune): '
    'block i of L learns at base_lr * layer_decay ** (L - i), the embeddings at '
    'layer_decay ** (L + 1), the head at base_lr; 1 = off',
    bounds='(0, 1]',
  ),
  Field(
    'grad_norm_clip', 1.0, float, 'clip gradients at this global norm; 0 = off', bounds='[0, inf)'
  ),
  Field('label_smoothing', 0.0, float, 'label smoothing of the targets', bounds='[0, 1]'),
  Field(
    'ema_decay', 0.0, float, 'Polyak averaging factor of the parameters; 0 = off', bounds='[0, 1)'
  ),
  Field(
    'loss',
    'softmax',
    str,
    'softmax cross-entropy, or sigmoid for multi-label data such as JFT (paper B.1)',
    ('softmax', 'sigmoid'),
  ),
  Field('total_steps', 10_000, int, 'optimizer steps of the run', bounds='[1, inf)'),
  Field(
    'accum_steps', 1, int, 'micro-batches per step (same math, less memory)', bounds='[1, inf)'
  ),
  Field('skip_nonfinite', False, bool, 'skip NaN/Inf steps instead of stopping'),
  Field(
    'max_nonfinite_in_a_row',
    10,
    int,
    'with skip_nonfinite: this many skipped steps in a row stop the run (a diverged run skips '
    'every step, a bad batch one)',
    bounds='[1, inf)',
  ),
  # Few-shot linear evaluation of the frozen pre-logits (paper 4.1), on the train/test
  # splits of other datasets, every `every` steps and at the end.
  Field('fewshot.datasets', (), tuple, "e.g. ('cifar10', 'vtab/dtd'); () = off"),
  Field(
    'fewshot.every', 0, int, 'steps between evaluations; 0 = only at the end', bounds='[0, inf)'
  ),
  Field('fewshot.shots', (1, 5, 10, 25), tuple, 'examples per class', bounds='[1, inf)'),
  Field(
    'fewshot.seeds', (0, 1, 2), tuple, 'draws of the examples, averaged', bounds='[0, 4294967296)'
  ),
  Field('fewshot.l2_reg', 2.0**10, float, 'the ridge regression penalty', bounds='(0, inf)'),
  Field(
    'fewshot.train_split',
    'train',
    str,
    "'train' / 'test' = the dataset's own; or a split expression",
  ),
  Field('fewshot.test_split', 'test', str, "'train' / 'test' = the dataset's own, or a split"),
  # Self-distillation as DINOv2 (task='dino'; vit_jax.training.dino, docs/self_supervised.md).
  # Counted in optimizer steps; DINOv2's recipes count epochs of 1,250 steps.
  Field(
    'dino.local_crops',
    8,
    int,
    'local crops per image, beside the 2 global crops at pp.crop',
    data=True,
    bounds='[0, inf)',
  ),
  Field(
    'dino.local_crop',
    98,
    int,
    "the local crops' side in px, a multiple of the patch size (DINOv2: 98 for patch 14)",
    data=True,
    bounds='[1, inf)',
  ),
  Field(
    'dino.global_scale',
    (0.32, 1.0),
    tuple,
    "the global crops' (smallest, largest) fraction of the image's area",
    data=True,
    bounds='(0, 1]',
  ),
  Field(
    'dino.local_scale',
    (0.05, 0.32),
    tuple,
    "the local crops' (smallest, largest) fraction of the image's area",
    data=True,
    bounds='(0, 1]',
  ),
  Field(
    'dino.prototypes',
    65536,
    int,
    "the DINO head's prototypes, its output width (DINOv2 ViT-L/g: 131072)",
    bounds='[1, inf)',
  ),
  Field('dino.head_hidden', 2048, int, "the DINO head's hidden width", bounds='[1, inf)'),
  Field(
    'dino.head_bottleneck',
    256,
    int,
    "the DINO head's bottleneck, L2-normalised before the prototypes (DINOv2 ViT-L/g: 384)",
    bounds='[1, inf)',
  ),
  Field(
    'dino.head_layers', 3, int, "the DINO head's linear layers before the norm", bounds='[1, inf)'
  ),
  Field(
    'dino.weight',
    1.0,
    float,
    'weight of the DINO loss (class tokens: each view against the other views)',
    bounds='[0, inf)',
  ),
  Field(
    'dino.koleo_weight',
    0.1,
    float,
    "weight of KoLeo, spreading the student's class tokens of each global crop",
    bounds='[0, inf)',
  ),
  Field(
    'dino.centering',
    'sinkhorn_knopp',
    str,
    "the teacher's targets: Sinkhorn-Knopp (DINOv2's recipes) or a softmax less a running "
    'centre (DINO)',
    ('sinkhorn_knopp', 'centre'),
  ),
  Field(
    'dino.centre_momentum',
    0.9,
    float,
    "with centering='centre': the running centre's momentum per step",
    bounds='[0, 1)',
  ),
  Field('dino.student_temp', 0.1, float, "the student's softmax temperature", bounds='(0, inf)'),
  Field(
    'dino.teacher_temp',
    0.07,
    float,
    "the teacher's temperature after its warm-up",
    bounds='(0, inf)',
  ),
  Field(
    'dino.warmup_teacher_temp',
    0.04,
    float,
    "the teacher's temperature at step 0, linear to teacher_temp",
    bounds='(0, inf)',
  ),
  Field(
    'dino.teacher_temp_warmup_steps',
    37_500,
    int,
    "steps of the teacher temperature's warm-up (DINOv2: 30 epochs)",
    bounds='[0, inf)',
  ),
  Field(
    'dino.teacher_momentum',
    0.992,
    float,
    "the teacher's EMA momentum at step 0, cosine to 1 at the last step",
    bounds='[0, 1]',
  ),
  Field(
    'dino.weight_decay_end',
    0.4,
    float,
    'weight decay follows a cosine from weight_decay to this (no decay of biases, norms, '
    'LayerScale)',
    bounds='[0, inf)',
  ),
  Field(
    'dino.min_lr',
    1e-6,
    float,
    "where the learning rate's cosine ends, after the linear warm-up to base_lr",
    bounds='[0, inf)',
  ),
  Field(
    'dino.freeze_last_layer_steps',
    1250,
    int,
    "the heads' prototypes stay as they are for this many steps (DINOv2: 1 epoch)",
    bounds='[0, inf)',
  ),
  Field(
    'dino.patch_embed_lr_mult',
    0.2,
    float,
    "the patch embedding's learning rate relative to the layer-decayed one",
    bounds='[0, inf)',
  ),
  # iBOT's masked-patch loss (Zhou et al. 2022) on block-masked global crops.
  Field('ibot.weight', 1.0, float, "weight of iBOT's masked-patch loss", bounds='[0, inf)'),
  Field(
    'ibot.mask_probability',
    0.5,
    float,
    'the probability that a global crop is masked',
    data=True,
    bounds='[0, 1]',
  ),
  Field(
    'ibot.mask_ratio',
    (0.1, 0.5),
    tuple,
    "a masked crop's (smallest, largest) fraction of masked patches",
    data=True,
    bounds='[0, 1]',
  ),
  Field(
    'ibot.separate_head',
    False,
    bool,
    "the masked patches through their own head (DINOv2 ViT-L/g), else the DINO head's",
  ),
  Field('ibot.prototypes', 65536, int, "a separate iBOT head's prototypes", bounds='[1, inf)'),
  Field('ibot.head_hidden', 2048, int, "a separate iBOT head's hidden width", bounds='[1, inf)'),
  Field('ibot.head_bottleneck', 256, int, "a separate iBOT head's bottleneck", bounds='[1, inf)'),
  Field('ibot.head_layers', 3, int, "a separate iBOT head's linear layers", bounds='[1, inf)'),
  # k-NN classification of frozen features (DINO: cosine, k = 20, T = 0.07), of the evaluated
  # parameters (the teacher of a dino run), every `every` steps and at the end.
  Field('knn.datasets', (), tuple, "e.g. ('digits', 'cifar10'); () = off"),
  Field('knn.every', 0, int, 'steps between evaluations; 0 = only at the end', bounds='[0, inf)'),
  Field('knn.k', 20, int, 'neighbours that vote', bounds='[1, inf)'),
  Field(
    'knn.temperature',
    0.07,
    float,
    "each neighbour's vote: exp(cosine / temperature)",
    bounds='(0, inf)',
  ),
  Field('knn.train_split', 'train', str, "the labelled neighbours: 'train', or a split"),
  Field('knn.test_split', 'test', str, "what is classified: 'test', or a split"),
  # Devices: a (slice, data, fsdp, model) mesh over all devices (vit_jax.core.sharding); slices come
  # from the devices.
  Field(
    'mesh.fsdp',
    1,
    int,
    '> 1 shards params and optimizer state over this many devices',
    bounds='[1, inf)',
  ),
  Field(
    'mesh.model', 1, int, '> 1 splits heads and MLP units (tensor parallelism)', bounds='[1, inf)'
  ),
  Field(
    'mesh.data', None, int, 'data-parallel devices; None: the devices left over', bounds='[1, inf)'
  ),
  # The loop.
  Field('progress_every', 100, int, 'steps between progress lines', bounds='[0, inf)'),
  Field('eval_every', 1000, int, 'steps between evaluations', bounds='[0, inf)'),
  Field('checkpoint_every', 1000, int, 'steps between checkpoints', bounds='[0, inf)'),
  Field('keep_checkpoints', 3, int, 'checkpoints kept', bounds='[1, inf)'),
  Field('tensorboard', True, bool, 'write TensorBoard summaries'),
  Field(
    'peak_flops',
    None,
    float,
    "a device's peak FLOP/s, for MFU; None: the known peak",
    bounds='(0, inf)',
  ),
)
_BY_NAME = {f.name: f for f in FIELDS}


def allowed(name: str) -> Tuple[str, ...]:
  """The values field `name` may take."""
  return _BY_NAME[name].allowed


def defaults(*, data_only: bool = False) -> ml_collections.ConfigDict:
  """A fresh ConfigDict of every field (or of the data fields alone) at its default; a field
  that defaults to None is a typed placeholder (`--config.pp.train=train[:10%]` still works)."""
  config = ml_collections.ConfigDict()
  for field in FIELDS:
    if data_only and not field.data:
      continue
    *sections, name = field.name.split('.')
    target = config
    for section in sections:
      if section not in target:
        target[section] = ml_collections.ConfigDict()
      target = target[section]
    if field.default is None:
      target[name] = ml_collections.config_dict.placeholder(field.type)
    else:
      target[name] = field.default
  return config


def names() -> list:
  """The dotted names of every field and section (`pp`), a section before its fields."""
  seen = {}
  for field in FIELDS:
    parts = field.name.split('.')
    for i in range(1, len(parts) + 1):
      seen['.'.join(parts[:i])] = None
  return list(seen)


# ---------------------------------------------------------------------------
# The rules. Each takes the config and the devices the run has (None: the input pipeline's
# callers, which check the data fields alone) and raises ConfigError (one line).


@dataclasses.dataclass(frozen=True)
class Devices:
  count: int
  platform: str  # jax.default_backend(): 'cpu', 'gpu' or 'tpu'


_ABSENT = object()


def _value(config, name: str):
  for part in name.split('.'):
    if part not in config:
      return _ABSENT  # a data config has no run fields
    config = config[part]
  return config


def values_allowed(config, devices=None) -> None:
  """A field with choices holds one of them (or None where None is its default: unset)."""
  for field in FIELDS:
    value = _value(config, field.name)
    unset = value is None and field.default is None
    if field.allowed and value is not _ABSENT and not unset and value not in field.allowed:
      raise ConfigError(f'{field.name}={value!r}: use one of {", ".join(field.allowed)}')


def _interval(bounds: str) -> tuple:
  """'[0, 1)' -> (0.0, 1.0, low included, high included)."""
  low, high = (float(x) for x in bounds[1:-1].split(','))
  return low, high, bounds[0] == '[', bounds[-1] == ']'


def _in_bounds(value, bounds: str) -> bool:
  """Whether `value` is a number in the interval (NaN never is)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return False
  low, high, low_in, high_in = _interval(bounds)
  above = value >= low if low_in else value > low
  below = value <= high if high_in else value < high
  return bool(above and below)


def _bounds_said(name: str, value, bounds: str) -> str:
  low, high, low_in, _ = _interval(bounds)
  if high == float('inf') and low_in and low in (0, 1):
    return f'{name}={value!r} must be at least {int(low)}'
  return f'{name}={value!r} must be in {bounds}'


def numbers_in_bounds(config, devices=None) -> None:
  """Every number (and each number of a tuple field) in its field's interval, so that no value
  reaches a library as a shape, a count or a rate it cannot take."""
  for field in FIELDS:
    value = _value(config, field.name)
    if field.bounds is None or value is _ABSENT or value is None:
      continue
    if field.type is tuple:
      if not isinstance(value, (tuple, list)):
        raise ConfigError(f'{field.name}={value!r}: give a tuple, e.g. (1, 2)')
      bad = [v for v in value if not _in_bounds(v, field.bounds)]
      if bad:
        raise ConfigError(
          f'{field.name}={tuple(value)!r}: {bad[0]!r} is not a number in {field.bounds}; '
          f'{field.doc}'
        )
    elif not _in_bounds(value, field.bounds):
      raise ConfigError(f'{_bounds_said(field.name, value, field.bounds)}: {field.doc}')


def area_min_a_fraction(config, devices=None) -> None:
  area_min = config.pp.area_min
  if area_min is not None and not 0 < area_min <= 1:
    raise ConfigError(f'pp.area_min={float(area_min)}: use a fraction in (0, 1]')


def resize_covers_crop(config, devices=None) -> None:
  pp = config.pp
  if pp.resize and pp.resize < pp.crop:
    raise ConfigError(f'pp.resize={pp.resize} < pp.crop={pp.crop}: resize to at least the crop')


def batches_split(config, devices: Devices) -> None:
  """Each device takes an equal share of every micro-batch."""
  for name in ('batch', 'batch_eval'):
    if config[name] < 1:
      raise ConfigError(f'{name}={config[name]} must be at least 1')
  if not isinstance(config.accum_steps, int) or config.accum_steps < 1:
    raise ConfigError(
      f'accum_steps={config.accum_steps!r} must be a positive number of micro-batches '
      '(1: no accumulation)'
    )
  per_step = config.accum_steps * devices.count
  if config.batch % per_step:
    raise ConfigError(
      f'batch={config.batch} must be a multiple of accum_steps ({config.accum_steps}) x '
      f'devices ({devices.count}) = {per_step}'
    )
  if config.batch_eval % devices.count:
    raise ConfigError(
      f'batch_eval={config.batch_eval} must be a multiple of the number of devices '
      f'({devices.count})'
    )


def warmup_before_the_end(config, devices=None) -> None:
  if config.total_steps < 1:
    raise ConfigError(f'total_steps={config.total_steps} must be positive')
  if not 0 <= config.warmup_steps < config.total_steps:
    raise ConfigError(
      f'warmup_steps={config.warmup_steps} must be in [0, total_steps={config.total_steps}): '
      f'add --config.warmup_steps={_short_warmup(config.total_steps)}'
    )


def _short_warmup(total_steps: int) -> int:
  return total_steps // 10


def fitted_warmup(config) -> Optional[int]:
  """The warm-up of a run shorter than its config's warm-up (a tenth of the run; `main` takes
  it where the command line did not choose one), or None when the config's fits."""
  if config.total_steps >= 1 and config.warmup_steps >= config.total_steps:
    return _short_warmup(config.total_steps)
  return None


def cudnn_on_a_gpu_in_half_precision(config, devices: Devices) -> None:
  if config.attention == 'cudnn' and (
    config.dtype not in ('bfloat16', 'float16') or devices.platform != 'gpu'
  ):
    raise ConfigError(
      "attention='cudnn' needs a CUDA GPU and --config.dtype=bfloat16; "
      "use attention='auto', which takes cuDNN where it applies"
    )


def registers_with_classification(config, devices=None) -> None:
  if config.num_registers and config.task == 'mpp':
    raise ConfigError(
      f'num_registers={config.num_registers}: masked patch prediction reads patch tokens at '
      'fixed positions; train it without registers'
    )


def flexi_with_classification(config, devices=None) -> None:
  if config.flexi_patch_sizes and config.task != 'classification':
    raise ConfigError(
      f'flexi_patch_sizes trains classification only, not task={config.task!r}; leave it empty'
    )


def naflex_trains_classification(config, devices=None) -> None:
  """NaFlex (`naflex_tokens`) trains classification on packed patches, without what needs
  whole images or another task (what the model must be: `model_spec.ModelSpec.of`)."""
  if not config.naflex_tokens:
    return
  unsupported = [
    (config.task != 'classification', f'task={config.task!r}'),
    (bool(config.flexi_patch_sizes), 'flexi_patch_sizes'),
    (bool(config.pp.randaug_layers or config.pp.mixup), 'RandAugment or Mixup'),
    (min(config.naflex_tokens) < 1, 'a budget below 1 token'),
  ]
  for bad, what in unsupported:
    if bad:
      raise ConfigError(
        f'naflex_tokens={tuple(config.naflex_tokens)}: NaFlex trains classification with a '
        f'plain ViT (token or gap pooling), not with {what}; change it or leave naflex_tokens empty'
      )


def self_distillation_fits(config, devices=None) -> None:
  """task='dino': ranges that are pairs in order, and what its losses need of a step: the
  whole batch at once (Sinkhorn-Knopp and KoLeo couple its images), no second EMA."""
  if config.get('task') != 'dino':
    return
  for name in ('dino.global_scale', 'dino.local_scale', 'ibot.mask_ratio'):
    value = _value(config, name)
    if len(value) != 2 or value[0] > value[1]:
      raise ConfigError(f'{name}={tuple(value)!r}: give (smallest, largest), e.g. (0.05, 0.32)')
  if config.accum_steps != 1:
    raise ConfigError(
      f'accum_steps={config.accum_steps}: task=dino normalises and compares over the whole '
      'batch (Sinkhorn-Knopp, KoLeo), which micro-batches would change; set accum_steps=1 and '
      'save memory with --config.remat=True or --config.mesh.fsdp'
    )
  if config.ema_decay:
    raise ConfigError(
      f'ema_decay={config.ema_decay}: task=dino already keeps its teacher as the EMA of the '
      'student (dino.teacher_momentum); set ema_decay=0'
    )
  if config.batch < 2:
    raise ConfigError(
      f'batch={config.batch}: task=dino compares the images of a batch (KoLeo, Sinkhorn-Knopp); '
      'use at least 2'
    )


# What the input pipeline checks for callers that skip `validate` (data fields alone).
DATA_RULES = (values_allowed, area_min_a_fraction, numbers_in_bounds, resize_covers_crop)
RULES = (
  *DATA_RULES,
  batches_split,
  warmup_before_the_end,
  cudnn_on_a_gpu_in_half_precision,
  registers_with_classification,
  flexi_with_classification,
  naflex_trains_classification,
  self_distillation_fits,
)


def validate(config, devices: Devices) -> None:
  """Raises ConfigError (one line) for the first rule the config breaks on `devices`."""
  for rule in RULES:
    rule(config, devices)


def validate_data(config) -> None:
  """`DATA_RULES` alone: a config of the data fields (`data.data_config`) or a whole one."""
  for rule in DATA_RULES:
    rule(config)


def markdown_table() -> str:
  """The docs' table of the fields."""
  rows = ['| field | default | values | what it is |', '|---|---|---|---|']
  for f in FIELDS:
    values = ', '.join(f'`{v}`' for v in f.allowed) if f.allowed else f.type.__name__
    if f.bounds:
      values += f' in {f.bounds}'
    default = f.default if isinstance(f.default, str) else repr(f.default)
    rows.append(f'| `{f.name}` | `{default}` | {values} | {f.doc} |')
  return '\n'.join(rows)


if __name__ == '__main__':
  print(markdown_table())
