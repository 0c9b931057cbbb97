"""The tasks plug into the core's registries (prompt sets, rewards, eval metrics, the word
encoder's vocabulary, latent spaces): importing digen_jax.tasks registers them, the core alone
registers none of a task's, and a name nobody registered is one error naming the field and the
registered names."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from digen_jax.data import prompts as prompt_data
from digen_jax.models.text import encoders as text_lib
from digen_jax.rewards import eval_metrics
from digen_jax.rewards import registry
from digen_jax.tasks.shapes import grammar
from tests.helpers.paths import REPO


def test_the_core_alone_loads_no_task_and_registers_none_of_theirs():
  """Importing the builder, the runtime and the evaluator loads neither the tasks nor the
  toolkit; the registries then hold only the core's own entries."""
  code = (
      'import json, sys\n'
      'import digen_jax.experiment.build, digen_jax.experiment.evaluation\n'
      'import digen_jax.runtime.loop\n'
      'from digen_jax.data import prompts\n'
      'from digen_jax.models.text import encoders as text\n'
      'from digen_jax.rewards import eval_metrics, registry\n'
      'print(json.dumps({"loaded": sorted(m for m in sys.modules if m.startswith(\n'
      '    ("digen_jax.tasks", "digen_jax.perf"))), "rewards": registry.registered_names(),\n'
      '    "prompt_sets": prompts.registered_prompt_sets(),\n'
      '    "vocabularies": text.registered_vocabularies(),\n'
      '    "eval_metrics": eval_metrics.registered_names()}))\n'
  )
  out = subprocess.run(
      [sys.executable, '-c', code],
      cwd=REPO,
      env={**os.environ, 'PYTHONPATH': REPO},
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {
      'loaded': [],
      'rewards': ['jpeg_compressibility', 'jpeg_incompressibility', 'temporal_consistency'],
      'prompt_sets': [],
      'vocabularies': [],
      'eval_metrics': [],
  }


def test_the_tasks_register_their_parts():
  assert {'shapes', 'shapes_dense', 'shapes_strict', 'shapes_strict_atoms'} <= set(
      registry.registered_names()
  )
  assert {'shapes', 'shapes_bench', 'text', 'text_render'} <= set(
      prompt_data.registered_prompt_sets()
  )
  assert text_lib.vocabulary('word') == grammar.grammar_words()
  assert 'shapes_bench' in eval_metrics.registered_names()


def test_unknown_names_are_one_error_naming_the_field_and_the_registered_ones(tmp_path):
  with pytest.raises(ValueError, match=r"config.text.encoder='wrod' .*registered: \['word'"):
    text_lib.vocabulary('wrod')
  with pytest.raises(
      ValueError, match=r"config.data.prompts: a registered prompt set \[.*'shapes'"
  ):
    prompt_data.load_prompts('shapez', 'train', str(tmp_path))
  with pytest.raises(ValueError, match=r"unknown reward 'shapez'; registered rewards: .*'shapes'"):
    registry.get_reward('shapez')


def test_the_eval_metrics_are_those_of_the_prompts_task(monkeypatch):
  shapes = [p.to_text() for p in grammar.sample_prompts(3, 0, split='eval')]
  assert eval_metrics.for_prompts(shapes).name == 'shapes_bench'
  assert eval_metrics.for_prompts(shapes + ['a cat on a sofa']) is None
  images = np.zeros((3, 32, 32, 3), np.float32)
  metrics = {}
  passed = eval_metrics.for_prompts(shapes).score(images, shapes, metrics)
  assert passed.shape == (3,) and passed.dtype == bool
  assert {'eval/strict_accuracy', 'eval/strict_accuracy_hard'} <= set(metrics)
  # Two tasks claiming the same prompts: which one's pass counts is unclear, so it is an error.
  monkeypatch.setattr(eval_metrics, '_REGISTRY', dict(eval_metrics._REGISTRY))
  eval_metrics.register('greedy', lambda prompts: True, lambda images, prompts, metrics: None)
  with pytest.raises(
      ValueError, match=r"several registered eval metrics \['greedy', 'shapes_bench'\]"
  ):
    eval_metrics.for_prompts(shapes)


def test_a_reward_worker_is_told_the_modules_that_registered_its_rewards():
  """A worker process imports these (a task's module) before it looks its rewards up."""
  assert registry.defined_in(['shapes', 'shapes_dense', 'jpeg_compressibility']) == [
      'digen_jax.tasks.shapes.checker',
      'digen_jax.rewards.jpeg',
  ]
