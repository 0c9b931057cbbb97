"""experiment/build.py is the one reader of the config dict: the programs, the runtime (roles,
schedule, links), the RL math and the diffusion code read the typed, frozen Run it builds
(experiment/run.py), never the config. A build with abstract=True is the same Run with every
weight a ShapeDtypeStruct."""

import ast
import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import qwenimage
from configs import shapes
from digen_jax.experiment import build as experiment
from digen_jax.experiment import config as configlib
from digen_jax.experiment import run as run_lib
from tests.helpers.paths import REPO

ROOT = REPO
CONFIG_FREE = ('programs', 'runtime', 'rl', 'diffusion')
# Modules that hold or build the config dict: importing one is reading the config.
CONFIG_MODULES = ('ml_collections', 'digen_jax.experiment.config', 'digen_jax.experiment.build')


def _config_reads(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, what) of every place `tree` reads a config dict: an attribute named `config`
  (jax.config, JAX's own flags, excepted), a ConfigDict, a parameter named `config`, an import
  of ml_collections or of the config / builder modules."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr == 'config':
      if not (isinstance(node.value, ast.Name) and node.value.id == 'jax'):
        found.append((node.lineno, f'{ast.unparse(node)}'))
    elif isinstance(node, (ast.Attribute, ast.Name)) and 'ConfigDict' in (
        getattr(node, 'attr', None),
        getattr(node, 'id', None),
    ):
      found.append((node.lineno, ast.unparse(node)))
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      a = node.args
      for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
        if arg is not None and arg.arg == 'config':
          name = getattr(node, 'name', 'lambda')
          found.append((node.lineno, f'parameter config of {name}'))
    elif isinstance(node, ast.Import):
      found += [
          (node.lineno, f'import {n.name}') for n in node.names if n.name.startswith(CONFIG_MODULES)
      ]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [f'{node.module}.{n.name}' for n in node.names] + [node.module]
      if any(n.startswith(CONFIG_MODULES) for n in names):
        found.append((node.lineno, f'from {node.module} import ...'))
  return found


def _sources():
  for area in CONFIG_FREE:
    folder = os.path.join(ROOT, 'digen_jax', area)
    for dirpath, _, files in os.walk(folder):
      for f in sorted(files):
        if f.endswith('.py'):
          path = os.path.join(dirpath, f)
          yield os.path.relpath(path, ROOT), path


def test_the_config_free_packages_never_read_the_config_dict():
  sources = list(_sources())
  assert len(sources) > 20, sources  # the folders are where this test looks for them
  bad = []
  for rel, path in sources:
    with open(path) as f:
      tree = ast.parse(f.read(), rel)
    bad += [f'{rel}:{line}: {what}' for line, what in _config_reads(tree)]
  assert not bad, 'read the Run (experiment/run.py), not the config:\n' + '\n'.join(bad)


def test_the_check_sees_each_kind_of_read():
  code = (
      'import ml_collections\n'
      'from digen_jax.experiment import config as configlib\n'
      'def f(exp, config):\n'
      '  c = exp.config\n'
      '  return ml_collections.ConfigDict()\n'
      'jax.config.update("x", 1)\n'
  )
  found = {line for line, _ in _config_reads(ast.parse(code))}
  assert found == {1, 2, 3, 4, 5}, _config_reads(ast.parse(code))


def _tiny(tmp_path, **overrides):
  return configlib.apply_overrides(
      qwenimage.get_config('tiny'), {'data.data_dir': str(tmp_path / 'data'), **overrides}
  )


@pytest.mark.parametrize('overrides', [{}, {'model.lora.rank': 4}], ids=['full', 'lora'])
def test_an_abstract_build_is_the_concrete_run_without_arrays(tmp_path, overrides):
  concrete = experiment.build(_tiny(tmp_path, **overrides), str(tmp_path), 2)
  try:
    abstract = experiment.build(_tiny(tmp_path, **overrides), abstract=True, num_devices=2)
  finally:
    concrete.reward_fn.close()
  assert isinstance(abstract, run_lib.Run) and dataclasses.is_dataclass(abstract)
  with pytest.raises(dataclasses.FrozenInstanceError):
    abstract.seed = 1  # frozen: a role cannot change the run under another
  want, got = run_lib.spec_fields(concrete), run_lib.spec_fields(abstract)
  assert want.keys() == got.keys()
  for name, value in want.items():
    if isinstance(value, np.ndarray):
      np.testing.assert_array_equal(got[name], value, err_msg=name)
    else:
      assert got[name] == value, name
  for part in ('params', 'base_abstract'):
    c, a = getattr(concrete.weights, part), getattr(abstract.weights, part)
    assert jax.tree.structure(c) == jax.tree.structure(a), part
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(a)), part
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(c)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(a)
    ], part
  assert (concrete.weights.lora is None) == ('model.lora.rank' not in overrides)
  assert abstract.weights.lora == concrete.weights.lora
  assert abstract.text_encoder is abstract.prompts is abstract.reward_fn is None


def test_the_build_leaves_the_config_as_given(tmp_path, monkeypatch):
  """The checkpoint folder the run reads is the model spec's, resolved; the config keeps what
  the user wrote (a repo-relative path, here from another working directory)."""
  monkeypatch.chdir(tmp_path)
  config = configlib.apply_overrides(
      shapes.get_config('pixel'), {'data.data_dir': str(tmp_path / 'data')}
  )
  assert config.model.checkpoint == 'assets/shapes_base'
  before = config.to_json_best_effort()
  exp = experiment.build(config, str(tmp_path), 1)
  exp.reward_fn.close()
  assert config.to_json_best_effort() == before
  assert os.path.isabs(exp.model.checkpoint) and os.path.isdir(exp.model.checkpoint)
  assert exp.model.checkpoint == os.path.join(ROOT, 'assets', 'shapes_base')


def test_reward_weights_are_parsed_into_the_spec_once(tmp_path):
  exp = experiment.build(
      _tiny(tmp_path, **{'reward.weights': 'jpeg_compressibility:1, shapes:0.5'}),
      str(tmp_path),
      1,
  )
  exp.reward_fn.close()
  assert exp.reward.weights == (('jpeg_compressibility', 1.0), ('shapes', 0.5))
  assert exp.reward_fn.weights == exp.reward.weight_map
  with pytest.raises(ValueError, match=r'^config\.reward\.weights: '):
    run_lib.reward_weights(_tiny(tmp_path, **{'reward.weights': 'shapes:x'}).reward)
