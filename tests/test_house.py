"""The package's import graph, computed from its source: no module imports one that imports it
back, directly or around a circle, and no folder of modules (a subpackage) imports a module
that imports back into that folder: every import runs down the house's floors.
Imports inside functions count: a lazy import hides a circle from Python, not from the
reader."""

import ast
import pathlib

import vit_jax

PACKAGE = pathlib.Path(vit_jax.__file__).parent


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def import_graph() -> dict:
  """{module: set of vit_jax modules it imports}, package __init__s included."""
  paths = {module_name(p): p for p in PACKAGE.rglob('*.py')}
  graph = {}
  for name, path in paths.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for a in node.names:  # `from P import m`: the module P.m where there is one, else P
          targets.add(
            f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in paths else node.module
          )
    graph[name] = {t for t in targets if t in paths and t != name}
  return graph


def circles(graph: dict) -> list:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_import_graph_has_no_circles():
  graph = import_graph()
  assert len(graph) > 80 and sum(map(len, graph.values())) > 250  # the whole package was read
  assert circles(graph) == []


def room(module: str) -> str:
  """A module's room: its subpackage (`vit_jax.data`), or itself at the package's top."""
  return '.'.join(module.split('.')[:2])


def test_no_import_runs_back_up_between_rooms():
  """Rooms (subpackages and top-level modules) in a circle would mean an import up a floor,
  as `run_log` -> `data.records` was while `data.tfds` used `run_log`."""
  rooms = {}
  for module, targets in import_graph().items():
    rooms.setdefault(room(module), set()).update(
      room(t) for t in targets if room(t) != room(module)
    )
  assert len(rooms) > 20  # 14 commands and facades at the top, 10 subpackages
  assert circles(rooms) == []


def test_a_circle_is_found():
  graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}, 'e': set()}
  assert circles(graph) == [['a', 'b', 'c']]
  assert circles({'a': {'b'}, 'b': set()}) == []


def test_the_package_top_holds_only_commands_and_the_official_modules():
  """`ls vit_jax/` tells commands from libraries: each module at the top is a command
  (`python -m vit_jax.NAME`) or a module of the official vit_jax API; every library lives in a
  subpackage."""
  official = {'checkpoint', 'input_pipeline', 'train'}
  commands, others = [], []
  for path in sorted(PACKAGE.glob('*.py')):
    if path.stem == '__init__' or path.stem in official:
      continue
    is_command = "if __name__ == '__main__':" in path.read_text(encoding='utf-8')
    (commands if is_command else others).append(path.stem)
  assert others == []
  assert commands == [
    'analyze',
    'benchmark',
    'benchmark_input',
    'compile',
    'evaluate',
    'export',
    'fewshot',
    'jft',
    'knn',
    'main',
    'predict',
    'prepare',
  ]


def _trees() -> dict:
  """{module: its parsed source}."""
  return {module_name(p): ast.parse(p.read_text(encoding='utf-8')) for p in PACKAGE.rglob('*.py')}


def _names(tree) -> set:
  """Every name and attribute a module's code reads (docstrings and comments are not code)."""
  names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  return names | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_the_model_registry_is_read_by_the_model_spec_alone():
  """The architecture is resolved once, by `configs.model_spec`, not again on other floors
  (the trainer, the loader, `data/`). Besides the spec only the registry itself and the official
  API's modules (the `configs.models` path, `models.get_model`, the official-config
  translation) name `MODEL_CONFIGS`."""
  official = {
    'vit_jax.configs.architectures',
    'vit_jax.configs.models',
    'vit_jax.configs.official',
    'vit_jax.models',
  }
  readers = {m for m, tree in _trees().items() if 'MODEL_CONFIGS' in _names(tree)}
  assert readers - official == {'vit_jax.configs.model_spec'}


def test_one_resolution_of_the_model_and_one_prefix_rule():
  """No function re-derives the architecture from a config (`model_config`, of which there
  were two), and the tokens before the patches are counted in one place
  (`model_spec.prefix_tokens`; seven copies of `classifier in ('token', 'token_unpooled')`
  before): the other modules ask `has_class_token`, `prefix_tokens` or a `ModelSpec`."""
  trees = _trees()
  functions = {
    n.name for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
  }
  assert 'model_config' not in functions and 'pixels_per_patch' not in functions
  rule = [
    module
    for module, tree in trees.items()
    for n in ast.walk(tree)
    if isinstance(n, ast.Compare)
    and any(
      isinstance(c, ast.Tuple) and "'token_unpooled'" in ast.unparse(c) for c in n.comparators
    )
  ]
  assert rule == ['vit_jax.configs.model_spec']


def test_one_look_ahead_queue():
  """Work drawn ahead of its use (thread-pool jobs, transfers to the devices) goes through
  `data.host.ahead_of`, not a queue written by hand."""
  queues = [
    (module, n.lineno)
    for module, tree in _trees().items()
    for n in ast.walk(tree)
    if isinstance(n, ast.Call) and ast.unparse(n.func).endswith('deque')
  ]
  assert [module for module, _ in queues] == ['vit_jax.data.host'], queues
