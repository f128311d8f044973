"""Where the processes of a SLURM job step meet, and one line on every process when they cannot.

JAX's processes meet at a coordinator, a service that process 0 starts. Under
SLURM, JAX would take the first node's *name* (`n1` of `n[1-2]`) as its
address; a name that the nodes do not resolve, or an address they do not
reach, leaves every process waiting 5 minutes and then aborting in a C++ check
failure. Here the address is the one SLURM itself uses to reach that node, its
`NodeAddr` (`scontrol show node`), unless the user set one
(`--coordinator_address`, or JAX's `JAX_COORDINATOR_ADDRESS`); the port is
JAX's (61440 + job id % 4096, or `JAX_COORDINATOR_PORT`).

Joining (`join`) has a deadline: `JOIN_S` seconds (`VIT_JAX_JOIN_TIMEOUT_S`)
after the process started, the same moment on every node since srun starts
all tasks at once. A process that cannot take part -- the address does not
resolve, process 0 cannot open the port -- says so at once and waits for the
deadline; one still waiting then says what it saw (no answer, refused, or the
others missing). So every process ends with its own `error:` line and exit
status 2 at about the same time, and `srun --kill-on-bad-exit` finds no
process left to kill by signal: the job's status is 2, an error, which the
batch script of `launch/slurm.py` does not requeue (a signal's status, 143,
would read as a preemption). A SIGTERM near the deadline is that kill (the
first process to give up ends the step) and counts the same; one well before
it is a preemption or a cancellation: status 143, requeued.
"""

import errno
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, NamedTuple, Optional

JOIN_S = 60  # seconds from a process's start to join, unless VIT_JAX_JOIN_TIMEOUT_S says
_SIGNAL_MARGIN_S = 10  # a SIGTERM this close to the deadline is srun ending a failed join
_EXIT_ERROR = 2  # vit_jax.core.cli.EXIT_ERROR (cli imports more than this module needs)
_NODE_KEY = 'vit_jax/node/'  # + rank: the node each process runs on, in the shared store


class Coordinator(NamedTuple):
  """Process 0's service: the node it runs on, the host and port the others connect to, and
  where that host came from (for the error lines)."""

  node: str
  host: str
  port: int
  source: str

  @property
  def address(self) -> str:
    return f'[{self.host}]:{self.port}' if ':' in self.host else f'{self.host}:{self.port}'

  def named(self) -> str:
    """How the lines name it: `n1 (127.0.0.2:61234, n1's NodeAddr)`."""
    node = f'{self.node} ' if self.node and self.node != self.host else ''
    return f'{node}({self.address}, {self.source})' if node else f'{self.address} ({self.source})'


def hostnames(hostlist: str) -> list:
  """SLURM's hostlist expanded as `scontrol show hostnames` does: `n[1-2],gpu[08-10]` ->
  n1, n2, gpu08, gpu09, gpu10 (ranges keep their zero padding; several brackets in one name
  multiply out)."""
  names = []
  for item in re.findall(r'(?:[^,\[]|\[[^\]]*\])+', hostlist):
    expanded = ['']
    for text, ranges in re.findall(r'([^\[]*)(?:\[([^\]]*)\])?', item):
      values = [text]
      if ranges:
        values = []
        for part in ranges.split(','):
          first, _, last = part.partition('-')
          width = len(first)
          for number in range(int(first), int(last or first) + 1):
            values.append(text + str(number).zfill(width))
      expanded = [head + value for head in expanded for value in values]
    names += [name for name in expanded if name]
  return names


def node_address(node: str, run=subprocess.run) -> tuple:
  """(the address SLURM reaches `node` at, where that came from): its NodeAddr from
  `scontrol show node`, else its name (no scontrol on this node, or no answer)."""
  try:
    result = run(
      ['scontrol', 'show', 'node', '--oneliner', node], capture_output=True, text=True, timeout=30
    )
  except (OSError, subprocess.SubprocessError):
    return node, 'its name; scontrol did not answer'
  found = re.search(r'(?:^|\s)NodeAddr=(\S+)', result.stdout or '')
  if result.returncode or not found or found.group(1) in ('(null)', 'None'):
    return node, 'its name; scontrol gave no NodeAddr'
  return found.group(1), f"{node}'s NodeAddr"


def slurm_port(environ) -> int:
  """JAX's coordinator port under SLURM: JAX_COORDINATOR_PORT, else 61440 + job id % 4096."""
  if environ.get('JAX_COORDINATOR_PORT'):
    return int(environ['JAX_COORDINATOR_PORT'])
  return 65536 - 4096 + int(environ['SLURM_JOB_ID']) % 4096


def split_address(address: str) -> tuple:
  """'host:port' (or '[v6]:port') -> (host, port)."""
  host, _, port = address.rpartition(':')
  return host.strip('[]'), int(port)


def first_node(environ) -> str:
  """The node of the job step's process 0: the first of SLURM_STEP_NODELIST ('' if none)."""
  names = hostnames(environ.get('SLURM_STEP_NODELIST') or environ.get('SLURM_JOB_NODELIST', ''))
  return names[0] if names else ''


def slurm_coordinator(environ, explicit: Optional[str] = None, run=subprocess.run) -> Coordinator:
  """The coordinator of this SLURM job step: `explicit` (--coordinator_address) or
  JAX_COORDINATOR_ADDRESS if given, else the first node's NodeAddr at JAX's port."""
  node = first_node(environ)
  given = explicit or environ.get('JAX_COORDINATOR_ADDRESS')
  if given:
    host, port = split_address(given)
    source = '--coordinator_address' if explicit else 'JAX_COORDINATOR_ADDRESS'
    return Coordinator(node, host, port, source)
  host, source = node_address(node, run)
  return Coordinator(node, host, slurm_port(environ), source)


def this_node(environ) -> str:
  return environ.get('SLURMD_NODENAME') or socket.gethostname().split('.')[0]


def started_at() -> float:
  """When this process started (time.time()'s clock), from /proc; now where it cannot tell."""
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return time.time()


def join_seconds(environ) -> float:
  value = environ.get('VIT_JAX_JOIN_TIMEOUT_S', '')
  return float(value) if re.fullmatch(r'\d+(\.\d*)?', value) else JOIN_S


def _port_taken(port: int) -> str:
  """Why the coordinator could not listen on `port` on every address of this node ('' if it
  can): as gRPC binds it, after any connection of a previous run left in TIME_WAIT."""
  for family, address in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
      return ''
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return e.strerror
  return ''


def _probe(coordinator: Coordinator) -> str:
  """What a TCP connection to the coordinator finds, in words, for the line."""
  try:
    with socket.create_connection((coordinator.host, coordinator.port), timeout=3):
      return 'its port accepts connections, but not every process joined'
  except socket.timeout:
    return 'no answer from that address (a firewall, or no route between the nodes)'
  except ConnectionRefusedError:
    return 'connection refused (nothing listens there: process 0 is not up, or it is another host)'
  except OSError as e:
    return f'cannot connect: {e.strerror or e}'


class Join:
  """One process joining the coordinator (`run`), or ending in one line (see the module's
  docstring). `here`: this process's node; `initialize(address, timeout_s)`: JAX's
  `jax.distributed.initialize`."""

  def __init__(self, coordinator: Coordinator, rank: int, count: int, here: str, environ):
    self.coordinator = coordinator
    self.rank, self.count, self.here = rank, count, here
    self.seconds = join_seconds(environ)
    self.deadline = started_at() + self.seconds

  def who(self) -> str:
    return f'process {self.rank} of {self.count} (node {self.here})'

  def check(self) -> str:
    """'' if this process can try to join, else its line: the coordinator's address does not
    resolve, or (process 0) its port is taken on this node."""
    c = self.coordinator
    try:
      socket.getaddrinfo(c.host, c.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
      why = e.strerror if isinstance(e, socket.gaierror) else str(e)
      return (
        f'{self.who()} cannot resolve the coordinator {c.named()}: {why}. Check that every node '
        f'resolves {c.host} (DNS or /etc/hosts), or set JAX_COORDINATOR_ADDRESS=HOST:PORT to an '
        'address of the first node that all nodes reach'
      )
    if self.rank == 0:
      taken = _port_taken(c.port)
      if taken:
        return self.port_taken(taken)
    return ''

  def timed_out(self) -> str:
    c = self.coordinator
    return (
      f'{self.who()} gave up after {self.seconds:.0f} s: could not join the coordinator '
      f'{c.named()}: {_probe(c)}. Check that every node reaches {c.address} (the port open '
      "between the nodes, the address on their network) and the other processes' lines; if "
      'the processes only start more than that apart, raise VIT_JAX_JOIN_TIMEOUT_S'
    )

  def port_taken(self, why) -> str:
    c = self.coordinator
    return (
      f'{self.who()} cannot start the coordinator on port {c.port} ({why}): another program '
      f'(another job on {self.here}?) holds it; set JAX_COORDINATOR_PORT to a free port for the '
      'job'
    )

  def end(self, line: str, status: int = _EXIT_ERROR) -> None:
    sys.stdout.flush()
    print(f'error: {line}', file=sys.stderr, flush=True)
    os._exit(status)

  def wait_and_end(self, line: str) -> None:
    """This process cannot join: its line now, the end at the deadline (or a SIGTERM)."""
    print(f'error: {line}', file=sys.stderr, flush=True)
    with _Signals() as signals:
      signals.wait(max(0.0, self.deadline - time.time()))
      sys.stdout.flush()
      os._exit(_EXIT_ERROR)

  def run(self, initialize: Callable[[str, int], None]) -> None:
    """Joins, or ends this process with its line (it does not return then)."""
    line = self.check()
    if line:
      self.wait_and_end(line)
    timeout = int(max(0.0, self.deadline - time.time())) + 30  # JAX's own gives up after ours
    failed = None
    with _Signals() as signals:
      watch = threading.Thread(target=self._watch, args=(signals,), daemon=True)
      watch.start()
      try:
        initialize(self.coordinator.address, timeout)
      except Exception as e:  # noqa: BLE001  re-raised below unless it is the port's
        failed = e
      finally:
        signals.stop()
        watch.join()
    if failed is None:
      return
    if self.rank == 0 and 'Failed to start RPC server' in str(failed):
      self.wait_and_end(self.port_taken(failed))
    raise failed

  def _watch(self, signals) -> None:
    """While `initialize` blocks (in C++, where no Python handler runs): the deadline or a
    signal ends the process with its line."""
    received = signals.wait(max(0.0, self.deadline - time.time()))
    if received is None:  # joined
      return
    if received == signal.SIGINT:
      self.end(f'interrupted (Ctrl-C) while joining; {self.who()}', 128 + signal.SIGINT)
    if received == signal.SIGTERM and time.time() < self.deadline - _SIGNAL_MARGIN_S:
      self.end(
        f'{self.who()} stopped by SIGTERM while the processes were joining at '
        f'{self.coordinator.named()} (preempted, cancelled, or another process ended: its line '
        'says why); nothing was written. Run the same command again (under SLURM: the job '
        'requeues itself) to start',
        128 + signal.SIGTERM,
      )
    self.end(self.timed_out())


class _Signals:
  """SIGTERM and SIGINT as numbers to wait for (`wait`), from any thread, while the main
  thread may be blocked in C++: Python's own handler only writes them to a pipe."""

  _STOP = 0

  def __enter__(self):
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    self._previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def wait(self, seconds: float):
    """A signal's number, or 0 at the deadline, or None once `stop` was called."""
    deadline = time.time() + seconds
    while True:
      ready, _, _ = select.select([self._read], [], [], max(0.0, deadline - time.time()))
      if not ready:
        return 0
      for number in os.read(self._read, 16):
        if number == self._STOP:
          return None
        if number in (signal.SIGTERM, signal.SIGINT):
          return number

  def stop(self):
    os.write(self._write, bytes([self._STOP]))

  def __exit__(self, *exc):
    signal.set_wakeup_fd(self._previous_fd)
    os.set_blocking(self._read, False)
    try:
      late = [n for n in os.read(self._read, 64) if n in self._previous]
    except BlockingIOError:
      late = []
    for number, handler in self._previous.items():
      signal.signal(number, handler)
    os.close(self._read)
    os.close(self._write)
    for number in late:  # arrived as the join ended: to the handlers that were there before
      signal.raise_signal(number)


def publish_node(client, rank: int, node: str) -> None:
  """Records this process's node in the shared store, for `nodes_of`."""
  client.key_value_set(f'{_NODE_KEY}{rank}', node)


def nodes_of(client, ranks, environ=os.environ) -> list:
  """The nodes processes `ranks` ran on, as they recorded them (`publish_node`); process 0's
  from SLURM when the store (process 0's) is gone with it."""
  found = []
  for rank in ranks:
    try:
      node = client.blocking_key_value_get(f'{_NODE_KEY}{rank}', 1000)
    except Exception:  # noqa: BLE001  the store is gone (process 0 with it), or no record
      node = ''
    node = node or (first_node(environ) if rank == 0 else '')
    if node and node not in found:
      found.append(node)
  return found
