r"""What asking "stop after this step?" costs the training loop, per step.

  python benchmarks/stop_check.py [--calls=200000]

The loop calls `Stop.due(step)` after every step. Timed here on the objects
the loop uses: in one process (an attribute read), and in each of two
processes joined by `jax.distributed` on 127.0.0.1 (a lock and a comparison,
while the agreement's thread waits on the coordination service in the
background), then set against the time of one step of the smallest model
the tests train (`testing`, batch 32 at 16 px, two processes on this CPU:
its loop's img/s from a real run of `python -m vit_jax.main`). Writes
`benchmarks/<time>_stop_check.json`.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TIMER = textwrap.dedent("""
    import json, sys, tempfile, time
    import jax
    if len(sys.argv) > 3:
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
      jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[3]))
    from vit_jax.training import stopping
    calls = int(sys.argv[1])
    stop = stopping.Stop(tempfile.mkdtemp())
    try:
      best = float('inf')
      for _ in range(5):
        start = time.perf_counter()
        for step in range(calls):
          stop.due(step)
        best = min(best, (time.perf_counter() - start) / calls)
    finally:
      stop.restore()
    print('RESULT' + json.dumps({'seconds_per_call': best}))
""")


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(devices=1):
  return {
    **os.environ,
    'PYTHONPATH': ROOT,
    'JAX_PLATFORMS': 'cpu',
    'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
  }


def _result(out: str) -> dict:
  return json.loads(out.split('RESULT', 1)[1].splitlines()[0])


def time_due(calls: int) -> dict:
  """Seconds per `Stop.due` call: one process, and each of two processes."""
  one = subprocess.run(
    [sys.executable, '-c', _TIMER, str(calls)], env=_env(), capture_output=True, text=True
  )
  assert one.returncode == 0, one.stderr[-2000:]
  address = f'127.0.0.1:{_free_port()}'
  two = [
    subprocess.Popen(
      [sys.executable, '-c', _TIMER, str(calls), address, str(i)],
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in two]
  for p, (_, err) in zip(two, outputs):
    assert p.returncode == 0, err[-2000:]
  return {
    'one_process_s': _result(one.stdout)['seconds_per_call'],
    'two_processes_s': [_result(out)['seconds_per_call'] for out, _ in outputs],
  }


def step_time() -> dict:
  """The loop's seconds per step of the testing model in two processes (summary.json)."""
  workdir = tempfile.mkdtemp(prefix='stop_check_')
  address = f'127.0.0.1:{_free_port()}'
  flags = [
    '--config.model=testing', '--config.pp.crop=16', '--config.batch=32',
    '--config.total_steps=200', '--config.warmup_steps=4', '--config.optimizer=sgd',
    '--config.eval_every=1000', '--config.checkpoint_every=1000', '--config.progress_every=50',
    '--config.tensorboard=False',
  ]  # fmt: skip
  runs = [
    subprocess.Popen(
      [
        sys.executable,
        '-m',
        'vit_jax.main',
        f'--workdir={workdir}',
        *flags,
        f'--coordinator_address={address}',
        '--num_processes=2',
        f'--process_id={i}',
      ],
      env=_env(),
      cwd=ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )  # fmt: skip
    for i in range(2)
  ]
  for p in runs:
    err = p.communicate(timeout=1200)[1]
    assert p.returncode == 0, err[-2000:]
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  return {'img_per_sec': summary['img_per_sec'], 'step_s': 32 / summary['img_per_sec']}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--calls', type=int, default=200_000)
  args = parser.parse_args()
  due = time_due(args.calls)
  step = step_time()
  worst = max([due['one_process_s'], *due['two_processes_s']])
  record = {
    'command': 'python benchmarks/stop_check.py',
    'calls': args.calls,
    'due_seconds_per_call': due,
    'testing_model_two_processes': step,
    'share_of_a_step': worst / step['step_s'],
  }
  stamp = datetime.datetime.now().strftime('%Y%m%dT%H%M')
  path = os.path.join(ROOT, 'benchmarks', f'{stamp}_stop_check.json')
  with open(path, 'w') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  print(
    f'Stop.due: {due["one_process_s"] * 1e6:.2f} us a step in one process, '
    f'{", ".join(f"{s * 1e6:.2f}" for s in due["two_processes_s"])} us in each of two; '
    f'a step of the testing model in two processes: {step["step_s"] * 1e3:.1f} ms '
    f'({record["share_of_a_step"]:.1e} of it). Wrote {path}'
  )


if __name__ == '__main__':
  main()
