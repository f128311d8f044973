"""Two real JAX processes (CPU, gloo): each reads its share of the one-process global batch."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import free_port
import numpy as np
import pytest

from vit_jax.data import order

_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'127.0.0.1:{sys.argv[1]}', num_processes=2,
                               process_id=int(sys.argv[2]))
    import jax.numpy as jnp
    import ml_collections
    import numpy as np
    import tensorflow as tf
    from vit_jax.configs.data import add_data_config
    from vit_jax.data import pipeline
    from vit_jax.data.readers import builtin

    config = add_data_config(ml_collections.ConfigDict())
    config.pp.crop, config.batch, config.batch_eval = 16, 32, 50
    config.pp.inception_crop = False  # deterministic pixels identify each example
    mesh = jax.make_mesh((2,), ('data',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))

    raw, _ = builtin.load_digits()
    train = builtin.digits_split_indices()[0]
    resized = tf.cast(tf.clip_by_value(tf.round(tf.image.resize(raw[train], [16, 16])),
                                       0, 255), tf.uint8).numpy().reshape(len(train), -1)
    lookup = {row.tobytes(): i for i, row in enumerate(resized)}

    it = pipeline.make_train_iterator(config, sharding)
    read, shapes = [], []
    for _ in range(3):
      batch = next(it)
      shapes.append(list(batch['image'].shape))
      local = np.concatenate([np.asarray(s.data) for s in batch['image'].addressable_shards])
      pixels = np.round((local + 1) * 127.5).astype(np.uint8).reshape(len(local), -1)
      read += [lookup.get(p.tobytes(), -1) for p in pixels]

    masks = [b['mask'] for b in pipeline.make_eval_iterator(config, sharding)]
    seen = int(jax.jit(lambda ms: sum(jnp.sum(m) for m in ms))(masks))
    print('RESULT' + json.dumps({'read': read, 'shapes': shapes, 'eval_seen': seen,
                                 'eval_batches': len(masks),
                                 'eval_shape': list(masks[0].shape)}))
""")


@pytest.mark.slow
def test_two_processes_read_disjoint_parts_into_one_global_batch(tmp_path):
  script = tmp_path / 'worker.py'
  script.write_text(_WORKER)
  port = str(free_port())
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {
    **os.environ,
    'PYTHONPATH': repo,
    'JAX_PLATFORMS': 'cpu',
    'TF_CPP_MIN_LOG_LEVEL': '3',
    'XLA_FLAGS': '',
  }
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), port, str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = []
  for proc in procs:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    results.append(json.loads(out.split('RESULT', 1)[1]))

  # The examples a single process would put in the first three global batches.
  one_process = dict(global_batch=32, local_batch=32, offset=0, num_examples=1438)
  order_key = order.keys(0)[0]
  expected = np.concatenate(
    [order.train_indices(s, **one_process, order_key=order_key)[1] for s in range(3)]
  ).reshape(3, 2, 16)
  for p, result in enumerate(results):
    assert result['shapes'] == [[32, 16, 16, 3]] * 3  # global batch = config.batch
    read = np.array(result['read']).reshape(3, 16)  # 16 local examples per step
    np.testing.assert_array_equal(read, expected[:, p])  # its share, in order
  assert not set(results[0]['read']) & set(results[1]['read'])  # disjoint
  for result in results:
    # 359 test examples, 180 per process at most: 8 batches of 25 local, 400 slots.
    assert result['eval_seen'] == 359
    assert result['eval_batches'] == 8 and result['eval_shape'] == [50]
