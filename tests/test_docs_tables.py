"""The tables of README.md and docs/ that records give are written from them
(`benchmarks/docs_tables.py`): each marked table is its generator's output from the records
as they are, and every generator has its table somewhere: no figure a record holds is typed."""

import sys

from conftest import ROOT
import pytest


@pytest.fixture(scope='module')
def docs_tables():
  sys.path.insert(0, str(ROOT / 'benchmarks'))
  import docs_tables

  return docs_tables


def test_every_marked_table_is_its_records(docs_tables):
  seen = set()
  for name in docs_tables.DOCS:
    text = (ROOT / name).read_text(encoding='utf-8')
    for table, written in docs_tables.marked(text):
      assert written == docs_tables.TABLES[table](), f'{name}: {table} (docs_tables.py --write)'
      seen.add(table)
  assert seen == set(docs_tables.TABLES)


def test_a_stale_table_is_found_and_rewritten(docs_tables):
  text = 'before\n<!-- table: loop -->\n| stale |\n<!-- end table -->\nafter\n'
  ((table, written),) = docs_tables.marked(text)
  assert (table, written) == ('loop', '| stale |')
  fresh = docs_tables.regenerate(text)
  assert docs_tables.marked(fresh) == [('loop', docs_tables.loop())]
  assert fresh.startswith('before\n') and fresh.endswith('\nafter\n')
  empty = (
    '<!-- table: loop -->\n<!-- end table -->\n<!-- table: max_batch -->\n<!-- end table -->\n'
  )
  assert [t for t, _ in docs_tables.marked(docs_tables.regenerate(empty))] == ['loop', 'max_batch']


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="12.5"
 timestamp="2026-11-28T15:58:26.355238+00:00">
<testcase classname="tests.test_a" name="test_one" time="3.25"/>
<testcase classname="tests.test_a" name="test_two[x]" time="0.5"><skipped message="no"/></testcase>
<testcase classname="tests.test_b" name="test_three" time="7.0"><failure message="no"/></testcase>
<testcase classname="tests.test_b" name="test_four" time="1.0"/>
</testsuite></testsuites>
"""


def test_the_suite_tables_are_the_newest_record_of_each_tier(docs_tables, tmp_path, monkeypatch):
  """`benchmarks/suite_time.py` counts a run's JUnit XML (passed, skipped, failed; each file's
  seconds; the slowest first) and names its tier by the marker expression; the tier table
  holds the newest record of each tier, runs of chosen files left out."""
  import json

  import suite_time

  assert suite_time.tier_of([]) == 'suite'
  assert suite_time.tier_of(['-m', 'not slow']) == 'fast'
  assert suite_time.tier_of(['-m', 'equivalence', '--dist', 'load']) == 'equivalence'
  assert suite_time.tier_of(['-n0', 'tests/test_a.py', '-k', 'one']) == 'files'
  (tmp_path / 'run.xml').write_text(JUNIT)
  got = suite_time.results(str(tmp_path / 'run.xml'))
  assert got['counts'] == {'passed': 2, 'skipped': 1, 'failed': 1}
  assert got['pytest_seconds'] == 12.5 and got['test_seconds'] == 11.75
  assert got['file_seconds'] == {'tests/test_b.py': 8.0, 'tests/test_a.py': 3.75}
  assert [s['test'] for s in got['slowest']][:2] == [
    'tests/test_b.py::test_three',
    'tests/test_a.py::test_one',
  ]

  records = tmp_path / 'benchmarks' / 'suite'
  records.mkdir(parents=True)
  machine = {'cpu': 'AMD EPYC', 'cpu_cores': 2, 'vector_isa': 'AVX2'}
  for name, tier, date, wall in [
    ('1_fast.json', 'fast', '2026-11-27T10:00:00', 600.0),
    ('2_fast.json', 'fast', '2026-11-28T10:00:00', 300.0),
    ('3_files.json', 'files', '2026-11-29T10:00:00', 30.0),
  ]:
    record = {**got, 'tier': tier, 'date': date, 'wall_s': wall, 'machine': machine}
    record.update(command=f'pytest {tier}', load_average={'mean': 7.3, 'max': 9.0})
    (records / name).write_text(json.dumps(record))
  monkeypatch.setattr(docs_tables, 'ROOT', str(tmp_path))
  assert docs_tables.suite_tiers().splitlines()[2:] == [
    '| fast | `pytest fast` | 2, 1 | 5.0 min | 2-core AMD EPYC (AVX2) | 7.3, 9.0 '
    '| `benchmarks/suite/2_fast.json` (2026-11-28) |'
  ]
  assert 'no record of the whole suite yet' in docs_tables.suite_slowest()


def test_the_readmes_self_distillation_figures_are_the_newest_record(docs_tables):
  """The README's line on the digits demo without labels quotes the newest
  `benchmarks/dino_digits.py --record` (its table in docs/self_supervised.md is generated)."""
  _, r = docs_tables._latest('*_dino_digits.json')
  pct = lambda x: f'{100 * x:.1f}%'  # noqa: E731
  teacher, start, pixels = r['teacher'], r['random_init'], r['raw_pixels']
  line = (
    f'# {pct(teacher["knn"])} (at initialisation {pct(start["knn"])}, raw pixels '
    f'{pct(pixels["knn"])}), 10-shot probes {pct(teacher["10shot"])} ({pct(start["10shot"])}, '
    f'{pct(pixels["10shot"])}).'
  )
  assert line in (ROOT / 'README.md').read_text(encoding='utf-8'), line
