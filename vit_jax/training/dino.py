"""Self-distillation as DINOv2 trains (Oquab et al. 2023): task='dino'.

A student and its teacher, the EMA of the student's parameters, share one architecture
(`models.dino.build`: the ViT backbone with a mask token and the DINO head, optionally a
separate iBOT head). One step:

1. the teacher (no gradient, no drop path) reads the two global crops: its head's logits of
   the class tokens, and of the patch tokens that iBOT masks in the student's view, become
   targets at the scheduled teacher temperature (Sinkhorn-Knopp, or less a running centre,
   `training.dino_losses`);
2. the student reads the same global crops with the masked patches replaced by the mask token,
   and the local crops at their own size (position embeddings resized to their grid); the
   loss is dino.weight * DINO + dino.koleo_weight * KoLeo(the global class tokens, per crop) +
   ibot.weight * iBOT;
3. AdamW as DINOv2 runs it: gradients clipped per network (backbone, each head) at
   `grad_norm_clip`; per parameter the learning rate times layer_decay ** (L + 1 - depth)
   (times `patch_embed_lr_mult` for the patch embedding), weight decay from a cosine schedule
   on all but biases, norms and LayerScale; the prototypes frozen for the first
   `freeze_last_layer_steps` steps; learning rate linear warm-up then cosine to `min_lr`;
4. the teacher moves to momentum * teacher + (1 - momentum) * student, momentum a cosine from
   `teacher_momentum` to 1.

Every schedule is DINOv2's `CosineScheduler` at the step (`cosine`). The crops and masks come
from the host (`data.multicrop`). What evaluation, few-shot and k-NN probes and a run's
params.npz read is the teacher (DINOv2 evaluates and releases it).
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax

from vit_jax.configs import ConfigError
from vit_jax.configs.model_spec import Compute
from vit_jax.data import on_device
from vit_jax.evaluation import fewshot
from vit_jax.evaluation import knn
from vit_jax.models import dino as dino_models
from vit_jax.models import vit
from vit_jax.training import dino_losses
from vit_jax.training import optim
from vit_jax.training import steps

NUM_GLOBAL = 2


# ---------------------------------------------------------------------------
# Schedules.


def cosine(step, base, final, total: int, warmup: int = 0, start: float = 0.0):
  """DINOv2's `CosineScheduler(base, final, total, warmup, start)[step]`: linear from `start`
  (np.linspace over the `warmup` steps, the last one at `base`), then a half cosine from `base`
  to `final` over the remaining steps; `final` from `total` on."""
  step = jnp.asarray(step, jnp.float32)
  warm = start + (base - start) * step / max(warmup - 1, 1)
  decay_steps = max(total - warmup, 1)
  cos = final + 0.5 * (base - final) * (1.0 + jnp.cos(math.pi * (step - warmup) / decay_steps))
  value = jnp.where(step < warmup, warm, cos)
  return jnp.where(step >= total, final, value)


def schedules(config):
  """{name: fn(step)} of the run: learning rate, weight decay, teacher momentum and
  temperature."""
  total, d = config.total_steps, config.dino
  return {
    'learning_rate': lambda s: cosine(s, config.base_lr, d.min_lr, total, config.warmup_steps),
    'weight_decay': lambda s: cosine(s, config.weight_decay, d.weight_decay_end, total),
    'teacher_momentum': lambda s: cosine(s, d.teacher_momentum, 1.0, total),
    'teacher_temp': lambda s: cosine(
      s,
      d.teacher_temp,
      d.teacher_temp,
      d.teacher_temp_warmup_steps,
      d.teacher_temp_warmup_steps,
      d.warmup_teacher_temp,
    ),
  }


# ---------------------------------------------------------------------------
# The optimizer.


def _names(path):
  return [str(getattr(k, 'key', k)) for k in path]


def _is_prototypes(path) -> bool:
  """The heads' last layer (DINOv2's `last_layer`): frozen at first."""
  names = _names(path)
  return names[0] in dino_models.HEADS and 'prototypes' in names


def decays(path) -> bool:
  """Whether weight decay applies: all but biases, LayerNorms and LayerScale (DINOv2's rule:
  no decay for names ending in '.bias' or holding 'norm' or 'gamma')."""
  names = _names(path)
  if names[-1] in ('bias', 'gamma'):
    return False
  module = names[-2] if len(names) > 1 else ''
  return not ('norm' in module.lower() or module.startswith('LayerNorm'))


def clip_per_network(max_norm: float) -> optax.GradientTransformation:
  """Gradients of each network (the backbone, each head) scaled by min(1, max_norm / (its norm
  + 1e-6)): torch's `clip_grad_norm_`, which DINOv2 calls per network."""

  def update(updates, state, params=None):
    def clipped(tree):
      norm = optax.global_norm(tree)
      scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
      return jax.tree.map(lambda g: g * scale.astype(g.dtype), tree)

    heads = {k: clipped(v) for k, v in updates.items() if k in dino_models.HEADS}
    backbone = clipped({k: v for k, v in updates.items() if k not in dino_models.HEADS})
    return {**backbone, **heads}, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scheduled_rate_and_decay(config) -> optax.GradientTransformation:
  """The tail of DINOv2's AdamW after Adam's direction u of a parameter p:
  -lr_t * f * (u + wd_t * p), wd only where `decays`, f the parameter's `optim.layer_factors`
  (times `patch_embed_lr_mult` for the patch embedding, 0 for the prototypes during their
  frozen steps): torch's AdamW with one learning rate per parameter group."""
  plan = schedules(config)
  frozen_steps = config.dino.freeze_last_layer_steps
  patch_mult = config.dino.patch_embed_lr_mult

  def init(params):
    return {'count': jnp.zeros((), jnp.int32)}

  def update(updates, state, params):
    count = state['count']
    lr, wd = plan['learning_rate'](count), plan['weight_decay'](count)
    factors = optim.layer_factors(updates, config.layer_decay)

    def one(path, u, p, factor):
      if decays(path):
        u = u + wd.astype(u.dtype) * p.astype(u.dtype)
      rate = lr * factor
      if _is_prototypes(path):
        rate = jnp.where(count < frozen_steps, 0.0, rate)
      if _names(path)[0] == 'embedding':
        rate = rate * patch_mult
      return -rate.astype(u.dtype) * u

    out = jax.tree_util.tree_map_with_path(one, updates, params, factors)
    return out, {'count': count + 1}

  return optax.GradientTransformation(init, update)


def make_optimizer(config):
  """(tx, learning-rate schedule): DINOv2's AdamW (see the module docstring)."""
  parts = []
  if config.grad_norm_clip:
    parts.append(clip_per_network(config.grad_norm_clip))
  moments = jnp.dtype(config.optim_dtype)
  parts.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, mu_dtype=moments))
  parts.append(scheduled_rate_and_decay(config))
  return optax.chain(*parts), schedules(config)['learning_rate']


# ---------------------------------------------------------------------------
# The model a run can train, and the task.


def check_model(spec, config) -> None:
  """ConfigError (one line) for a model or crop that self-distillation cannot take: it reads
  the class token and the patch tokens of a ViT after its final norm, at two crop sizes."""
  arch = spec.architecture
  problems = [
    (spec.naflex, "NaFlex (naflex_tokens: each image at its own aspect ratio, where the crops "
     "are square)"),
    (arch.classifier != 'token', f'classifier={arch.classifier!r}'),
    (spec.hybrid, 'a ResNet stem (a hybrid)'),
    (arch.final_norm != 'tokens', 'final_norm=pooled (a norm after pooling, not on every token)'),
    (arch.rotary is not None, 'rotary position embeddings'),
    (arch.posemb not in ('tokens', 'patches'), f'posemb={arch.posemb!r}'),
    (arch.representation_size is not None, 'a pre-logits layer'),
  ]  # fmt: skip
  for bad, what in problems:
    if bad:
      raise ConfigError(
        f'{config.model}: task=dino trains a ViT that reads its class token, not one with '
        f'{what}; pick a ViT-* or DINOv2 model (e.g. vit_small_patch14_reg4_dinov2)'
      )
  local, patch = config.dino.local_crop, spec.patch_size
  if config.dino.local_crops and (local % patch or local < patch):
    lower, upper = local - local % patch, local - local % patch + patch
    raise ConfigError(
      f'dino.local_crop={local} is not a multiple of the patch size {patch} of {config.model}; '
      f'use --config.dino.local_crop={upper}' + (f' or {lower}' if lower else '')
    )


def prepare(batch: dict) -> dict:
  """Pixels (multi-crop train batches, eval images) uint8 -> float32 in [-1, 1]; masks and
  labels as they are."""
  out = dict(batch)
  for key in ('global', 'local', 'image'):
    if key in batch:
      out[key] = on_device.normalise(batch[key])
  return out


def _compute(params, config):
  """The backbone's parameters (heads left out) cast once to the compute dtype
  (`vit.compute_params`); the heads cast their own."""
  backbone = {k: v for k, v in params.items() if k not in dino_models.HEADS}
  return vit.compute_params(backbone, config.dtype)


def mask_slots(masks, slots: int):
  """(index, valid) [..., slots]: each crop's masked patch positions first (in order), then
  unmasked ones marked invalid; `masks` [..., N] bool."""
  index = jnp.argsort(~masks, axis=-1, stable=True)[..., :slots]
  return index, jnp.take_along_axis(masks, index, axis=-1)


def _gather(tokens, index):
  """[B, C, N, D] tokens at index [B, C, S] -> [B, C, S, D]."""
  return jnp.take_along_axis(tokens, index[..., None], axis=2)


def make_task(config, num_classes: int, multi_label: bool, spec) -> steps.Task:
  """The task of `config` (task='dino') on the model `spec`."""
  compute = Compute.of(config)
  networks = dino_models.build(spec, config, compute)
  features = dino_models.features(spec, compute)

  def eval_fn(params, batch):
    """The evaluated (teacher's) class tokens of a batch: what k-NN and probes read."""
    variables = {'params': _compute(params, config)}
    return {'features': features.apply(variables, batch['image'], train=False)}

  return steps.Task(
    model=networks.backbone,
    loss_fn=None,  # the step's loss reads the teacher too: `train_step`
    eval_fn=eval_fn,
    prepare=prepare,
    features=features,
    init=functools.partial(init_state, networks=networks, config=config),
    step=functools.partial(train_step, networks=networks),
    make_optimizer=make_optimizer,
    evaluated='ema_params',
    evaluate=functools.partial(evaluate, cache={}),
  )


def evaluate(run, params, *, cache) -> dict:
  """k-NN accuracy (`evaluation.knn`: `knn.k`, `knn.temperature`) of the evaluated
  parameters' class tokens on the run's own dataset, its train split the neighbours, its test
  split classified; {} for a dataset without labels."""
  if run.info.num_classes < 2 or not run.info.num_test:
    return {}
  if 'features' not in cache:  # one compilation for the run
    cache['features'] = fewshot.representation_fn(run.program.task.features)
  config = run.config.copy_and_resolve_references()
  with config.unlocked():
    config.knn.train_split, config.knn.test_split = 'train', 'test'
  accuracy, examples = knn.dataset_accuracy(
    config,
    config.dataset,
    run.program.task.features,
    params,
    run.program.batch_sharding,
    features_fn=cache['features'],
    transform=run.transform,
  )
  return {'accuracy': accuracy, 'examples': examples, 'what': 'k-NN accuracy'}


def init_state(rng, *, networks, config, tx) -> steps.TrainState:
  """Student and teacher from the same fresh parameters; the centres at zero (centering=
  'centre')."""
  init_rng, state_rng = jax.random.split(rng)
  params = networks.init(init_rng)
  task_state = None
  if config.dino.centering == 'centre':
    _, patch_params = networks.patch_head(params)
    task_state = {
      'dino_centre': jnp.zeros(config.dino.prototypes, jnp.float32),
      'ibot_centre': jnp.zeros(_prototypes(patch_params), jnp.float32),
    }
  return steps.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    ema_params=params,
    rng=state_rng,
    num_skipped=jnp.zeros((), jnp.int32),
    task_state=task_state,
  )


def _prototypes(head_params) -> int:
  return int(head_params['prototypes']['scale'].shape[0])


def teacher_targets(networks, config, teacher, task_state, batch, temp):
  """The teacher's targets of the class tokens [B, 2, K] and of the masked patches
  [B, 2, S, K'], the valid slots [B, 2, S], the new task state, and the monitors."""
  d = config.dino
  images = batch['global']
  b = images.shape[0]
  tokens = networks.backbone.apply(
    {'params': _compute(teacher, config)}, images.reshape(-1, *images.shape[2:]), train=False
  )
  cls = tokens[:, 0].reshape(b, NUM_GLOBAL, -1)
  cls_logits = networks.dino_head.apply({'params': teacher['dino_head']}, cls)
  out = {'cls_features': cls}
  patch_logits = index = valid = None
  if config.ibot.weight:
    slots = batch_mask_slots(config, networks.spec)
    index, valid = mask_slots(batch['masks'], slots)
    patches = tokens[:, 1:].reshape(b, NUM_GLOBAL, -1, tokens.shape[-1])
    head, head_params = networks.patch_head(teacher)
    patch_logits = head.apply({'params': head_params}, _gather(patches, index))
  new_state = task_state
  if d.centering == 'sinkhorn_knopp':
    cls_targets = dino_losses.sinkhorn_knopp(cls_logits, temp)
    patch_targets = (
      None if patch_logits is None else dino_losses.sinkhorn_knopp(patch_logits, temp, valid)
    )
  else:
    cls_targets = dino_losses.centred_softmax(cls_logits, task_state['dino_centre'], temp)
    new_state = dict(task_state)
    new_state['dino_centre'] = dino_losses.updated_centre(
      task_state['dino_centre'], cls_logits, d.centre_momentum
    )
    patch_targets = None
    if patch_logits is not None:
      patch_targets = dino_losses.centred_softmax(patch_logits, task_state['ibot_centre'], temp)
      new_state['ibot_centre'] = dino_losses.updated_centre(
        task_state['ibot_centre'], patch_logits, d.centre_momentum, valid
      )
  out.update(cls_targets=cls_targets, patch_targets=patch_targets, index=index, valid=valid)
  return jax.lax.stop_gradient(out), new_state


def batch_mask_slots(config, spec) -> int:
  """Slots per global crop for its masked patches: the most a mask covers."""
  grid = config.pp.crop // spec.patch_size
  return max(int(grid * grid * config.ibot.mask_ratio[1]), 1)


def student_loss(params, networks, config, batch, teacher, rng):
  """(loss, its parts) of the student's parameters against the teacher's targets."""
  d, spec = config.dino, networks.spec
  images, local = batch['global'], batch['local']
  b = images.shape[0]
  global_rng, local_rng = jax.random.split(rng)
  masks = batch['masks'].reshape(b * NUM_GLOBAL, -1) if config.ibot.weight else None
  backbone = _compute(params, config)
  tokens = networks.backbone.apply(
    {'params': backbone},
    images.reshape(-1, *images.shape[2:]),
    masks=masks,
    train=True,
    rngs={'dropout': global_rng},
  )
  cls = tokens[:, 0].reshape(b, NUM_GLOBAL, -1)
  views = [cls]
  if local.shape[1]:
    grid = local.shape[2] // spec.patch_size
    at_local = dino_models.at_grid(backbone, spec, grid, config.posemb_resize)
    local_tokens = networks.backbone.apply(
      {'params': at_local},
      local.reshape(-1, *local.shape[2:]),
      train=True,
      rngs={'dropout': local_rng},
    )
    views.append(local_tokens[:, 0].reshape(b, local.shape[1], -1))
  logits = networks.dino_head.apply({'params': params['dino_head']}, jnp.concatenate(views, 1))
  parts = {'dino_loss': dino_losses.dino_loss(teacher['cls_targets'], logits, d.student_temp)}
  loss = d.weight * parts['dino_loss']
  if d.koleo_weight:
    parts['koleo_loss'] = sum(dino_losses.koleo_loss(cls[:, c]) for c in range(NUM_GLOBAL))
    loss = loss + d.koleo_weight * parts['koleo_loss']
  if config.ibot.weight:
    patches = tokens[:, 1:].reshape(b, NUM_GLOBAL, -1, tokens.shape[-1])
    head, head_params = networks.patch_head(params)
    patch_logits = head.apply({'params': head_params}, _gather(patches, teacher['index']))
    parts['ibot_loss'] = dino_losses.ibot_loss(
      teacher['patch_targets'], patch_logits, teacher['valid'], d.student_temp
    )
    loss = loss + config.ibot.weight * parts['ibot_loss']
  return loss, parts


def train_step(state, batch, *, networks, task, tx, schedule, config):
  """One step of self-distillation (module docstring); a non-finite loss or gradient changes
  nothing (student, teacher, optimizer, centres), as the supervised step."""
  batch = task.prepare(batch)
  plan = schedules(config)
  temp = plan['teacher_temp'](state.step)
  step_rng = jax.random.fold_in(state.rng, state.step)
  teacher, task_state = teacher_targets(
    networks, config, state.ema_params, state.task_state, batch, temp
  )
  grad_fn = jax.value_and_grad(student_loss, has_aux=True)
  (loss, parts), grads = grad_fn(state.params, networks, config, batch, teacher, step_rng)

  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
  momentum = plan['teacher_momentum'](state.step)
  ema = jax.tree.map(lambda t, p: momentum * t + (1 - momentum) * p, state.ema_params, params)
  new_state = state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    ema_params=keep(ema, state.ema_params),
    task_state=keep(task_state, state.task_state),
    num_skipped=state.num_skipped + jnp.where(finite, 0, 1),
  )
  targets = teacher['cls_targets']
  metrics = {
    'loss': loss,
    'grad_norm': grad_norm,
    'learning_rate': schedule(state.step),
    'finite': finite,
    **parts,
    'teacher_entropy': dino_losses.entropy(targets),
    'prototype_usage': dino_losses.prototype_usage(targets),
    'feature_std': dino_losses.feature_spread(
      teacher['cls_features'].reshape(-1, teacher['cls_features'].shape[-1])
    ),
    'teacher_temp': temp,
    'teacher_momentum': momentum,
    'weight_decay': plan['weight_decay'](state.step),
  }
  return new_state, metrics
