"""benchmarks/gpu_check.py at toy size on the CPU: every part runs and reports what the GPU run
reports (so the GPU check cannot rot between the sessions that have a GPU)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_gpu_check_runs_every_part_at_toy_size(tmp_path):
  out = tmp_path / 'check'
  proc = subprocess.run(
      [
          sys.executable,
          'benchmarks/gpu_check.py',
          '--out',
          str(out),
          '--size',
          'tiny',
          '--reps',
          '1',
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=1200,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((out / 'gpu_check.json').read_text())
  machine = result['machine']
  for key in ('device', 'platform', 'jax', 'flax', 'torch', 'diffusers', 'date'):
    assert machine.get(key), key

  runs = result['runs']
  assert set(runs) == {'qwenimage_tiny', 'flux_tiny', 'main_job'}
  for name, run in runs.items():
    assert 'error' not in run, (name, run.get('error'))
    assert run['wall_s'] > 0 and run['steps'] == 2, (name, run)
  main = runs['main_job']
  assert 0.0 <= main['base_strict_accuracy'] <= 1.0 and 0.0 <= main['final_strict_accuracy'] <= 1.0

  for family in ('qwenimage', 'flux'):
    r = result['transformers'][family]
    assert r['flops']['forward'] > 0 and r['flops']['grad'] == pytest.approx(
        3 * r['flops']['forward'] * r['flops']['grad_batch'] / r['flops']['batch']
    )
    for fw in ('jax', 'torch'):
      assert 'error' not in r[fw], (family, fw, r[fw].get('error'))
      for phase in ('forward', 'grad'):
        assert r[fw][phase]['ms'] > 0, (family, fw, phase)
    assert r['jax']['attention'] == 'portable'  # no GPU here
    for phase in ('forward', 'grad'):  # XLA's own view of each program's memory
      assert r['jax'][phase]['xla_peak_gib'] > 0
    s = result['summary'][family]
    assert s['forward_speedup_vs_diffusers'] > 0 and s['grad_speedup_vs_diffusers'] > 0

  programs = result['programs']
  assert 'error' not in programs, programs.get('error')
  for name in ('rollout', 'grad', 'apply'):
    assert programs[name]['ms'] > 0 and programs[name]['xla_peak_gib'] > 0, name
  assert 'main_job' in result['summary']
