r"""How long the test suite takes: runs pytest, or reads a run's JUnit XML, and writes a record.

  python benchmarks/suite_time.py                        # `pytest`: the whole suite, as CI runs it
  python benchmarks/suite_time.py -- -m "not slow"       # the fast tier
  python benchmarks/suite_time.py -- -m equivalence --dist load
  python benchmarks/suite_time.py --junit=run.xml -- -m "not slow"   # a run already done

Everything after `--` goes to pytest as typed (setup.cfg adds a worker per core). The record,
`benchmarks/suite/<time>_<tier>.json`, holds the command, the machine (CPU, cores, vector
instructions), the machine's load average over the run (sampled every 5 s: other work on the
machine slows the suite as much as its own size), the wall time, the counts (passed, skipped,
failed), each test file's seconds and the slowest tests. The tier is the marker expression:
`suite` for none, `fast` for `not slow`, else the expression; a run of chosen files or tests
is tier `files`. docs/development.md's table of the tiers is written from the newest record of
each (`python benchmarks/docs_tables.py --write`).
"""

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, 'benchmarks', 'suite')
SLOWEST = 15


def tier_of(pytest_args: list) -> str:
  """The tier a pytest command line runs: its marker expression, or `files` when it names
  test files or tests."""
  if any(not a.startswith('-') and (a.startswith('tests') or '::' in a) for a in pytest_args):
    return 'files'
  marker = ''
  for i, arg in enumerate(pytest_args):
    if arg == '-m' and i + 1 < len(pytest_args):
      marker = pytest_args[i + 1]
    elif arg.startswith('-m') and len(arg) > 2:
      marker = arg[2:]
  return {'': 'suite', 'not slow': 'fast'}.get(marker.strip(), marker.strip())


def results(junit_path: str) -> dict:
  """Counts, each file's seconds and the slowest tests, from pytest's JUnit XML."""
  root = ElementTree.parse(junit_path).getroot()
  counts = {'passed': 0, 'skipped': 0, 'failed': 0}
  files, tests = {}, []
  for case in root.iter('testcase'):
    seconds = float(case.get('time', 0))
    module = case.get('classname', '').split('.')
    path = '/'.join(
      module[: next((i + 1 for i, p in enumerate(module) if p.startswith('test_')), 0)]
    )
    name = f'{path}.py::{case.get("name")}' if path else case.get('name')
    if case.find('skipped') is not None:
      counts['skipped'] += 1
    elif case.find('failure') is not None or case.find('error') is not None:
      counts['failed'] += 1
    else:
      counts['passed'] += 1
    files[f'{path}.py'] = files.get(f'{path}.py', 0.0) + seconds
    tests.append((seconds, name))
  tests.sort(reverse=True)
  suites = [root] if root.tag == 'testsuite' else list(root.iter('testsuite'))
  return {
    'counts': counts,
    'pytest_seconds': round(sum(float(s.get('time', 0)) for s in suites), 2),
    'test_seconds': round(sum(s for s, _ in tests), 2),
    'file_seconds': {k: round(v, 2) for k, v in sorted(files.items(), key=lambda kv: -kv[1])},
    'slowest': [{'test': n, 'seconds': round(s, 2)} for s, n in tests[:SLOWEST]],
  }


class LoadSampler(threading.Thread):
  """The machine's 1-minute load average every `every` seconds until stopped."""

  def __init__(self, every=5.0):
    super().__init__(daemon=True)
    self.every, self.samples, self._stop_event = every, [], threading.Event()

  def run(self):
    while True:
      self.samples.append(os.getloadavg()[0])
      if self._stop_event.wait(self.every):
        return

  def stop(self) -> dict:
    self._stop_event.set()
    self.join()
    self.samples.append(os.getloadavg()[0])
    s = self.samples
    return {
      'start': round(s[0], 2),
      'end': round(s[-1], 2),
      'mean': round(sum(s) / len(s), 2),
      'max': round(max(s), 2),
    }


def machine() -> dict:
  """The CPU, its cores and vector instructions, the Python and library versions."""
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  sys.path.insert(0, ROOT)
  from vit_jax.core import hardware

  info = hardware.machine_info()
  flags = info.pop('cpu_flags', [])
  info['vector_isa'] = 'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'other'
  for key in ('platform', 'device_kind', 'device_count', 'xla_flags', 'load_average_1min'):
    info.pop(key, None)
  return info


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--junit', help="a finished run's JUnit XML (pytest --junitxml) to record")
  parser.add_argument(
    '--wall_s', type=float, help="with --junit: the run's wall time (default: pytest's own)"
  )
  parser.add_argument('pytest_args', nargs='*', help='after --: the arguments of pytest')
  args = parser.parse_args()
  command = ['pytest', *args.pytest_args]
  record = {
    'benchmark': 'the test suite: python benchmarks/suite_time.py',
    'command': shlex.join(command),
    'tier': tier_of(args.pytest_args),
    'date': datetime.datetime.now().isoformat(timespec='seconds'),
    'machine': machine(),
  }
  if args.junit:
    record.update(results(args.junit), load_average=None, exit_status=None)
    record['wall_s'] = args.wall_s or record['pytest_seconds']
    stamp = ElementTree.parse(args.junit).getroot().find('.//testsuite[@timestamp]')
    if stamp is not None:  # when the run started, not when it was recorded
      started = datetime.datetime.fromisoformat(stamp.get('timestamp'))
      record['date'] = started.isoformat(timespec='seconds')
  else:
    with tempfile.TemporaryDirectory() as tmp:
      junit = os.path.join(tmp, 'junit.xml')
      sampler = LoadSampler()
      sampler.start()
      start = time.perf_counter()
      status = subprocess.call(
        [sys.executable, '-m', 'pytest', *args.pytest_args, f'--junitxml={junit}'], cwd=ROOT
      )
      wall = time.perf_counter() - start
      record.update(results(junit), wall_s=round(wall, 1), load_average=sampler.stop())
      record['exit_status'] = status
  os.makedirs(RECORDS, exist_ok=True)
  tier = re.sub(r'\W+', '_', record['tier']).strip('_')
  name = f'{datetime.datetime.now().strftime("%Y%m%dT%H%M")}_{tier}.json'
  path = os.path.join(RECORDS, name)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  c = record['counts']
  print(
    f'{record["command"]}: {c["passed"]} passed, {c["skipped"]} skipped, {c["failed"]} failed '
    f'in {record["wall_s"]} s; wrote {os.path.relpath(path, ROOT)}'
  )
  return record.get('exit_status') or 0


if __name__ == '__main__':
  sys.exit(main())
