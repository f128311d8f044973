"""Reading a compiled XLA program's text: collectives, matmul dtypes, loop trip counts.

`cost_analysis()` lists neither the collectives nor their sizes, and counts a
loop's body once; the compiled HLO text has both. Each collective is counted
as many times as it runs per call: computations called from a `while` body run
its trip count times (read from the loop condition's bound, as JAX's `scan`
and `fori_loop` write it).
"""

import collections
import math
import re

import numpy as np

_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'bf16': 2,
  'f16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
}
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$')
_OP = re.compile(r'\s([a-z][\w\-]*)\(')
# Element types: pred, s8 ... f64, bf16, and the FP8 types (f8e4m3fn, f8e5m2, ...).
_ARRAY = re.compile(r'\b(pred|[suf]\d+(?:e\d+m\d+[a-z]*)?|bf16)\[([\d,]*)\]')
_CALLS = re.compile(
  r'(?:calls|to_apply|condition|body|branch_computations|called_computations)=\{?([^}]*?)(?:\}|,\s*\w+=|$)'
)


def array_bytes(type_text: str) -> int:
  """Bytes of every array in a (possibly tuple) HLO type, layouts ignored."""
  total = 0
  for dtype, dims in _ARRAY.findall(re.sub(r'\{[^{}]*\}', '', type_text)):
    size = 1 if dtype.startswith('f8') else _DTYPE_BYTES.get(dtype, 4)
    total += size * math.prod(int(d) for d in dims.split(',') if d)
  return total


def _computations(text: str) -> dict:
  """{name: [instruction lines]}, and the entry's name under key None."""
  computations, current = {}, None
  for line in text.splitlines():
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(2)
      computations[current] = []
      if match.group(1):
        computations[None] = current
    elif current is not None and line.strip() == '}':
      current = None
    elif current is not None:
      computations[current].append(line)
  return computations


def _trip_count(condition_lines) -> int:
  """The bound N of `i < N` in a loop condition; 1 when it cannot be read."""
  constants = {}
  for line in condition_lines:
    match = _INSTRUCTION.match(line)
    if match:
      constant = re.search(r'\bs32\[\][^ ]*\s+constant\((\d+)\)', match.group(2))
      if constant:
        constants[match.group(1)] = int(constant.group(1))
  for line in condition_lines:
    if 'compare(' in line and 'direction=LT' in line:
      for name in re.findall(r'%([\w.\-]+)', line.split('compare(', 1)[1]):
        if name in constants:
          return constants[name]
  return 1


def _while_trips(line: str, computations: dict) -> int:
  """A `while` instruction's trip count: the compiler's own (`known_trip_count`, GPU), else the
  bound in its condition (TPU, CPU), else 1."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  if known:
    return int(known.group(1))
  condition = re.search(r'condition=%([\w.\-]+)', line)
  return _trip_count(computations.get(condition.group(1), [])) if condition else 1


def loop_trip_counts(text: str) -> list:
  """Trip counts of the `while` loops of a program, in text order."""
  computations = _computations(text)
  trips = []
  for name, lines in computations.items():
    if name is None:
      continue
    for line in lines:
      if re.search(r' while\(', line):
        trips.append(_while_trips(line, computations))
  return trips


def multiplicities(text: str) -> dict:
  """How many times each computation runs per call of the entry computation."""
  computations = _computations(text)
  entry = computations.pop(None, None)
  callees = collections.defaultdict(list)  # caller -> [(callee, times)]
  for name, lines in computations.items():
    for line in lines:
      if ' while(' in line:
        body = re.search(r'body=%([\w.\-]+)', line)
        condition = re.search(r'condition=%([\w.\-]+)', line)
        trips = _while_trips(line, computations)
        if body:
          callees[name].append((body.group(1), trips))
        if condition:
          callees[name].append((condition.group(1), trips + 1))
        continue
      for group in _CALLS.findall(line):
        for callee in re.findall(r'%([\w.\-]+)', group):
          callees[name].append((callee, 1))
  counts = collections.Counter()

  def visit(name, times):
    counts[name] += times
    for callee, factor in callees.get(name, ()):
      visit(callee, times * factor)

  if entry:
    visit(entry, 1)
  return counts


# The named form, with the mesh's device order when it is not 0, 1, 2, ...:
# mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}
_MESH_GROUPS = re.compile(
  r'replica_groups=mesh\[([^\]]*)\]'
  r'(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}'
)


def _group_size(line: str) -> int:
  """Devices taking part in each group of a collective."""
  groups = re.search(r'replica_groups=\{\{([\d,]*)\}', line)
  if groups:
    return len(groups.group(1).split(','))
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=', line)
  if iota:
    return int(iota.group(2))
  mesh = _MESH_GROUPS.search(line)
  if mesh:
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(4)))
  return 1


def _iota(dims: str, perm) -> np.ndarray:
  """Ids 0..N-1 shaped `dims`, transposed by `perm` (XLA's iota device lists)."""
  ids = np.arange(math.prod(int(d) for d in dims.split(','))).reshape(
    [int(d) for d in dims.split(',')]
  )
  return ids.transpose([int(p) for p in perm.split(',')]) if perm else ids


def replica_groups(line: str) -> list:
  """The device groups of one collective instruction, as lists of partition ids.

  Reads the explicit `{{0,1},{2,3}}` form, the iota form `[G,S]<=[d0,d1,...]`
  with an optional transpose `T(p0,p1,...)`, and the named form
  `mesh['a'=2,'b'=4] {'a'}`; [] when the line names none.
  """
  explicit = re.search(r'replica_groups=\{((?:\{[\d,]*\},?)*)\}', line)
  if explicit:
    return [
      [int(i) for i in g.split(',') if i] for g in re.findall(r'\{([\d,]*)\}', explicit.group(1))
    ]
  iota = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
  if iota:
    groups = int(iota.group(1).split(',')[0])
    return _iota(iota.group(2), iota.group(3)).reshape(groups, -1).tolist()
  mesh = _MESH_GROUPS.search(line)
  if mesh:
    sizes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))]
    grouped = re.findall(r"'(\w+)'", mesh.group(4))
    names = [a for a, _ in sizes]
    ids = np.arange(math.prod(n for _, n in sizes))
    if mesh.group(2):
      ids = _iota(mesh.group(2), mesh.group(3))
    ids = ids.reshape([n for _, n in sizes])
    order = [names.index(a) for a in names if a not in grouped] + [names.index(a) for a in grouped]
    size = math.prod(n for a, n in sizes if a in grouped)
    return ids.transpose(order).reshape(-1, size).tolist()
  return []


def collective_lines(text: str) -> list:
  """[(op, instruction line, runs per call)] of every collective of the program."""
  counts = multiplicities(text)
  out = []
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for line in lines:
      match = _INSTRUCTION.match(line)
      op = _OP.search(match.group(2)) if match else None
      if op and op.group(1).removesuffix('-start') in COLLECTIVES:
        out.append((op.group(1).removesuffix('-start'), line, counts[name]))
  return out


def collective_instructions(text: str) -> list:
  """[{op, count, bytes, group_size, groups}] per collective instruction, per call.

  `bytes` is the full array the collective works on (an all-gather's output, a
  reduce-scatter's input, an all-reduce's operand) times `count`, the runs per
  call; `groups` the replica groups as positions in the program's devices.
  """
  counts = multiplicities(text)
  out = []
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      rest = match.group(2)
      op = _OP.search(rest)
      if not op or op.group(1).removesuffix('-start') not in COLLECTIVES:
        continue
      kind = op.group(1).removesuffix('-start')
      result_type = rest[: op.start()]
      n = _group_size(line)
      size = array_bytes(result_type)
      if op.group(1).endswith('-start') and kind in ('all-gather', 'reduce-scatter'):
        # An async gather or scatter returns (its inputs, its outputs): the full
        # arrays and their 1/n shards, n / (n + 1) of the tuple.
        size = size * n // (n + 1)
      elif kind == 'reduce-scatter':
        size *= n
      out.append(
        {
          'op': kind,
          'count': counts[name],
          'bytes': counts[name] * size,
          'group_size': n,
          'groups': replica_groups(line),
        }
      )
  return out


def ring_factor(op: str, n: int) -> float:
  """Bytes each of n devices sends per byte of the array, ring algorithm."""
  if n <= 1:
    return 0.0
  return (2.0 if op == 'all-reduce' else 1.0) * (n - 1) / n


def collectives(text: str) -> list:
  """[{op, count, bytes, group_size, moved_bytes}] per kind and group size, per call.

  `moved_bytes` is what each device sends with a ring algorithm: 2 (n-1)/n of
  `bytes` for an all-reduce, (n-1)/n for the others.
  """
  rows = {}
  for c in collective_instructions(text):
    kind, n = c['op'], c['group_size']
    row = rows.setdefault((kind, n), {'op': kind, 'group_size': n, 'count': 0, 'bytes': 0})
    row['count'] += c['count']
    row['bytes'] += c['bytes']
    row['moved_bytes'] = row.get('moved_bytes', 0.0) + c['bytes'] * ring_factor(kind, n)
  return sorted(rows.values(), key=lambda r: (r['op'], r['group_size']))


def custom_calls(text: str) -> dict:
  """{custom-call target: runs per call}: library kernels such as cuDNN's fused attention."""
  counts = multiplicities(text)
  out = collections.Counter()
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for line in lines:
      target = re.search(r'custom_call_target="([^"]+)"', line)
      if target:
        out[target.group(1)] += counts[name]
  return dict(out)


def _is_library_matmul(rest: str) -> bool:
  """A GPU program's matmul or convolution: a cuBLAS or cuDNN custom call (not attention)."""
  target = re.search(r'custom_call_target="([^"]+)"', rest)
  return bool(target) and bool(re.search(r'cublas|cudnn\$conv', target.group(1)))


def matmul_dtypes(text: str) -> dict:
  """{'bf16 x bf16 -> f32': count, ...} of the dots and convolutions, per call.

  On GPUs these are cuBLAS and cuDNN calls; their first two operands are the
  matrices (a third and fourth are an epilogue's bias and scale).
  """
  counts = multiplicities(text)
  out = collections.Counter()
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    types = {}
    for line in lines:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      rest = match.group(2)
      op = _OP.search(rest)
      result = _ARRAY.search(rest[: op.start()] if op else rest)
      if result:
        types[match.group(1)] = result.group(1)
      if op and (op.group(1) in ('dot', 'convolution') or _is_library_matmul(rest)):
        args = rest[op.end() :].split(')', 1)[0]
        operands = [types.get(a, '?') for a in re.findall(r'%([\w.\-]+)', args)][:2]
        out[f'{" x ".join(operands)} -> {result.group(1) if result else "?"}'] += counts[name]
  return dict(out)


def cross_slice_transfers(text: str) -> list:
  """What a multi-slice TPU program sends over the data-centre network, per call.

  libtpu compiles one slice's program: collectives within the slice keep their
  replica groups, and those across slices become host-transfer `send`s
  (megascale) marked with their kind (`ALL_REDUCE`, ...) and reduction.
  Returns [{kind, reduction, count, bytes, arrays}] per send instruction;
  `bytes` as laid out on the TPU (tiles padded), times `count`.
  """
  counts = multiplicities(text)
  rows = []
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for line in lines:
      kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
      match = _INSTRUCTION.match(line)
      if not kind or not match or ' send(' not in match.group(2):
        continue
      result_type = match.group(2).split(' send(', 1)[0]
      data = [f'{t}[{d}]' for t, d in _ARRAY.findall(re.sub(r'\{[^{}]*\}', '', result_type))]
      data = [a for a in data if not a.startswith('u32[]')]
      reduction = re.search(r'_xla_megascale_reduce_operation="(\w+)"', line)
      rows.append(
        {
          'kind': kind.group(1),
          'reduction': reduction.group(1) if reduction else None,
          'count': counts[name],
          'bytes': counts[name] * sum(array_bytes(a) for a in data),
          'arrays': data,
        }
      )
  return rows


# Instructions of a GPU program that launch no kernel of their own: they name,
# wrap or sequence the work of others (a `*-done` waits for its `*-start`).
_NO_KERNEL = frozenset(
  (
    'parameter',
    'constant',
    'get-tuple-element',
    'tuple',
    'bitcast',
    'while',
    'conditional',
    'call',
    'after-all',
    'add-dependency',
    'opt-barrier',
    'partition-id',
    'replica-id',
  )
)
_FLOAT_BITS = {'f64': 64, 'f32': 32, 'bf16': 16, 'f16': 16}
# Ops that move an array without changing its values: a parameter seen through them is still it.
_PASS_THROUGH = ('bitcast', 'reshape', 'transpose', 'copy', 'get-tuple-element')


def _parsed(lines) -> dict:
  """{instruction name: (op, result type, operand names, line)} of one computation."""
  out = {}
  for line in lines:
    match = _INSTRUCTION.match(line)
    op = _OP.search(match.group(2)) if match else None
    if not op:
      continue
    rest = match.group(2)
    depth, end = 1, op.end()
    while end < len(rest) and depth:  # the operand list: up to its closing parenthesis
      depth += {'(': 1, ')': -1}.get(rest[end], 0)
      end += 1
    operands = re.findall(r'%([\w.\-]+)', rest[op.end() : end])
    out[match.group(1)] = (op.group(1), rest[: op.start()].strip(), operands, line)
  return out


def _kernel_computations(computations: dict) -> dict:
  """{computation: runs per call} of the computations whose instructions are kernels: the
  entry and what it runs through `while`, `conditional` and `call` (not fusions' bodies)."""
  entry = computations.get(None)
  counts = collections.Counter()

  def visit(name, times):
    counts[name] += times
    for line in computations.get(name, ()):
      if ' while(' in line:
        trips = _while_trips(line, computations)
        for key, factor in (('body', trips), ('condition', trips + 1)):
          callee = re.search(key + r'=%([\w.\-]+)', line)
          if callee:
            visit(callee.group(1), times * factor)
      elif ' conditional(' in line or re.search(r' call\(', line):
        for group in re.findall(
          r'(?:branch_computations|to_apply)=\{?([^}]*?)(?:\}|,\s*\w+=|$)', line
        ):
          for callee in re.findall(r'%([\w.\-]+)', group):
            visit(callee, times)

  if entry:
    visit(entry, 1)
  return counts


def kernel_name(name: str, op: str, line: str) -> str:
  """What a profile calls one kernel-level instruction: a fusion by its instruction name without
  its number (`loop_multiply_fusion.11` -> `loop_multiply_fusion`), a library call by its target
  and, for cuBLASLt, its epilogue (`__cublas$lt$matmul:BIAS_GELU`), other ops by their op."""
  if op == 'custom-call':
    target = re.search(r'custom_call_target="([^"]+)"', line)
    epilogue = re.search(r'"epilogue":"(\w+)"', line)
    return (target.group(1) if target else op) + (f':{epilogue.group(1)}' if epilogue else '')
  if op == 'fusion':
    return re.sub(r'(\.\d+)+$', '', name)
  return op


def kernel_kind(name: str) -> str:
  """'gemm' (a cuBLAS matmul or cuDNN convolution), 'attention' (cuDNN's fused attention) or
  'other' (fusions and unfused ops: norms, elementwise work, reductions, copies, the optimizer)
  of a `kernel_name`."""
  if name.startswith('__cudnn$fmha'):
    return 'attention'
  if name.startswith('__cublas') or name.startswith('__cudnn$conv'):
    return 'gemm'
  return 'other'


def _kernel_rows(text: str):
  """(kernel name, launches per call, bytes it writes per launch) of every kernel-level
  instruction (`kernel_name`); a library call's workspace is not counted as written."""
  computations = _computations(text)
  for computation, times in _kernel_computations(computations).items():
    for name, (op, result, _, line) in _parsed(computations.get(computation, ())).items():
      if op in _NO_KERNEL or op.endswith('-done'):
        continue
      if op == 'custom-call':  # (outputs..., s8[workspace]): the scratch space is not output
        result = re.sub(r',\s*s8\[\d+\]\{0\}\s*\)$', ')', result)
      yield kernel_name(name, op, line), times, array_bytes(result)


def kernels(text: str) -> dict:
  """{kernel name (`kernel_name`): launches per call} of a compiled GPU program: its fusions,
  library calls (cuBLAS, cuDNN) and unfused ops, loops counted by their trip counts."""
  out = collections.Counter()
  for name, times, _ in _kernel_rows(text):
    out[name] += times
  return dict(out)


def kernel_bytes(text: str, kinds=('gemm', 'attention', 'other')) -> int:
  """Bytes that a compiled GPU program's kernels of `kinds` (`kernel_kind`) write per call: the
  size of every kernel's outputs, a proxy for the memory traffic of the elementwise and copy
  kernels between the matmuls (what a transpose, a pad or an unfused bias add costs)."""
  return sum(times * size for name, times, size in _kernel_rows(text) if kernel_kind(name) in kinds)


def _is_fp8(type_text: str) -> bool:
  array = _ARRAY.search(type_text)
  return bool(array) and array.group(1).startswith('f8')


def fp8_transposes(text: str) -> dict:
  """The FP8 arrays a compiled GPU program writes through a `transpose` or `copy` (a layout
  change; an FP8 GEMM on Hopper reads both operands with the contracted dimension minor), per
  call, in two kinds by what the layout change reads:

  - 'fp8': an FP8 array read from memory and written again in another layout, a pass over
    FP8 data that exists only for the GEMM;
  - 'cast': a wider array (bf16) rounded to FP8 and written in the new layout by the same
    kernel that quantises it (one pass, as Transformer Engine's cast-transpose).

  {kind: {'count': layout changes, 'bytes': the FP8 bytes they write}}."""
  computations = _computations(text)
  out = {kind: {'count': 0, 'bytes': 0} for kind in ('fp8', 'cast')}
  for computation, times in _kernel_computations(computations).items():
    for name, (op, result, operands, line) in _parsed(computations.get(computation, ())).items():
      if op == 'fusion':
        called = re.search(r'calls=%([\w.\-]+)', line)
        body = _parsed(computations.get(called.group(1), ())) if called else {}
      elif op in ('transpose', 'copy'):
        body = {name: (op, result, operands, line)}
      else:
        continue
      for inner_op, inner_result, inner_operands, _ in body.values():
        if inner_op not in ('transpose', 'copy') or not _is_fp8(inner_result):
          continue
        source = inner_operands[0] if inner_operands else None
        while source in body and body[source][0] in ('bitcast', 'reshape') and body[source][2]:
          source = body[source][2][0]
        # Inside a fusion the array comes from a parameter (memory) or from a convert (a cast
        # in the same kernel); an unfused transpose reads its operand from memory.
        from_memory = source not in body or body[source][0] == 'parameter'
        kind = 'fp8' if from_memory else 'cast'
        out[kind]['count'] += times
        out[kind]['bytes'] += times * array_bytes(inner_result)
  return out


def op_counts(text: str) -> dict:
  """{HLO op: runs per call}, inside fusions too: how many `pad`s or `convolution`s a
  program does, whichever kernel they ended up in."""
  counts = multiplicities(text)
  out = collections.Counter()
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for op, *_ in _parsed(lines).values():
      out[op] += counts[name]
  return dict(out)


def pads(text: str) -> dict:
  """{'<result type> <padding>': runs per call} of the program's `pad`s, inside fusions too
  (`bf16[512,198,768] 0_0x0_1x0_0`: one token appended to 197)."""
  counts = multiplicities(text)
  out = collections.Counter()
  for name, lines in _computations(text).items():
    if name is None or not counts.get(name):
      continue
    for op, result, _, line in _parsed(lines).values():
      padding = re.search(r'padding=([\d_x\-]+)', line)
      if op == 'pad' and padding:
        out[f'{re.sub(r"[{][^}]*[}]", "", result)} {padding.group(1)}'] += counts[name]
  return dict(out)


def _source_parameter(name: str, instructions: dict):
  """The `parameter(i)` that `name` is, seen through ops that only move values; i or None."""
  while name in instructions:
    op, _, operands, line = instructions[name]
    if op == 'parameter':
      return int(re.search(r'parameter\((\d+)\)', line).group(1))
    if op not in _PASS_THROUGH or not operands:
      return None
    name = operands[0]
  return None


def _narrows(convert_type: str, operand_type: str) -> bool:
  new, old = _ARRAY.search(convert_type), _ARRAY.search(operand_type)
  return bool(new and old) and _FLOAT_BITS.get(new.group(1), 99) < _FLOAT_BITS.get(old.group(1), 0)


def parameter_converts(text: str) -> dict:
  """{entry parameter: times per call} of the program's arguments cast to a narrower float type
  (f32 -> bf16) in the entry computation, fused or not; a parameter is named by its `op_name`
  (JAX writes the argument's path, `p['head']['kernel']`), else by its instruction name."""
  computations = _computations(text)
  entry = _parsed(computations.get(computations.get(None), ()))
  names = {}
  for name, (op, _, _, line) in entry.items():
    if op == 'parameter':
      label = re.search(r'op_name="([^"]*)"', line)
      names[name] = label.group(1).replace("\\'", "'") if label else name
  out = collections.Counter()
  for name, (op, _, operands, line) in entry.items():
    if op == 'convert':
      body, args = {name: entry[name]}, [name]
    elif op == 'fusion':
      body = _parsed(computations.get(re.search(r'calls=%([\w.\-]+)', line).group(1), ()))
      args = [n for n, (o, *_) in body.items() if o == 'convert']
    else:
      continue
    for convert in args:
      c_op, c_type, c_operands, _ = body[convert]
      inner = c_operands[0] if c_operands else None
      if inner is None or inner not in body or not _narrows(c_type, body[inner][1]):
        continue
      if op == 'fusion':
        index = _source_parameter(inner, body)
        if index is None or index >= len(operands):
          continue
        inner = operands[index]
      source = inner
      while source in entry and entry[source][0] in _PASS_THROUGH and entry[source][2]:
        source = entry[source][2][0]
      if source in names:
        out[names[source]] += 1
  return dict(out)


# A kernel's own time estimate in a compiled TPU program: its backend config's cycle count.
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_MATMUL_OPS = (' convolution(', ' dot(')


def _source_op(op: str, line: str) -> str:
  """A kernel by the JAX operation it came from (`op_name`, without the program's name and with
  encoder blocks unnumbered, so a layer's kernels add up across the layers) and its HLO op
  (`fusion`, `copy`, `all-reduce`, ...)."""
  label = re.search(r'op_name="([^"]*)"', line)
  path = label.group(1).split('/', 1)[-1] if label else '(no source)'  # less jit(train_step)/
  return f'{re.sub(r"encoderblock_[0-9]+", "encoderblock_*", path)} ({op})'


def time_by_op(text: str, top: int = 6) -> dict:
  """Where a compiled TPU program's time goes, by the compiler's estimate of each kernel (the
  `estimated_cycles` of its backend config; loops counted by their trip counts): the matmuls'
  share (kernels that compute a dot or a convolution) and the `top` other sources of time,
  grouped by the JAX operation they came from. {} for programs without the estimates (GPU, CPU).
  """
  computations = _computations(text)
  matmuls, others = 0, collections.Counter()
  for computation, times in _kernel_computations(computations).items():
    for _, (op, _, _, line) in _parsed(computations.get(computation, ())).items():
      cycles = _CYCLES.search(line)
      if not cycles:
        continue
      cycles = int(cycles.group(1)) * times
      called = re.search(r'calls=%([\w.\-]+)', line) if op == 'fusion' else None
      body = '\n'.join(computations.get(called.group(1), ())) if called else ''
      if op in ('convolution', 'dot') or any(m in body for m in _MATMUL_OPS):
        matmuls += cycles
      else:
        others[_source_op(op, line)] += cycles
  total = matmuls + sum(others.values())
  if not total:
    return {}
  return {
    'total_cycles': total,
    'matmul_share': matmuls / total,
    'top_other': [{'op': op, 'share': c / total} for op, c in others.most_common(top)],
  }


_ASYNC_START = re.compile(
  r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter)-start\('
)


def async_collectives(text: str) -> list:
  """The asynchronous collectives of a scheduled GPU program (`*-start` ... `*-done` pairs), each
  with its bytes and the kernels the schedule runs between its start and its done: fusions and
  library calls, and among them the matmuls and convolutions (cuBLAS, cuDNN). Computation
  placed there overlaps the transfer; none means the step waits for it."""
  out = []
  for lines in _computations(text).values():
    if not isinstance(lines, list):
      continue
    for i, line in enumerate(lines):
      start = _ASYNC_START.match(line)
      if not start:
        continue
      name, result, op = start.groups()
      between = []
      for later in lines[i + 1 :]:
        if re.search(rf'{op}-done\(%{re.escape(name)}\)', later):
          break
        if re.search(r'\s(fusion|custom-call)\(', later):
          between.append(later)
      out.append({
        'op': op,
        'bytes': array_bytes(result),
        'kernels_between': len(between),
        'matmuls_between': sum(bool(re.search(r'__cublas|__cudnn|gemm', k)) for k in between),
      })  # fmt: skip
  return out
