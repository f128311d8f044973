"""Whole-split evaluation and the few-shot command line, on the built-in digits."""

import json
import os

from conftest import command_error
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import evaluate
from vit_jax import fewshot as fewshot_cli
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.configs.data import data_config
from vit_jax.core import sharding
from vit_jax.data import pipeline


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A workdir holding a random 10-class 'testing' ViT for 16 px digits."""
  path = tmp_path_factory.mktemp('checkpoint')
  model = models.VisionTransformer(num_classes=10, **architectures.MODEL_CONFIGS['testing'])
  params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
  checkpoint.save_npz(params, path / 'params.npz')
  return str(path), model, params


def test_top1_top5_over_every_test_example(workdir, capsys):
  path, model, params = workdir
  assert (
    evaluate.main([f'--checkpoint={path}', '--model=testing', '--dataset=digits', '--batch=50'])
    == 0
  )  # 50 does not divide the 359 test images
  result = json.loads(capsys.readouterr().out)

  # Independently: all test images in one batch, accuracy from numpy.
  config = data_config()
  config.update(dataset='digits', batch_eval=400)
  config.pp.crop = 16
  batch = next(
    iter(pipeline.make_eval_iterator(config, sharding.batch_sharding(sharding.make_mesh())))
  )
  mask = np.asarray(batch['mask']).astype(bool)
  logits = np.asarray(model.apply({'params': params}, batch['image'], train=False))[mask]
  labels = np.asarray(batch['label'])[mask]
  top5 = np.argsort(-logits, axis=1)[:, :5]
  assert result['examples'] == mask.sum() == 359
  assert result['top1'] == pytest.approx(np.mean(logits.argmax(1) == labels))
  assert result['top5'] == pytest.approx(np.mean((top5 == labels[:, None]).any(1)))
  assert 0.0 < result['top1'] < result['top5'] < 1.0  # random weights: neither trivial


def test_evaluate_errors_are_one_line(workdir, capsys):
  path, _, _ = workdir
  args = [f'--checkpoint={path}', '--dataset=digits']
  err = command_error(evaluate.main, args + ['--model=ViT-B_16'], capsys)
  assert 'has shape (10,), the model expects (768,)' in err
  args = [f'--checkpoint={path}', '--model=testing', '--dataset=cifar11']
  assert "unknown dataset 'cifar11'" in command_error(evaluate.main, args, capsys)


def test_fewshot_command_line_writes_its_own_files(workdir, capsys):
  path, model, params = workdir
  # A training run's record, which the few-shot command must leave as it is.
  summary_bytes = b'{"step": 24, "test_accuracy": 0.5}\n'
  with open(os.path.join(path, 'summary.json'), 'wb') as f:
    f.write(summary_bytes)
  assert (
    fewshot_cli.main(
      [f'--checkpoint={path}', '--model=testing', '--datasets=digits', '--shots=1,5', '--seeds=0,1']
    )
    == 0
  )
  out = capsys.readouterr().out
  assert 'fewshot/digits_5shot' in out
  with open(os.path.join(path, 'summary.json'), 'rb') as f:
    assert f.read() == summary_bytes
  assert not os.path.exists(os.path.join(path, 'metrics.jsonl'))
  results = json.load(open(os.path.join(path, 'fewshot.json')))
  assert set(results) == {
    'fewshot/digits_1shot',
    'fewshot/digits_1shot-seed0',
    'fewshot/digits_1shot-seed1',
    'fewshot/digits_5shot',
    'fewshot/digits_5shot-seed0',
    'fewshot/digits_5shot-seed1',
  }
  assert results['fewshot/digits_5shot'] == pytest.approx(
    (results['fewshot/digits_5shot-seed0'] + results['fewshot/digits_5shot-seed1']) / 2
  )
  # Random features still carry the digits' pixels: far above chance (0.1) at 5 shots.
  assert results['fewshot/digits_5shot'] > 0.3
  assert os.listdir(os.path.join(path, 'tensorboard', 'fewshot'))
