"""The DINO head and losses against their PyTorch references: DINOv2's own code (the `dinov2`
wheel: DINOHead, DINOLoss with Sinkhorn-Knopp and with the centre, iBOTPatchLoss, KoLeoLoss)
and lightly's (DINOv2ProjectionHead, DINOLoss, IBOTPatchLoss, KoLeoLoss), on random tensors
and weights, within 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
dinov2_loss = pytest.importorskip('dinov2.loss')
lightly_loss = pytest.importorskip('lightly.loss')

from vit_jax.models import dino  # noqa: E402
from vit_jax.training import dino_losses  # noqa: E402

TOL = 1e-5


def _logits(rng, *shape):
  """Head-like logits: cosines of unit vectors, in [-1, 1]."""
  return np.tanh(rng.normal(size=shape)).astype(np.float32)


def _head_params(torch_head):
  """Our DinoHead parameters from a torch DINOHead / DINOv2ProjectionHead."""
  linears = [m for m in torch_head.modules() if isinstance(m, torch.nn.Linear)][:-1]
  params = {
    f'Dense_{i}': {'kernel': m.weight.detach().numpy().T, 'bias': m.bias.detach().numpy()}
    for i, m in enumerate(linears)
  }
  last = torch_head.last_layer
  params['prototypes'] = {
    'kernel': last.weight_v.detach().numpy().T,
    'scale': last.weight_g.detach().numpy()[:, 0],
  }
  return params


@pytest.mark.parametrize('reference', ['dinov2', 'lightly'])
def test_head_matches_the_reference_at_dinov2_sizes(reference):
  torch.manual_seed(0)
  width, prototypes = 384, 65536  # ViT-S's width, DINOv2's default head
  if reference == 'dinov2':
    from dinov2.layers import DINOHead

    head = DINOHead(width, prototypes, hidden_dim=2048, bottleneck_dim=256, nlayers=3)
  else:
    from lightly.models.modules.heads import DINOv2ProjectionHead

    head = DINOv2ProjectionHead(width, 2048, 256, prototypes)
  with torch.no_grad():  # a scale other than 1, as after training
    head.last_layer.weight_g.mul_(1.5)
  x = np.random.default_rng(0).normal(size=(6, width)).astype(np.float32)
  want = head(torch.from_numpy(x)).detach().numpy()
  ours = dino.DinoHead(prototypes, 2048, 256, 3)
  got = np.asarray(ours.apply({'params': _head_params(head)}, jnp.asarray(x)))
  assert got.shape == (6, prototypes)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_head_parameter_count_is_dinov2s():
  ours = dino.DinoHead(65536, 2048, 256, 3)
  params = jax.eval_shape(lambda: ours.init(jax.random.key(0), jnp.zeros((1, 384))))['params']
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  mlp = (384 * 2048 + 2048) + (2048 * 2048 + 2048) + (2048 * 256 + 256)
  assert count == mlp + 256 * 65536 + 65536 == 22_352_128  # + prototypes v and g


def test_sinkhorn_knopp_matches_dinov2():
  rng = np.random.default_rng(1)
  logits = _logits(rng, 24, 300)
  loss = dinov2_loss.DINOLoss(300)
  want = loss.sinkhorn_knopp_teacher(torch.from_numpy(logits), teacher_temp=0.05).numpy()
  got = np.asarray(dino_losses.sinkhorn_knopp(jnp.asarray(logits), 0.05))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)  # rows are distributions


def _dinov2_dino_loss(loss, teacher_targets, student_global, student_local):
  """DINOv2's DINO loss of a step (ssl_meta_arch.forward_backward): [2B, K] crop-major inputs,
  the teacher's two crops swapped for the global pairs, both terms over the pair count."""
  n_local = len(student_local) // (len(student_global) // 2)
  terms = 2 * 1 + 2 * n_local
  teacher = teacher_targets.view(2, -1, teacher_targets.shape[-1])
  local = loss(list(student_local.chunk(n_local)), list(teacher)) / terms
  swapped = torch.cat([teacher[1], teacher[0]])
  global_ = loss([student_global], [swapped]) * 2 / terms
  return local + global_


def _crop_major(x):
  """[B, V, K] -> [V * B, K], DINOv2's collated order (all images' crop 0 first)."""
  return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 0, 1).reshape(-1, x.shape[-1])))


def test_dino_loss_with_sinkhorn_knopp_matches_dinov2():
  rng = np.random.default_rng(2)
  b, k, n_local = 8, 256, 3
  teacher_logits = _logits(rng, b, 2, k)
  student_global, student_local = _logits(rng, b, 2, k) * 3, _logits(rng, b, n_local, k) * 3
  loss = dinov2_loss.DINOLoss(k, student_temp=0.1)
  # The teacher's rows in DINOv2's order: crop 0 of every image, then crop 1.
  targets = loss.sinkhorn_knopp_teacher(_crop_major(teacher_logits), teacher_temp=0.06)
  want = _dinov2_dino_loss(
    loss, targets, _crop_major(student_global), _crop_major(student_local)
  ).item()
  ours_targets = dino_losses.sinkhorn_knopp(jnp.asarray(teacher_logits), 0.06)
  student = jnp.concatenate([jnp.asarray(student_global), jnp.asarray(student_local)], axis=1)
  got = float(dino_losses.dino_loss(ours_targets, student, 0.1))
  assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_dino_loss_with_running_centre_matches_lightly_over_steps():
  """Three steps of lightly's DINOLoss (teacher temperature given per step): the loss at each
  step and the centre after it."""
  rng = np.random.default_rng(3)
  b, k, n_local = 6, 128, 2
  reference = lightly_loss.DINOLoss(output_dim=k, student_temp=0.1, center_momentum=0.9)
  centre = jnp.zeros(k)
  for step, temp in enumerate((0.04, 0.05, 0.06)):
    teacher = _logits(rng, b, 2, k) * (step + 1)
    student = _logits(rng, b, 2 + n_local, k) * 3
    want = reference(
      [torch.from_numpy(teacher[:, v]) for v in range(2)],
      [torch.from_numpy(student[:, v]) for v in range(2 + n_local)],
      teacher_temp=temp,
    ).item()
    targets = dino_losses.centred_softmax(jnp.asarray(teacher), centre, temp)
    got = float(dino_losses.dino_loss(targets, jnp.asarray(student), 0.1))
    centre = dino_losses.updated_centre(centre, jnp.asarray(teacher), 0.9)
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (step, got, want)
    np.testing.assert_allclose(centre, reference.center.numpy().reshape(-1), atol=TOL)


def test_dino_centre_matches_dinov2s_delayed_update():
  """DINOv2 applies a batch's centre update when the next batch asks for targets."""
  rng = np.random.default_rng(4)
  k = 64
  reference = dinov2_loss.DINOLoss(k, center_momentum=0.9)
  centre = jnp.zeros(k)
  for _ in range(3):
    logits = _logits(rng, 10, k) * 2
    want = reference.softmax_center_teacher(torch.from_numpy(logits), teacher_temp=0.04).numpy()
    reference.update_center(torch.from_numpy(logits))
    got = dino_losses.centred_softmax(jnp.asarray(logits), centre, 0.04)
    centre = dino_losses.updated_centre(centre, jnp.asarray(logits), 0.9)
    np.testing.assert_allclose(got, want, atol=TOL)


def _slots(masks, slots):
  """(index [B, S] of each crop's masked patches first, valid [B, S]) as the step gathers them."""
  order = np.argsort(~masks, axis=1, kind='stable')[:, :slots]
  return order, np.take_along_axis(masks, order, axis=1)


@pytest.mark.parametrize('centering', ['sinkhorn_knopp', 'centre'])
def test_ibot_loss_matches_dinov2(centering, torch_process_group):
  rng = np.random.default_rng(5)
  crops, n, k, slots = 6, 16, 96, 8
  masks = np.zeros((crops, n), bool)
  for c, count in enumerate((3, 0, 8, 5, 1, 0)):
    masks[c, rng.permutation(n)[:count]] = True
  teacher_patches = _logits(rng, crops, n, k) * 2
  student_patches = _logits(rng, crops, n, k) * 3
  flat = masks.reshape(-1)
  loss = dinov2_loss.iBOTPatchLoss(k, student_temp=0.1)
  teacher_masked = torch.from_numpy(teacher_patches.reshape(-1, k)[flat])
  n_masked = int(flat.sum())
  if centering == 'sinkhorn_knopp':
    targets = loss.sinkhorn_knopp_teacher(
      teacher_masked, 0.05, n_masked_patches_tensor=torch.tensor([n_masked])
    )
  else:
    targets = loss.softmax_center_teacher(teacher_masked[None], 0.05)[0]
  want = loss.forward_masked(
    torch.from_numpy(student_patches.reshape(-1, k)[flat]),
    targets,
    student_masks_flat=torch.from_numpy(masks),
    n_masked_patches=n_masked,
  ).item()
  index, valid = _slots(masks, slots)
  take = lambda x: jnp.asarray(np.take_along_axis(x, index[..., None], axis=1))[None]
  valid = jnp.asarray(valid)[None]
  if centering == 'sinkhorn_knopp':
    ours_targets = dino_losses.sinkhorn_knopp(take(teacher_patches), 0.05, valid)
  else:
    ours_targets = dino_losses.centred_softmax(take(teacher_patches), jnp.zeros(k), 0.05)
  got = float(dino_losses.ibot_loss(ours_targets, take(student_patches), valid, 0.1))
  assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


def test_ibot_loss_and_centre_match_lightly():
  rng = np.random.default_rng(6)
  b, h, w, k = 4, 4, 4, 80
  masks = rng.random((b, h, w)) < 0.3
  masks[1] = False  # an image without masked patches
  count = int(masks.sum())
  teacher, student = _logits(rng, count, k) * 2, _logits(rng, count, k) * 3
  reference = lightly_loss.IBOTPatchLoss(output_dim=k, student_temp=0.1, center_momentum=0.9)
  want = reference(torch.from_numpy(teacher), torch.from_numpy(student), torch.from_numpy(masks))
  index, valid = _slots(masks.reshape(b, -1), h * w)
  rows = np.full((b, h * w), -1)
  rows[masks.reshape(b, -1)] = np.arange(count)
  slot_rows = np.take_along_axis(rows, index, axis=1)
  take = lambda x: jnp.asarray(np.where(valid[..., None], x[np.maximum(slot_rows, 0)], 0.0))[None]
  targets = dino_losses.centred_softmax(take(teacher), jnp.zeros(k), 0.04)
  got = float(dino_losses.ibot_loss(targets, take(student), jnp.asarray(valid)[None], 0.1))
  assert abs(got - want.item()) <= TOL * max(1.0, abs(want.item()))
  centre = dino_losses.updated_centre(jnp.zeros(k), take(teacher), 0.9, jnp.asarray(valid)[None])
  np.testing.assert_allclose(centre, reference.center.value.numpy().reshape(-1), atol=TOL)


@pytest.mark.parametrize('reference', ['dinov2', 'lightly'])
def test_koleo_matches_the_reference(reference):
  rng = np.random.default_rng(7)
  x = rng.normal(size=(32, 48)).astype(np.float32)
  x[5] = x[3] + 0.1 * rng.normal(size=48)  # a close pair: the largest gradients
  loss = dinov2_loss.KoLeoLoss() if reference == 'dinov2' else lightly_loss.KoLeoLoss()
  tx = torch.from_numpy(x).requires_grad_(True)
  want = loss(tx)
  want.backward()
  got, grad = jax.value_and_grad(dino_losses.koleo_loss)(jnp.asarray(x))
  assert abs(float(got) - want.item()) <= TOL * abs(want.item())
  np.testing.assert_allclose(grad, tx.grad.numpy(), atol=TOL)


def test_collapse_monitors_tell_collapse_from_spread():
  uniform = jnp.full((8, 16), 1 / 16)
  one_hot = jax.nn.one_hot(jnp.zeros(8, int), 16)
  spread = jax.nn.one_hot(jnp.arange(8) % 16, 16)
  assert float(dino_losses.entropy(uniform)) == pytest.approx(np.log(16), rel=1e-6)
  assert float(dino_losses.prototype_usage(one_hot)) == pytest.approx(1 / 16, rel=1e-5)
  assert float(dino_losses.prototype_usage(spread)) == pytest.approx(8 / 16, rel=1e-5)
  same = jnp.ones((8, 4))
  assert float(dino_losses.feature_spread(same)) == 0.0
  assert float(dino_losses.feature_spread(jnp.eye(4))) > 0.8
