"""The same ViT in timm (PyTorch), for `python -m vit_jax.benchmark --compare=timm`.

The model is built from our architecture config, so both sides run the same
network: patch size, width, depth, heads, MLP size, class token or mean
pooling, the same number of classes, GELU with the tanh approximation (as ours, paper code),
LayerNorm eps 1e-6, no dropout. A train step is what ours does: forward,
softmax cross-entropy, backward, clipping at global norm 1, Adam. timm runs
eager on CPU and under `torch.compile` with bf16 autocast on CUDA; attention
goes through PyTorch's scaled_dot_product_attention (timm's default).
torch and timm are imported only here, when a comparison is asked for.
"""

import contextlib
import functools
import time

from vit_jax.core.errors import UserError


class CompareError(UserError, ValueError):
  """timm cannot run this comparison; one line."""


def import_torch():
  try:
    import timm
    import torch
  except ImportError as e:
    raise CompareError(
      f'--compare=timm needs torch and timm ({e}): on a CPU machine pip install torch '
      '--index-url https://download.pytorch.org/whl/cpu, then pip install --no-deps '
      'torchvision==0.15.2 timm (README: Set-up)'
    ) from None
  return torch, timm


def device_and_sync(torch):
  if torch.cuda.is_available():
    return torch.device('cuda'), torch.cuda.synchronize
  return torch.device('cpu'), lambda: None


def matmul_flops(n: int, dtype_name: str, repeats: int = 5) -> float:
  """FLOP/s of an n x n matmul in torch on the same device: torch's measured peak."""
  torch, _ = import_torch()
  device, sync = device_and_sync(torch)
  a = torch.ones((n, n), dtype=getattr(torch, dtype_name), device=device)
  with torch.inference_mode():
    a @ a
    sync()
    best = float('inf')
    for _ in range(repeats):
      start = time.perf_counter()
      a @ a
      sync()
      best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def _timm_model(timm, torch, arch, resolution: int, num_classes: int):
  if arch.resnet is not None:
    raise CompareError(f'{arch.name}: the timm comparison covers plain ViTs, not hybrids')
  if arch.representation_size is not None:
    raise CompareError('the timm comparison has no pre-logits layer; use a model without one')
  if arch.classifier not in ('token', 'gap'):
    raise CompareError(
      f"classifier={arch.classifier!r}: the timm comparison needs 'token' or 'gap'"
    )
  from timm.models import vision_transformer

  t = arch.block
  return vision_transformer.VisionTransformer(
    img_size=resolution,
    patch_size=arch.patch_size[0],
    in_chans=3,
    num_classes=num_classes,
    embed_dim=arch.hidden_size,
    depth=arch.num_layers,
    num_heads=t.num_heads,
    mlp_ratio=t.mlp_dim / arch.hidden_size,
    qkv_bias=True,
    class_token=arch.classifier == 'token',
    global_pool='token' if arch.classifier == 'token' else 'avg',
    act_layer=functools.partial(torch.nn.GELU, approximate='tanh'),
  )


def make_step(
  arch,
  *,
  mode: str,
  batch: int,
  resolution: int,
  dtype: str,
  num_classes: int = 1000,
  compile_model=None,
  threads=None,
):
  """A zero-argument function running one synchronised timm step, and a description."""
  torch, timm = import_torch()
  if threads:
    torch.set_num_threads(threads)
  device, sync = device_and_sync(torch)
  compile_model = device.type == 'cuda' if compile_model is None else compile_model
  model = _timm_model(timm, torch, arch, resolution, num_classes).to(device)
  if compile_model:
    model = torch.compile(model)
  images = torch.rand((batch, 3, resolution, resolution), device=device) * 2 - 1
  labels = torch.randint(0, num_classes, (batch,), device=device)
  amp = (
    torch.autocast(device.type, dtype=torch.bfloat16)
    if dtype == 'bfloat16'
    else contextlib.nullcontext()
  )
  described = {
    'device': str(device),
    'threads': torch.get_num_threads(),
    'torch_compile': bool(compile_model),
    'autocast': dtype == 'bfloat16',
    'attention': 'torch.nn.functional.scaled_dot_product_attention',
  }

  if mode == 'infer':
    model.eval()

    def step():
      with torch.inference_mode(), amp:
        model(images)
      sync()

    return step, described

  step, described['optimizer'] = _train_step(torch, model, images, labels, amp, sync)
  return step, described


def _train_step(torch, model, images, labels, amp, sync):
  """One synchronised Adam step of `model` (clipped to norm 1, as ours), and its optimizer."""
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  # The fused CPU/GPU kernel is torch's fastest Adam; give timm its best.
  try:
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
  except (RuntimeError, TypeError):
    opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)

  def step():
    with amp:
      loss = torch.nn.functional.cross_entropy(model(images), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sync()

  return step, f'torch.optim.Adam(fused={opt.defaults.get("fused")})'
