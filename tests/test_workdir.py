"""The workdir lock (one run at a time, stale locks taken over) and failed writes named."""

import errno
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from vit_jax import workdir


def write_lock(path, **fields):
  holder = {'token': 'theirs', 'host': socket.gethostname(), 'pid': os.getpid()}
  holder.update({'started': time.time(), 'heartbeat': time.time(), **fields})
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, workdir.LOCK_FILE), 'w') as f:
    json.dump(holder, f)


def read_lock(path):
  with open(os.path.join(path, workdir.LOCK_FILE)) as f:
    return json.load(f)


def wait_until(predicate, timeout=5.0):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline, 'timed out'
    time.sleep(0.01)


def test_a_held_lock_refuses_a_second_run_until_released(tmp_path):
  first = workdir.Lock(str(tmp_path)).acquire()
  with pytest.raises(workdir.WorkdirError) as e:
    workdir.Lock(str(tmp_path)).acquire()
  message = str(e.value)
  assert message.startswith(f'{tmp_path} is in use by another run (pid {os.getpid()} on ')
  assert 'use another --workdir' in message and '\n' not in message
  first.release()
  assert not os.path.exists(first.path)
  workdir.Lock(str(tmp_path)).acquire().release()


def test_the_lock_of_a_process_that_is_gone_is_taken_over(tmp_path):
  gone = subprocess.Popen([sys.executable, '-c', 'pass'])
  gone.wait()
  write_lock(tmp_path, pid=gone.pid, boot_id=workdir.lock._boot_id())
  lock = workdir.Lock(str(tmp_path)).acquire()
  assert lock.took_over['pid'] == gone.pid
  assert read_lock(tmp_path)['token'] == lock._token
  lock.release()


def test_staleness_by_process_boot_and_heartbeat():
  here, boot = socket.gethostname(), 'boot-a'
  alive = {'host': here, 'pid': os.getpid(), 'boot_id': boot}
  assert not workdir.lock.is_stale(alive, now=0.0, host=here, boot_id=boot)
  # The same pid before the machine rebooted is another process.
  assert workdir.lock.is_stale(alive, now=0.0, host=here, boot_id='boot-b')
  # Another host: only the heartbeat's age tells.
  now = 1e9
  fresh = {'host': 'elsewhere', 'pid': 1, 'heartbeat': now - workdir.lock.STALE_AFTER_S + 5}
  old = {'host': 'elsewhere', 'pid': 1, 'heartbeat': now - workdir.lock.STALE_AFTER_S - 5}
  assert not workdir.lock.is_stale(fresh, now=now, host=here, boot_id=boot)
  assert workdir.lock.is_stale(old, now=now, host=here, boot_id=boot)


def test_a_lock_from_another_host_is_refused_until_its_heartbeat_is_old(tmp_path):
  write_lock(tmp_path, host='tpu-worker-3', heartbeat=time.time() - 60)
  with pytest.raises(workdir.WorkdirError, match='on tpu-worker-3'):
    workdir.Lock(str(tmp_path)).acquire()
  write_lock(tmp_path, host='tpu-worker-3', heartbeat=time.time() - workdir.lock.STALE_AFTER_S - 1)
  lock = workdir.Lock(str(tmp_path)).acquire()
  assert lock.took_over['host'] == 'tpu-worker-3'
  lock.release()


def test_the_heartbeat_refreshes_and_notices_a_replaced_lock(tmp_path, monkeypatch):
  monkeypatch.setattr(workdir.lock, 'HEARTBEAT_S', 0.02)
  lock = workdir.Lock(str(tmp_path)).acquire()
  first = read_lock(tmp_path)['heartbeat']
  wait_until(lambda: read_lock(tmp_path)['heartbeat'] > first)
  assert read_lock(tmp_path)['started'] == lock._started
  write_lock(tmp_path, token='someone-else')
  wait_until(lambda: lock.lost)
  lock.release()  # leaves the other run's lock alone
  assert read_lock(tmp_path)['token'] == 'someone-else'


def test_the_lock_is_whole_whenever_it_is_there(tmp_path):
  """A second run that reads lock.json the moment it appears finds the holder's pid,
  never an empty file ("pid ?", seen on a loaded machine). Checked at every line our code runs
  while taking the lock and refreshing it, not by racing a reader."""
  import threading

  package = os.path.dirname(workdir.__file__)
  path = tmp_path / workdir.LOCK_FILE
  seen = []

  def each_line(frame, event, arg):
    if event == 'line' and os.path.exists(path):
      seen.append(path.read_text())
    return each_line

  def in_our_code(frame, event, arg):
    return each_line if frame.f_code.co_filename.startswith(package) else None

  lock = workdir.Lock(str(tmp_path))
  sys.settrace(in_our_code)
  try:
    lock.acquire()
    lock._stop.set()  # the heartbeat's refresh, in this thread (traced)
    lock._thread.join()
    lock._stop = threading.Event()
    lock._stop.wait = lambda timeout, calls=iter([False, True]): next(calls)
    lock._beat()
  finally:
    sys.settrace(None)
  holders = [json.loads(text) for text in seen]
  assert len(holders) > 5 and {h['pid'] for h in holders} == {os.getpid()}
  assert len({h['heartbeat'] for h in holders}) == 2  # taken, then refreshed
  lock.release()
  assert os.listdir(tmp_path) == []  # no temporary file left


def test_object_store_lock_reads_back_what_it_wrote(tmp_path, monkeypatch):
  """`file://` goes through tf.io.gfile, the path `gs://` workdirs take."""
  monkeypatch.setattr(workdir.lock, 'REMOTE_SETTLE_S', 0.0)
  url = f'file://{tmp_path}/run'
  lock = workdir.Lock(url).acquire()
  with pytest.raises(workdir.WorkdirError, match='is in use by another run'):
    workdir.Lock(url).acquire()
  lock.release()
  assert not os.path.exists(tmp_path / 'run' / workdir.LOCK_FILE)

  # Two runs write at once: the later write wins, the earlier run sees it on reading back.
  def other_run_writes(seconds):
    write_lock(tmp_path / 'run', token='later-writer')

  monkeypatch.setattr(workdir.lock.time, 'sleep', other_run_writes)
  with pytest.raises(workdir.WorkdirError, match=f'pid {os.getpid()}'):
    workdir.Lock(url).acquire()
  assert read_lock(tmp_path / 'run')['token'] == 'later-writer'


def test_failed_writes_are_named_through_library_wrappers():
  enospc = OSError(errno.ENOSPC, 'No space left on device', '/w/metrics.jsonl')
  assert workdir.storage_failure(enospc) == ('no space left on device', '/w/metrics.jsonl')
  # TensorStore (orbax's array writer) keeps only the text.
  tensorstore = ValueError(
    'RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/16.orbax-checkpoint-tmp/'
    '_sharding": Failed to write 11485 bytes to file 5: No space left on device '
    "[os_error_code='28']"
  )
  assert workdir.storage_failure(tensorstore) == (
    'no space left on device',
    '/w/checkpoints/16.orbax-checkpoint-tmp/_sharding',
  )
  try:
    try:
      raise OSError(errno.EROFS, 'Read-only file system', '/w/lock.json')
    except OSError as e:
      raise RuntimeError('save failed') from e
  except RuntimeError as wrapped:
    assert workdir.storage_failure(wrapped) == ('read-only file system', '/w/lock.json')
  # A cause the raiser chose to hide, or an unrelated error, is not a failed write.
  try:
    try:
      raise OSError(errno.EDQUOT, 'Disk quota exceeded')
    except OSError:
      raise RuntimeError('handled') from None
  except RuntimeError as hidden:
    assert workdir.storage_failure(hidden) is None
  assert workdir.storage_failure(ValueError('shapes (3,) and (4,) differ')) is None


def test_a_workdir_on_another_file_system_names_its_model_and_holds_its_results(tmp_path):
  """Every read and write of the run's files goes through vit_jax.core.files: an in-memory file
  system (as gs:// would be) gives the commands the model the summary names."""
  import jax
  import jax.numpy as jnp

  from vit_jax import checkpoint
  from vit_jax import models
  from vit_jax.configs import architectures
  from vit_jax.configs import demo
  from vit_jax.evaluation import loader

  remote = 'memory://vit_jax_tests/run'
  model = models.VisionTransformer(num_classes=10, **architectures.MODEL_CONFIGS['testing'])
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)
  )['params']
  params = jax.tree.map(lambda s: np.full(s.shape, 0.5, np.float32), params)
  checkpoint.save_npz(params, workdir.params_path(remote))
  workdir.write_summary(remote, {'step': 24, 'model': 'testing', 'dataset': 'digits'})
  workdir.write_config(remote, demo.get_config())

  assert workdir.is_workdir(remote) and workdir.has_params(remote)
  assert workdir.recorded(remote, 'model') == 'testing'
  assert workdir.read_config(remote)['model'] == 'ViT-Demo_4'
  loaded = loader.load_model(remote)  # no --model: the summary names it
  assert (loaded.model.num_classes, loaded.spec.image_size) == (10, 16)
  np.testing.assert_array_equal(loaded.params['head']['kernel'], params['head']['kernel'])
  # Nothing was written locally.
  assert not os.path.exists('memory:')


def test_each_file_of_a_run_is_named_in_this_module_only():
  """The run directory's file names appear as literals in vit_jax/workdir/layout.py alone."""
  import pathlib

  package = pathlib.Path(workdir.__file__).parent.parent
  names = [
    workdir.CONFIG_FILE,
    workdir.CHECKPOINTS,
    workdir.CORRUPT_CHECKPOINTS,
    workdir.SUMMARY_FILE,
    workdir.PARAMS_FILE,
    workdir.PARAMS_EMA_FILE,
    workdir.FEWSHOT_FILE,
    workdir.LOCK_FILE,
    workdir.METRICS_FILE,
  ]  # (workdir.TENSORBOARD is also the name of a config field: not a file name there)
  for path in package.rglob('*.py'):
    if path == pathlib.Path(workdir.layout.__file__):
      continue
    text = path.read_text()
    for name in names:
      # A quoted literal; the transformers folder's own config.json is interop/hf.py's.
      if name == 'config.json' and path.name == 'hf.py':
        continue
      assert f"'{name}'" not in text and f'"{name}"' not in text, (path, name)


# ---------------------------------------------------------------------------
# A workdir that cannot be one.


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  (tmp_path / 'file').write_text('')
  workdir.check_folder(str(tmp_path / 'new' / 'run'))  # made when missing: fine
  for path, where in [('file', 'is a file'), ('file/run', f'is inside the file {tmp_path}/file')]:
    with pytest.raises(workdir.WorkdirError, match=f'^{tmp_path}/{path} {where}: a workdir'):
      workdir.check_folder(str(tmp_path / path))
