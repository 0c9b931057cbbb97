"""2-D time-step parallelism (parallel/tsp_grid.py, programs/tsp.py): the (t, b) layout rule,
its config checks, and the TSP fragment gradient and update against the colocated update of the
same batch on one device, on 4 devices here and on 8 in a child process."""

import json
import subprocess
import sys

import jax
import pytest

from configs import qwenimage
from digen_jax.experiment import config as configlib
from digen_jax.parallel import tsp_grid
from digen_jax.runtime import cluster as cluster_lib
from digen_jax.experiment import run as run_lib
from tests.helpers import xla_env
from tests.mp_scripts import launcher_util as util
from tests.mp_scripts import fragment_exactness as exactness

# ------------------------------------------------------------------------------ the rule


def _best(K, n, samples):
  """The rule spelled out: least per-device work over divisors t <= K, ties to the larger t."""
  work = {}
  for t in range(1, n + 1):
    if n % t == 0 and t <= K:
      work[t] = -(-K // t) * (-(-samples // (n // t)))
  least = min(work.values())
  return max(t for t, w in work.items() if w == least)


def test_layout_pads_k_by_less_than_one_round_and_minimises_work():
  for n in (1, 2, 3, 4, 6, 8, 12, 16):
    for K in range(1, 17):
      for samples in range(1, 21):
        lay = tsp_grid.choose(K, n, samples)
        assert lay.t * lay.b == n and n % lay.t == 0
        assert lay.K_pad % lay.t == 0 and 0 <= lay.K_pad - lay.K < lay.t <= K, lay
        assert lay.rows % lay.b == 0 and 0 <= lay.rows - samples < lay.b, lay
        assert lay.work == (lay.K_pad // lay.t) * (lay.rows // lay.b)
        assert lay.t == _best(K, n, samples), (K, n, samples, lay)


@pytest.mark.parametrize(
    'K, n, samples, t, expected',
    [
        # (K, K_pad, t, b): K = 5 on 8 devices was padded to 8 steps by the 1-D layout.
        (5, 8, 4, 0, (5, 6, 2, 4)),
        (5, 8, 2, 0, (5, 8, 4, 2)),
        (5, 8, 16, 0, (5, 5, 1, 8)),
        (3, 8, 4, 0, (3, 4, 2, 4)),
        (3, 8, 8, 0, (3, 3, 1, 8)),
        (5, 8, 4, 8, (5, 8, 8, 1)),  # forced: the 1-D layout
        (3, 8, 6, 2, (3, 4, 2, 4)),
        (1, 8, 1, 0, (1, 1, 1, 8)),
    ],
)
def test_layout_examples(K, n, samples, t, expected):
  lay = tsp_grid.choose(K, n, samples, t)
  assert (lay.K, lay.K_pad, lay.t, lay.b) == expected


def _tiny(**overrides):
  return configlib.apply_overrides(qwenimage.get_config('tiny'), overrides)


@pytest.mark.parametrize(
    'overrides, devices, message',
    [
        (
            {'schedule.tsp': True, 'schedule.tsp_steps_axis': 3},
            4,
            r'config.schedule.tsp_steps_axis=3 must be 0 \(auto\) or a divisor of the 4 trainer '
            r'devices \(1, 2, 4\)',
        ),
        ({'schedule.tsp_steps_axis': 2}, 4, 'set --config.schedule.tsp=True, or leave it 0'),
        ({'schedule.tsp': True, 'schedule.tsp_steps_axis': -1}, 4, r'must be an int >= 0'),
    ],
)
def test_bad_steps_axis_fails_naming_the_field(overrides, devices, message):
  with pytest.raises(ValueError, match=message):
    configlib.validate(_tiny(**overrides), devices)


def test_disagg_checks_the_steps_axis_against_the_trainer_role():
  c = _tiny(**{'runtime.mode': 'disagg', 'schedule.tsp': True, 'schedule.tsp_steps_axis': 4})
  configlib.validate(c, 4)  # 4 devices in all; the trainer has 2 of them
  with pytest.raises(ValueError, match='divisor of the 2 trainer devices'):
    cluster_lib.resolve(run_lib.cluster_spec(c), jax.devices()[:4])
  cluster_lib.resolve(
      run_lib.cluster_spec(_tiny(**{'runtime.mode': 'disagg', 'schedule.tsp': True})),
      jax.devices()[:4],
  )


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize(
    'case, layout',
    [
        # B = 2 on 4 devices: the steps over 2, the two samples over 2.
        ({'K': 5, 'B': 2}, (6, 2, 2)),
        # B = 6 on 4 devices (padded to 8 rows), t = 2: both layouts do 6 sample-steps a device.
        ({'K': 3, 'B': 6}, (4, 2, 2)),
    ],
)
@pytest.mark.slow
def test_tsp_grid_update_equals_colocated_on_4_devices(case, layout, tmp_path):
  r = exactness.run_case(dict(case, workdir=str(tmp_path)), jax.devices()[:4])
  assert (r['layout']['K_pad'], r['layout']['t'], r['layout']['b']) == layout
  exactness.check(r)


CASES_8 = [
    # (case, (K_pad, t, b)): K = 3 and 5 on 8 devices, batches divisible by b but not by 8 ...
    ({'K': 5, 'B': 4}, (6, 2, 4)),
    ({'K': 3, 'B': 4}, (4, 2, 4)),
    ({'K': 5, 'B': 2}, (8, 4, 2)),
    # ... one that b does not divide (6 samples over 4: 2 weight-0 rows), the 1-D layout of
    # before (t = n, K padded to 8) and a batch that fills the mesh (t = 1: no padded step).
    ({'K': 3, 'B': 6, 't': 2}, (4, 2, 4)),
    ({'K': 5, 'B': 8, 't': 8}, (8, 8, 1)),
    ({'K': 5, 'B': 16}, (5, 1, 8)),
]


@pytest.mark.slow
def test_tsp_grid_update_equals_colocated_on_8_devices(tmp_path):
  cases = [dict(c, workdir=str(tmp_path)) for c, _ in CASES_8]
  out = subprocess.run(
      [sys.executable, '-m', 'tests.mp_scripts.fragment_exactness', '8', json.dumps(cases)],
      cwd=util.REPO,
      env=xla_env.env_with_devices(8),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  results = [
      json.loads(l[len('RESULT ') :]) for l in out.stdout.splitlines() if l.startswith('RESULT ')
  ]
  assert len(results) == len(CASES_8)
  for r, (_, layout) in zip(results, CASES_8):
    assert r['n'] == 8
    assert (r['layout']['K_pad'], r['layout']['t'], r['layout']['b']) == layout, r
    exactness.check(r)
