r"""Measures how far the equivalence tests' two sides drift apart, per CPU code generation.

  python benchmarks/equivalence_spread.py [--isas=default/O0,default/O2,AVX2/O2,AVX/O0,SSE4_2/O0]
                                         [--no-drift]

The tests that compare two configurations of one computation (`pytest -m
equivalence`, and the export parity tests) log each normwise error they measure
(tests/conftest.py: assert_close, $VIT_JAX_SPREAD_LOG). This script runs them
once per XLA CPU instruction set (`--xla_cpu_max_isa`, as on an older CPU) and
backend optimisation level (the suite compiles at O0, CI's second run at O2
held to AVX2) and records, per comparison, the largest error seen under each
and the tolerance the test asks, so a tolerance can be read against the spread
that justifies it.

It also runs the same single-device training twice across instruction sets
(the drift): the 24-step reference of tests/test_trainer.py (SGD, momentum 0.9,
lr 0.1) and the 3-step plain SGD run the multi-device tests now compare, to show
how much a CPU alone moves each one's parameters.

Writes `benchmarks/<time>_equivalence_spread.json`.
"""

import argparse
import collections
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tests'))

SELECTIONS = (
  ['-m', 'equivalence', 'tests'],
  ['tests/test_export.py', 'tests/test_parity_hf.py', '-k', 'match or import or pre_logits'],
)


def flags(setting):
  """XLA_FLAGS for 'ISA/O<level>' ('default/O0', 'AVX2/O2')."""
  isa, _, level = setting.partition('/')
  out = [] if isa == 'default' else [f'--xla_cpu_max_isa={isa}']
  return ' '.join(out + [f'--xla_backend_optimization_level={level.lstrip("O") or 0}'])


def run_tests(isa, log):
  env = dict(os.environ, VIT_JAX_SPREAD_LOG=log, XLA_FLAGS=flags(isa))
  for selection in SELECTIONS:
    command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *selection]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    said = (result.stdout.strip() or result.stderr.strip() or 'no output').splitlines()[-1]
    print(f'  {isa}: {said}', flush=True)
    if result.returncode not in (0, 5):  # 5: nothing selected
      raise SystemExit(f'{isa}: the tests failed:\n{result.stdout[-3000:]}')


def drift(isas):
  """Parameters of the same run under each instruction set, against the first."""
  import conftest
  import test_trainer

  out = {}
  for name, overrides in (
    ('24 steps, momentum 0.9', []),
    ('3 plain SGD steps', test_trainer.SHORT),
  ):
    params = {}
    for isa in isas:
      with tempfile.TemporaryDirectory() as workdir:
        env = conftest.subprocess_env()
        env['XLA_FLAGS'] = f'{flags(isa)} --xla_force_host_platform_device_count=1'
        subprocess.run(
          test_trainer.command(workdir, *overrides), env=env, check=True, capture_output=True
        )
        params[isa] = test_trainer.params(workdir)
    first = isas[0]
    out[name] = {
      f'{isa} vs {first}': max(conftest.tree_errors(params[isa], params[first]).values())
      for isa in isas[1:]
    }
    print(f'  drift, {name}: {out[name]}', flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--isas', default='default/O0,default/O2,AVX2/O2,AVX/O0,SSE4_2/O0')
  parser.add_argument('--no-drift', dest='drift', action='store_false')
  args = parser.parse_args()
  isas = args.isas.split(',')

  spread = collections.defaultdict(dict)
  tolerance = {}
  with tempfile.TemporaryDirectory() as tmp:
    for isa in isas:
      log = os.path.join(tmp, f'{isa.replace("/", "_")}.jsonl')
      run_tests(isa, log)
      for line in open(log, encoding='utf-8'):
        entry = json.loads(line)
        key = f'{entry["test"]} | {entry["what"]}'
        spread[key][isa] = max(spread[key].get(isa, 0.0), entry['error'])
        tolerance[key] = entry['tolerance']
  comparisons = {
    key: {
      'tolerance': tolerance[key],
      'largest': max(errors.values()),
      'margin': tolerance[key] / max(max(errors.values()), 1e-12),
      'per_isa': errors,
    }
    for key, errors in sorted(spread.items())
  }
  for key, c in comparisons.items():
    print(f'{c["largest"]:9.2e} <= {c["tolerance"]:7.0e} (x{c["margin"]:7.1f})  {key}')
  cpu = next(
    (l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')),
    platform.processor(),
  )
  record = {
    'command': 'python benchmarks/equivalence_spread.py ' + ' '.join(sys.argv[1:]),
    'cpu': cpu,
    'avx512': 'avx512f' in open('/proc/cpuinfo').read(),
    'isas': isas,
    'comparisons': comparisons,
    'smallest_margin': min(c['margin'] for c in comparisons.values()),
    'drift': drift(isas) if args.drift else None,
  }
  stamp = datetime.datetime.now().strftime('%Y%m%dT%H%M')
  path = ROOT / 'benchmarks' / f'{stamp}_equivalence_spread.json'
  path.write_text(json.dumps(record, indent=2) + '\n')
  print(f'smallest margin x{record["smallest_margin"]:.1f}; wrote {path}')


if __name__ == '__main__':
  main()
