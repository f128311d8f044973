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
