"""The package's structure holds: three layers (the core; the tasks and the performance toolkit
on it) with which folder may import which (a small table), the core never reaching up into the
tasks or the toolkit, no import cycles (function-level imports included), no use of another
module's private names, the package root holding only the entry points, and the schedule state
machine free of devices.

Read from the source with `ast` (nothing is imported), so a violation names the file and line.
"""

import ast
import collections
import os
import re

from tests.helpers.paths import REPO

PACKAGE = os.path.join(REPO, 'digen_jax')

# Entry points: the only modules in the package root (python -m digen_jax.<name>).
ENTRY_POINTS = {'main', 'eval', 'plan', 'encode_prompts', 'export'}

# Three layers. The core trains: config and build (experiment/), the schedule and the runtime,
# programs, models, diffusion, RL math, rewards, meshes, outputs, process plumbing, prompt data.
# The tasks (what a run learns: ShapesBench, text rendering) sit on the core and plug into its
# registries (prompt sets, rewards, eval metrics, word vocabularies, latent spaces); the core
# never names them. The performance toolkit (simulator, planner, costs and their committed
# cache) sits on the core too, and needs no task.
TASKS = {'tasks'}
PERF = {'perf'}
# Folder -> the folders its modules may import (besides its own). Within the core the arrows go
# one way (test_the_core_folders_go_one_way): model code knows nothing of RL or meshes' owners;
# RL math nothing of meshes; programs nothing of the builder; process plumbing nothing of the
# builder (the entry points hand it what it needs); nothing below the runtime knows of it.
CORE_ALLOWED = {
    'diffusion': set(),
    'parallel': set(),
    'data': set(),
    'outputs': set(),
    'models': set(),
    'rl': {'diffusion'},
    'rewards': {'outputs'},  # outputs.faults: a reward worker that cannot go on stops the run
    'process': {'outputs'},
    'programs': {'diffusion', 'models', 'parallel', 'rl'},
    'experiment': {
        'data',
        'diffusion',
        'models',
        'outputs',
        'parallel',
        'process',
        'programs',
        'rewards',
        'rl',
    },
    'runtime': {
        'data',
        'diffusion',
        'experiment',
        'models',
        'outputs',
        'parallel',
        'process',
        'programs',
        'rewards',
        'rl',
    },
}
CORE = set(CORE_ALLOWED)
ALLOWED = {**CORE_ALLOWED, **{t: CORE for t in TASKS}, **{p: CORE for p in PERF}}
# The toolkit's command lines that build and run a task's experiment for real: they import the
# package digen_jax.tasks itself, as the entry points do, for its registrations (nothing in it).
# Module names inside their folder.
PERF_COMMANDS_REGISTERING_TASKS = {'profile'}
# The DigenRL schedule is a pure state machine: no devices, threads, clocks or models in it.
PURE = {'digen_jax.runtime.schedule', 'digen_jax.runtime.bts', 'digen_jax.experiment.fragments'}
PURE |= {'digen_jax.runtime.roles'}  # the roles' handlers, as pure as the schedule
PURE_ALLOWED_EXTERNAL = {'__future__', 'dataclasses', 'math', 'typing'}


def _modules() -> dict[str, str]:
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith('.py'):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, REPO)[:-3].replace(os.sep, '.')
        out[name[: -len('.__init__')] if name.endswith('.__init__') else name] = path
  return out


MODULES = _modules()


def _imports(path: str):
  """[(line, imported module, names taken from it or None)] of a file, every import
  (function-level ones too)."""
  out = []
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name, None) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      out.append((node.lineno, node.module, [a.name for a in node.names]))
  return out


def _targets(module: str, names) -> list[str]:
  """The package modules an import statement depends on."""
  if not module.startswith('digen_jax'):
    return []
  if names is None:
    return [module] if module in MODULES else []
  subs = [f'{module}.{n}' for n in names if f'{module}.{n}' in MODULES]
  rest = [n for n in names if f'{module}.{n}' not in MODULES]
  return subs + ([module] if rest and module in MODULES else [])


def _graph() -> dict[str, dict[str, int]]:
  graph = {}
  for name, path in MODULES.items():
    deps = {}
    for line, module, names in _imports(path):
      for t in _targets(module, names):
        if t != name:
          deps.setdefault(t, line)
    graph[name] = deps
  return graph


def _area(module: str) -> str:
  """The folder of digen_jax a module lives in ('root' for the entry points)."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 and os.path.isdir(os.path.join(PACKAGE, parts[1])) else 'root'


def test_the_root_holds_only_entry_points():
  root = {
      m.split('.')[1]
      for m in MODULES
      if m.count('.') == 1 and not os.path.isdir(os.path.join(PACKAGE, m.split('.')[1]))
  }
  assert (
      root == ENTRY_POINTS
  ), f'modules in digen_jax/ besides the entry points: {root - ENTRY_POINTS}'
  areas = {_area(m) for m in MODULES} - {'root'}
  assert areas == set(ALLOWED), f'folders without a row in ALLOWED: {areas ^ set(ALLOWED)}'


def _registers_tasks(name: str, dep: str) -> bool:
  """Whether `name` -> `dep` is a toolkit command line importing digen_jax.tasks (the package)."""
  src, tail = _area(name), name.split('.', 2)[-1]
  return (
      src in PERF
      and tail in PERF_COMMANDS_REGISTERING_TASKS
      and dep in {f'digen_jax.{t}' for t in TASKS}
  )


def test_imports_follow_the_table():
  bad = []
  for name, deps in _graph().items():
    src = _area(name)
    if src == 'root':
      continue  # entry points may import anything
    for dep, line in deps.items():
      dst = _area(dep)
      if dst != src and dst not in ALLOWED[src] and not _registers_tasks(name, dep):
        bad.append(f'{MODULES[name]}:{line}: {src} -> {dst} ({dep})')
  assert not bad, 'imports outside the table:\n' + '\n'.join(bad)


def test_the_core_never_imports_tasks_or_perf():
  """Neither by an import statement nor by a module name in a string (importlib): the tasks and
  the toolkit register into the core, the core never reaches up to them."""
  above = TASKS | PERF
  names = re.compile(r'digen_jax\.(%s)(\.\w+)*' % '|'.join(sorted(above)))
  bad = []
  for name, deps in _graph().items():
    if _area(name) not in CORE:
      continue
    bad += [
        f'{MODULES[name]}:{line}: imports {dep}'
        for dep, line in deps.items()
        if _area(dep) in above
    ]
    for node in ast.walk(ast.parse(open(MODULES[name]).read(), MODULES[name])):
      if (
          isinstance(node, ast.Constant)
          and isinstance(node.value, str)
          and names.fullmatch(node.value)
      ):
        bad.append(f'{MODULES[name]}:{node.lineno}: names module {node.value!r}')
  assert not bad, 'the core reaches up into the tasks or the toolkit:\n' + '\n'.join(bad)


def test_the_package_reads_no_data_from_the_checkouts_benchmarks():
  """An installed package has no benchmarks/ beside it: what the package reads (the toolkit's
  committed costs cache) is its own package data. A path built or opened with 'benchmarks' as
  its first part is a read from the checkout."""
  bad = []
  for path in MODULES.values():
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Call):
        for arg in node.args:
          if (
              isinstance(arg, ast.Constant)
              and isinstance(arg.value, str)
              and arg.value.split('/')[0] == 'benchmarks'
          ):
            bad.append(f'{path}:{node.lineno}: {arg.value!r}')
  assert not bad, "paths into the checkout's benchmarks/:\n" + '\n'.join(bad)


def test_the_core_folders_go_one_way():
  """The core's rows of the table have no cycle (a folder never reaches, through others, back
  to itself): each core folder sits on the ones below it."""
  order, left = [], dict(CORE_ALLOWED)
  while left:
    ready = sorted(f for f, deps in left.items() if not (deps - set(order)))
    assert ready, f'the core rows of ALLOWED have a cycle among {sorted(left)}'
    order += ready
    for f in ready:
      del left[f]
  assert all(set(deps) <= CORE for deps in CORE_ALLOWED.values()), CORE_ALLOWED


def test_no_import_cycles():
  graph = _graph()
  index, low, stack, on, cycles = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        cycles.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  assert not cycles, f'import cycles (function-level imports count): {cycles}'


def test_no_private_names_of_other_modules():
  bad = []
  for name, path in MODULES.items():
    tree = ast.parse(open(path).read(), path)
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        for a in node.names:
          full = f'{node.module}.{a.name}'
          if full in MODULES:
            aliases[a.asname or a.name] = full
          elif node.module.startswith('digen_jax') and a.name.startswith('_'):
            bad.append(f'{path}:{node.lineno}: imports {node.module}.{a.name}')
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.asname and a.name in MODULES:
            aliases[a.asname] = a.name
    for node in ast.walk(tree):
      if (
          isinstance(node, ast.Attribute)
          and isinstance(node.value, ast.Name)
          and node.value.id in aliases
          and node.attr.startswith('_')
          and not node.attr.startswith('__')
      ):
        bad.append(f'{path}:{node.lineno}: {aliases[node.value.id]}.{node.attr}')
  assert not bad, "another module's private names:\n" + '\n'.join(bad)


def test_the_schedule_state_machine_has_no_devices_or_clocks():
  bad = collections.defaultdict(list)
  for name in PURE:
    for line, module, names in _imports(MODULES[name]):
      deps = _targets(module, names)
      if module.startswith('digen_jax'):
        bad[name] += [f'{line}: {d}' for d in deps if d not in PURE]
      elif module.split('.')[0] not in PURE_ALLOWED_EXTERNAL:
        bad[name].append(f'{line}: {module}')
  assert not any(bad.values()), dict(bad)


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def test_files_and_functions_stay_small():
  """No module over 600 lines, no function over 80 (its nested functions counted in)."""
  bad = []
  for path in MODULES.values():
    source = open(path).read()
    if source.count('\n') > MAX_FILE_LINES:
      bad.append(f'{path}: {source.count(chr(10))} lines')
    for node in ast.walk(ast.parse(source, path)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          bad.append(f'{path}:{node.lineno}: {node.name} is {lines} lines')
  assert not bad, 'split these by concern:\n' + '\n'.join(bad)
