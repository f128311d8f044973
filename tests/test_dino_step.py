"""One whole self-distillation step against a PyTorch step composed from the reference modules:
timm's `vit_small_patch14_reg4_dinov2` (full width, one block) as student and teacher backbone
with DINOv2's mask-token substitution, DINOv2's `DINOHead`, `DINOLoss` (Sinkhorn-Knopp or the
centre), `iBOTPatchLoss`, `KoLeoLoss` as its `SSLMetaArch.forward_backward` combines them, its
parameter groups (`get_params_groups_with_decay`), per-network gradient clipping, AdamW and the
teacher's EMA; both crop sizes, block masks, the same weights, crops and masks.

The loss agrees within 1e-5. The updated parameters within a bound derived from Adam's first
step: each element moves by -lr * (g / (|g| + eps) + wd * p) (times its group's multiplier), so a
gradient error |dg| moves it by at most lr * |dg| * eps / (|g| - |dg| + eps)^2 where |g| > |dg|
(negligible beside float32 rounding) and by at most 2 lr where the gradient is as small as its
error (the sign of g / |g| is then undetermined). The test measures dg (our gradient against
torch's), asserts it within 1e-5 of each tensor's largest gradient, then holds every updated
element to that bound plus float32 rounding of the parameter; the teacher moves (1 - m) as far.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
timm = pytest.importorskip('timm')
dinov2_loss = pytest.importorskip('dinov2.loss')
dinov2_layers = pytest.importorskip('dinov2.layers')
param_groups = pytest.importorskip('dinov2.utils.param_groups')

from vit_jax import checkpoint  # noqa: E402
from vit_jax.configs import model_spec  # noqa: E402
from vit_jax.configs.model_spec import Compute  # noqa: E402
from vit_jax.configs.model_spec import ModelSpec  # noqa: E402
from vit_jax.data import multicrop  # noqa: E402
from vit_jax.interop import timm as interop_timm  # noqa: E402
from vit_jax.training import dino  # noqa: E402
from vit_jax.training import optim  # noqa: E402
from vit_jax.training import steps  # noqa: E402

NAME = 'vit_small_patch14_reg4_dinov2'
B, LOCAL, K = 4, 2, 48
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _config(centering):
  from test_dino_training import tiny_dino_config

  config = tiny_dino_config(
    model=NAME,
    depth=1,
    batch=B,
    warmup_steps=0,  # the first step at base_lr (DINOv2's schedule starts its warm-up at 0)
    base_lr=3e-3,
    weight_decay=0.05,
    layer_decay=1.0,  # DINOv2's ViT-L/g recipes; the layer-wise factors: test_dino_training
    drop_path_rate=0.0,
    total_steps=10,
  )
  config.pp.crop, config.dino.local_crop, config.dino.local_crops = 28, 14, LOCAL
  config.dino.update(prototypes=K, head_hidden=40, head_bottleneck=24, centering=centering)
  config.dino.freeze_last_layer_steps = 0
  config.ibot.update(separate_head=centering == 'centre', prototypes=32, head_hidden=36)
  config.ibot.head_bottleneck = 20
  return config


class Backbone(torch.nn.Module):
  """timm's ViT with DINOv2's mask token: masked patch embeddings replaced before the tokens
  and position embeddings join them (DINOv2's `prepare_tokens_with_masks`)."""

  def __init__(self, model, mask_token):
    super().__init__()
    self.model = model
    self.mask_token = torch.nn.Parameter(torch.from_numpy(mask_token.reshape(1, -1)).clone())

  @property
  def blocks(self):  # DINOv2's parameter groups count the blocks of a backbone
    return self.model.blocks

  def forward(self, x, masks=None):
    m = self.model
    t = m.patch_embed(x)  # [n, h, w, D] (dynamic_img_size)
    if masks is not None:
      t = torch.where(masks.view(t.shape[:3])[..., None], self.mask_token.to(t.dtype), t)
    t = m.norm(m.blocks(m.norm_pre(m.patch_drop(m._pos_embed(t)))))
    return t[:, 0], t[:, m.num_prefix_tokens :]


def _torch_head(params, in_dim):
  """DINOv2's DINOHead holding our head's parameters."""
  layers = len([k for k in params if k.startswith('Dense_')])
  hidden = params['Dense_0']['kernel'].shape[1]
  bottleneck, prototypes = params['prototypes']['kernel'].shape
  head = dinov2_layers.DINOHead(in_dim, prototypes, False, layers, hidden, bottleneck)
  linears = [m for m in head.mlp.modules() if isinstance(m, torch.nn.Linear)]
  with torch.no_grad():
    for i, m in enumerate(linears):
      m.weight.copy_(torch.from_numpy(np.asarray(params[f'Dense_{i}']['kernel']).T))
      m.bias.copy_(torch.from_numpy(np.asarray(params[f'Dense_{i}']['bias'])))
    head.last_layer.weight_v.copy_(torch.from_numpy(np.asarray(params['prototypes']['kernel']).T))
    head.last_layer.weight_g.copy_(
      torch.from_numpy(np.asarray(params['prototypes']['scale']))[:, None]
    )
  return head


def _head_params(head, grad=False):
  """Our head's tree of a DINOHead's parameters (or of their gradients)."""
  value = lambda p: (p.grad if grad else p).detach().numpy()
  linears = [m for m in head.mlp.modules() if isinstance(m, torch.nn.Linear)]
  out = {
    f'Dense_{i}': {'kernel': value(m.weight).T, 'bias': value(m.bias)}
    for i, m in enumerate(linears)
  }
  out['prototypes'] = {
    'kernel': value(head.last_layer.weight_v).T,
    'scale': value(head.last_layer.weight_g)[:, 0],
  }
  return out


def _our_params(backbone, heads, config, head_grads=False):
  flat = interop_timm.from_timm(
    {k: v.detach().numpy() for k, v in backbone.model.state_dict().items()},
    model_spec.registered(NAME),
    'timm',
  )
  params = checkpoint.unflatten(flat)
  params['mask_token'] = backbone.mask_token.detach().numpy().reshape(1, 1, -1)
  for name, head in heads.items():
    params[name] = _head_params(head, head_grads)
  return params


def _pixels(u8):
  """uint8 [..., H, W, 3] -> torch NCHW ImageNet-normalised [0, 1] pixels, crop-major rows."""
  x = (u8.astype(np.float64) / 255 - MEAN) / STD
  x = np.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])
  return torch.from_numpy(x.transpose(0, 3, 1, 2).astype(np.float32))


def _reference_step(config, student, teacher, heads, teacher_heads, batch, state_centres):
  """DINOv2's forward_backward, clipping, AdamW and EMA on the reference modules; returns
  (loss, gradients by torch parameter, the centres after the step)."""
  d, ibot = config.dino, config.ibot
  plan = dino.schedules(config)
  temp = float(plan['teacher_temp'](0))
  n_global, n_local = 2, LOCAL
  g, loc = _pixels(batch['global']), _pixels(batch['local'])
  masks = torch.from_numpy(np.swapaxes(batch['masks'], 0, 1).reshape(2 * B, -1))
  dino_l = dinov2_loss.DINOLoss(K, student_temp=d.student_temp, center_momentum=d.centre_momentum)
  patch_k = heads['ibot_head'].last_layer.weight_g.shape[0] if 'ibot_head' in heads else K
  ibot_l = dinov2_loss.iBOTPatchLoss(patch_k, student_temp=d.student_temp)
  if state_centres is not None:
    dino_l.center = torch.from_numpy(np.asarray(state_centres['dino_centre']))[None]
    ibot_l.center = torch.from_numpy(np.asarray(state_centres['ibot_centre']))[None, None]
  koleo = dinov2_loss.KoLeoLoss()
  flat_masks = masks.flatten()
  index = flat_masks.nonzero().flatten()
  n_masked = len(index)
  weights = (1 / masks.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(masks)[masks]
  t_patch_head = teacher_heads.get('ibot_head', teacher_heads['dino_head'])
  s_patch_head = heads.get('ibot_head', heads['dino_head'])
  with torch.no_grad():
    t_cls, t_patches = teacher(g)
    t_cls = torch.cat(t_cls.chunk(2)[::-1])
    t_cls_logits = teacher_heads['dino_head'](t_cls)
    t_patch_logits = t_patch_head(t_patches.flatten(0, 1)[index])
    if d.centering == 'sinkhorn_knopp':
      t_dino = dino_l.sinkhorn_knopp_teacher(t_cls_logits, temp).view(2, -1, K)
      t_ibot = ibot_l.sinkhorn_knopp_teacher(t_patch_logits, temp, torch.tensor([n_masked]))
      centres = None
    else:
      t_dino = dino_l.softmax_center_teacher(t_cls_logits, temp).view(2, -1, K)
      dino_l.update_center(t_cls_logits)
      t_ibot = ibot_l.softmax_center_teacher(t_patch_logits[None], temp)[0]
      ibot_l.update_center(t_patch_logits[None])
      dino_l.apply_center_update()
      ibot_l.apply_center_update()
      centres = {
        'dino_centre': dino_l.center.numpy().reshape(-1),
        'ibot_centre': ibot_l.center.numpy().reshape(-1),
      }
  s_cls, s_patches = student(g, masks)
  s_local_cls, _ = student(loc)
  terms = n_global * (n_global - 1) + n_local * n_global
  s_local_logits = heads['dino_head'](s_local_cls)
  s_global_logits = heads['dino_head'](s_cls)
  local = dino_l(list(s_local_logits.chunk(n_local)), list(t_dino)) / terms
  global_ = dino_l([s_global_logits], [t_dino.flatten(0, 1)]) * 2 / terms
  k_loss = d.koleo_weight * sum(koleo(p) for p in s_cls.chunk(2))
  s_patch_logits = s_patch_head(s_patches.flatten(0, 1)[index])
  i_loss = ibot_l.forward_masked(
    s_patch_logits, t_ibot, student_masks_flat=masks, n_masked_patches=n_masked,
    masks_weight=weights,
  ) * 2 * (1 / n_global)  # fmt: skip
  loss = d.weight * (local + global_) + k_loss + ibot.weight * i_loss
  loss.backward()
  return loss.item(), centres


def _torch_update(config, modules, teacher_modules):
  """Per-network clipping, DINOv2's parameter groups and AdamW, then the teacher's EMA."""
  plan = dino.schedules(config)
  lr, wd = float(plan['learning_rate'](0)), float(plan['weight_decay'](0))
  momentum = float(plan['teacher_momentum'](0))
  groups = []
  for module in modules.values():
    torch.nn.utils.clip_grad_norm_(module.parameters(), config.grad_norm_clip)
    for group in param_groups.get_params_groups_with_decay(
      module, config.layer_decay, config.dino.patch_embed_lr_mult
    ):
      group['lr'] = lr * group['lr_multiplier']  # no frozen steps here
      group['weight_decay'] = wd * group['wd_multiplier']
      groups.append(group)
  optimizer = torch.optim.AdamW(
    [{k: v for k, v in g.items() if k in ('params', 'lr', 'weight_decay')} for g in groups],
    betas=(config.b1, config.b2),
  )
  optimizer.step()
  with torch.no_grad():
    for name, module in modules.items():
      for pt, ps in zip(teacher_modules[name].parameters(), module.parameters()):
        pt.mul_(momentum).add_(ps, alpha=1 - momentum)
  return lr


def _masks(rng, slots):
  masks = np.zeros((B, 2, 4), bool)
  for b in range(B):
    for c in range(2):
      if rng.uniform() < 0.7:
        masks[b, c, rng.permutation(4)[: rng.integers(1, slots + 1)]] = True
  return masks


@pytest.mark.parametrize(
  'centering', ['sinkhorn_knopp', pytest.param('centre', marks=pytest.mark.slow)]
)
def test_a_whole_step_matches_a_pytorch_step_of_the_reference_modules(
  centering, torch_process_group
):
  """Sinkhorn-Knopp with iBOT sharing the DINO head; the running centres (of an earlier step)
  with a separate iBOT head."""
  config = _config(centering)
  spec = ModelSpec.of(config)
  rng = np.random.default_rng(0)
  torch.manual_seed(0)
  model = timm.create_model(
    NAME, pretrained=False, img_size=28, num_classes=0, depth=1, dynamic_img_size=True
  )
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn(p.shape))
  student = Backbone(model, rng.normal(size=384).astype(np.float32))
  task = dino.make_task(config, 10, False, spec)
  tx, schedule = task.make_optimizer(config)
  ours_init = task.init(jax.random.key(0), tx=tx).params
  heads = {k: _torch_head(v, 384) for k, v in ours_init.items() if k in ('dino_head', 'ibot_head')}
  import copy

  teacher = copy.deepcopy(student)
  teacher_heads = {k: _torch_head(ours_init[k], 384) for k in heads}
  params = jax.tree.map(jnp.asarray, _our_params(student, heads, config))
  centres = None
  if centering == 'centre':  # centres of an earlier step
    centres = {
      'dino_centre': jnp.asarray(rng.normal(size=K) * 0.1, jnp.float32),
      'ibot_centre': jnp.asarray(rng.normal(size=32) * 0.1, jnp.float32),
    }
  state = steps.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    ema_params=jax.tree.map(jnp.copy, params),
    rng=jax.random.key_data(jax.random.key(1)),
    num_skipped=jnp.zeros((), jnp.int32),
    task_state=centres,
  )
  slots = multicrop.Settings.of(config, 14, False).mask_slots
  batch = {
    'global': rng.integers(0, 256, (B, 2, 28, 28, 3), dtype=np.uint8),
    'local': rng.integers(0, 256, (B, LOCAL, 14, 14, 3), dtype=np.uint8),
    'masks': _masks(rng, slots),
    'label': np.zeros(B, np.int32),
  }
  step = jax.jit(lambda s, b: task.step(s, b, task=task, tx=tx, schedule=schedule, config=config))
  new_state, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
  # Our gradient, for the bound (the same functions the step differentiates).
  prepared = dino.prepare({k: jnp.asarray(v) for k, v in batch.items()})
  networks = dino.dino_models.build(spec, config, Compute.of(config))
  targets, _ = dino.teacher_targets(networks, config, state.ema_params, centres, prepared, 0.04)
  loss_of = lambda p: dino.student_loss(p, networks, config, prepared, targets, jax.random.key(2))
  grads = jax.grad(lambda p: loss_of(p)[0])(state.params)

  want_loss, want_centres = _reference_step(
    config, student, teacher, heads, teacher_heads, batch, centres
  )
  assert abs(float(metrics['loss']) - want_loss) <= 1e-5 * abs(want_loss), (metrics, want_loss)
  if centres is not None:
    for key, value in want_centres.items():
      np.testing.assert_allclose(new_state.task_state[key], value, atol=1e-6)
  modules = {'backbone': student, **heads}
  theirs_grad = _our_params(_grads_as_module(student), heads, config, head_grads=True)
  grad_error = _check_gradients(grads, theirs_grad)
  lr = _torch_update(config, modules, {'backbone': teacher, **teacher_heads})
  want_student = _our_params(student, heads, config)
  want_teacher = _our_params(teacher, teacher_heads, config)
  momentum = float(dino.schedules(config)['teacher_momentum'](0))
  _check_update(new_state.params, want_student, grads, grad_error, lr, 1.0)
  _check_update(new_state.ema_params, want_teacher, grads, grad_error, lr, 1 - momentum)


def _grads_as_module(module):
  """A copy of `module` whose parameters hold their gradients (zeros where none)."""
  import copy

  out = copy.deepcopy(module)
  with torch.no_grad():
    for (_, p), (_, q) in zip(module.named_parameters(), out.named_parameters()):
      q.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
  return out


def _check_gradients(ours, theirs):
  """Each tensor's gradient within 1e-5 of its largest element (floored at 1e-2 of the whole
  tree's largest: a gradient that is 0 in exact arithmetic, the keys' bias, is rounding noise
  on both sides); returns the absolute error per leaf."""
  from conftest import tree_errors

  relative = tree_errors(ours, theirs)
  worst = max(relative, key=relative.get)
  assert relative[worst] <= 1e-5, (worst, relative[worst])
  return {
    jax.tree_util.keystr(path): float(np.abs(np.asarray(a, np.float64) - np.asarray(b)).max())
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs))
  }


# optax corrects Adam's second moment by 1 - b2 ** t in float32, where 1 - float32(0.999) is
# 1 - 1.29e-5 of 0.001 (torch's correction is float64): the first step's g / sqrt(v) is larger by
# 1 / sqrt(1 - 1.29e-5) - 1 = 6.4e-6 of it.
BIAS_CORRECTION = 1e-5


def _check_update(got, want, grads, grad_error, lr, moved):
  """Every element within the module docstring's bound, `moved` of it for the teacher:
  Adam's first step lr * c g / (c |g| + eps) with a gradient error d (the tensor's largest) and
  a clipping factor c in (0, 1] moves by at most lr * d / (4 (|g| - d)) (the largest over c),
  and by at most 2 lr where |g| <= d; plus `BIAS_CORRECTION` of lr and float32 rounding of the
  parameter and the step."""
  pairs = zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), jax.tree.leaves(grads)
  )
  for (path, a), b, g in pairs:
    key = jax.tree_util.keystr(path)
    a, b, g = (np.asarray(x, np.float64) for x in (a, b, g))
    d = 2 * grad_error[key]  # twice the measured error: ours against theirs, both rounded
    margin = np.abs(g) - d
    adam = np.where(margin > 0, np.minimum(2.0, d / (4 * np.maximum(margin, 1e-30))), 2.0)
    adam = adam + BIAS_CORRECTION
    rounding = 4 * np.finfo(np.float32).eps * (np.abs(b) + lr)
    excess = np.abs(a - b) - (moved * lr * adam + rounding)
    assert excess.max() <= 0, (key, float(excess.max()), float(np.abs(a - b).max()))


def test_learning_rate_and_decay_of_each_parameter_are_dinov2s():
  """Per parameter, layer_decay ** (L + 1 - depth) (times the patch embedding's multiplier) and
  whether weight decay applies, against DINOv2's `get_params_groups_with_decay` of the same
  backbone (timm's names) and head. One difference, kept on purpose: DINOv2's rule knows no
  register tokens and gives them the head's rate; ours, as timm's layer decay, the embeddings'
  (they join the patches before the first block)."""
  config = _config('sinkhorn_knopp')
  config.layer_decay, depth = 0.8, 3
  model = timm.create_model(NAME, pretrained=False, img_size=28, num_classes=0, depth=depth)
  backbone = Backbone(model, np.zeros(384, np.float32))
  head = dinov2_layers.DINOHead(384, 16, False, 3, 8, 4)
  # Each torch tensor filled with its number: after conversion each of our leaves says its own.
  names = [n for n, _ in backbone.model.named_parameters()]
  state = {
    n: np.full(p.shape, i, np.float32) for i, (n, p) in enumerate(model.state_dict().items())
  }
  flat = interop_timm.from_timm(state, model_spec.registered(NAME), 'timm')
  reference = {}
  for module, prefix in ((backbone, ''), (head, 'dino_head/')):
    for group in param_groups.get_params_groups_with_decay(
      module, config.layer_decay, config.dino.patch_embed_lr_mult
    ):
      reference[prefix + group['name']] = (group['lr_multiplier'], group['wd_multiplier'])
  keys = list(model.state_dict())
  ours = dict(flat)
  ours['mask_token'] = np.zeros((1, 1, 384))
  head_params = {
    'Dense_0': {'kernel': 0, 'bias': 0},
    'Dense_1': {'kernel': 0, 'bias': 0},
    'Dense_2': {'kernel': 0, 'bias': 0},
    'prototypes': {'kernel': 0, 'scale': 0},
  }
  tree = {**checkpoint.unflatten(ours), 'dino_head': jax.tree.map(np.zeros, head_params)}
  factors = checkpoint.flatten(
    jax.tree.map(np.asarray, optim.layer_factors(tree, config.layer_decay))
  )
  head_names = {
    'dino_head/Dense_0/kernel': 'dino_head/mlp.0.weight',
    'dino_head/Dense_0/bias': 'dino_head/mlp.0.bias',
    'dino_head/Dense_1/kernel': 'dino_head/mlp.2.weight',
    'dino_head/Dense_1/bias': 'dino_head/mlp.2.bias',
    'dino_head/Dense_2/kernel': 'dino_head/mlp.4.weight',
    'dino_head/Dense_2/bias': 'dino_head/mlp.4.bias',
    'dino_head/prototypes/kernel': 'dino_head/last_layer.weight_v',
    'dino_head/prototypes/scale': 'dino_head/last_layer.weight_g',
  }
  checked = 0
  for key, value in checkpoint.flatten(tree).items():
    if key in head_names:
      theirs = head_names[key]
    elif key == 'mask_token':
      theirs = 'mask_token'
    else:
      theirs = 'model.' + keys[int(np.asarray(flat[key]).flat[0])]
    lr_mult, wd_mult = reference[theirs]
    ours_lr = float(np.asarray(factors[key]).flat[0])
    if key.startswith('embedding/'):
      ours_lr *= config.dino.patch_embed_lr_mult
    if key == 'registers':  # the one difference (docstring)
      assert lr_mult == 1.0 and ours_lr == pytest.approx(config.layer_decay ** (depth + 1))
    else:
      assert ours_lr == pytest.approx(lr_mult, rel=1e-6), (key, theirs)
    path = tuple(jax.tree_util.DictKey(k) for k in key.split('/'))
    assert dino.decays(path) == (wd_mult == 1.0), (key, theirs)
    checked += 1
  # timm's qkv weight and bias are three of ours each; the mask token; the head's eight.
  assert checked == len(names) + 4 * depth + 1 + 8
