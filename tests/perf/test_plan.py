"""python -m digen_jax.plan: the CLI on a toy config and on a cached real one, bad input as one
line, the split search, heterogeneous role assignment, and the prediction's response to costs.
Nothing here compiles a real-size program: the costs come from digen_jax/perf/costs_data/."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs import qwenimage
from digen_jax.perf import analytic
from digen_jax.perf import cache
from digen_jax.perf import cached_run
from digen_jax.parallel import tsp_grid
from digen_jax.perf import hardware
from digen_jax.perf import planner as planning
from digen_jax.perf import run_models
from digen_jax.perf import roles
from digen_jax.perf import runmodel as rm
from digen_jax.perf import search
from tests.helpers import xla_env
from tests.helpers.paths import REPO


def run_plan(*args, timeout=300):
  env = xla_env.env_with_devices(1)
  return subprocess.run(
      [sys.executable, '-m', 'digen_jax.plan', *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


@pytest.fixture(scope='module')
def qwen():
  """Qwen-Image-20B LoRA from the committed costs cache (XLA's figures of the real programs)."""
  config = qwenimage.get_config('')
  entries = cache.matching('configs/qwenimage.py', cache.config_digest(config), 'lora', 64)
  assert entries, 'digen_jax/perf/costs_data/ has no Qwen-Image LoRA entry'
  return cached_run.from_cache('configs/qwenimage.py', config, entries)


def plan(run, spec, **kw):
  settings = planning.Settings(**{'steps': 4, 'simulate_top': 4, **kw.pop('settings', {})})
  parts, fixed = planning.validate(spec, kw.pop('trainer', None), settings)
  return planning.plan(run, parts, settings, trainer=fixed, cluster=spec)


# ---------------------------------------------------------------------------------------------
# The command line.


def test_cli_end_to_end_on_the_toy_config(tmp_path):
  proc = run_plan(
      '--config=configs/shapes.py:pixel',
      '--cluster=4xH100',
      f'--out={tmp_path}',
      '--timelines=best',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  doc = json.loads((tmp_path / 'plan.json').read_text())
  for key in search.MODES:  # the ladder's keys, every one predicted
    assert key in doc['modes'] and doc['modes'][key]['samples_per_s'] > 0, key
  assert doc['modes']['colocated']['x_colocated'] == pytest.approx(1.0)
  assert doc['best'] in doc['modes'] and doc['best_split']
  assert (tmp_path / 'timeline.png').stat().st_size > 1000
  trace = json.loads((tmp_path / 'trace.json').read_text())
  assert trace['traceEvents']
  assert 'samples/s' in proc.stdout and 'memory per device' in proc.stdout


def test_cli_on_the_cached_real_config():
  """The real Qwen-Image-20B config plans from the committed cache in seconds (no compile)."""
  proc = run_plan('--config=configs/qwenimage.py', '--cluster=8xH100+8xH20')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'computing costs' not in proc.stderr
  assert 'qwenimage_lora64_remat-on_d16' in proc.stdout
  assert 'trainer 8xH100 SXM | rollout 8xH20' in proc.stdout


def test_cli_on_the_cached_video_config():
  """Wan2.1-T2V-14B (configs/wan21.py: 81 frames at 832x480, 32,760 tokens a sample) plans from
  the committed costs of its compiled programs (no compile). No mode holds one video's
  gradient unsplit (XLA:CPU's memory analysis: 1,259 GB a device), so the planner tries the
  sequence splits the heads and devices allow, smallest first, and keeps the first under which
  a mode fits: 8 (a split's memory from the programs compiled at it). A split the config fixes
  is planned alone: 4 does not fit, in one line."""
  proc = run_plan('--config=configs/wan21.py', '--cluster=16xH100')
  assert 'computing costs' not in proc.stderr
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '32760 image tokens' in proc.stdout and 'samples/s' in proc.stdout
  assert 'config.parallel.sequence=8: each sample' in proc.stdout
  assert 'tried 1, 2, 4, 8)' in proc.stdout
  assert 'scan over K, 1 sample per 8 devices/call, config.parallel.sequence=8' in proc.stdout
  proc = run_plan('--config=configs/wan21.py', '--cluster=16xH100', '--config.parallel.sequence=4')
  assert 'computing costs' not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
  assert 'does not fit 16xH100: the trainer needs' in lines[0]
  assert 'config.parallel.sequence=4' in lines[0]
  proc = run_plan('--config=configs/wan21.py', '--cluster=16xH100', '--costs=analytic')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'samples/s' in proc.stdout and '32760 image' in proc.stdout


def test_a_config_built_on_another_plans_outside_the_checkout(tmp_path):
  """configs/verl_omni_ocr.py builds on configs/qwenimage.py (configlib.sibling_config): it loads
  by its path from any working directory, not only the checkout's root."""
  path = os.path.join(REPO, 'configs', 'verl_omni_ocr.py')
  env = xla_env.env_with_devices(1)
  env.pop('PYTHONPATH', None)
  proc = subprocess.run(
      [sys.executable, '-m', 'digen_jax.plan', f'--config={path}:lora', '--cluster=4xH800',
       '--costs=analytic'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'samples/s' in proc.stdout


@pytest.fixture(scope='module')
def wan():
  """Wan2.1-14B LoRA with its cached sequence splits (planner.run_model: the cache only)."""
  from configs import wan21  # pylint: disable=g-import-not-at-top

  config = wan21.get_config('')
  return run_models.run_model('configs/wan21.py', config, [], planning.Settings())


def test_a_split_takes_its_memory_from_its_compile_and_its_flops_from_split_1(wan):
  """At config.parallel.sequence = 8 on 8 H100s the trainer's options read XLA's temp memory of
  the programs compiled at that split (one video over the 8 devices, the K steps as a vmap and
  as a scan), FLOPs of split 1 over 8, and pay all-to-alls that split 2 halves' share."""
  assert sorted(wan.split_memory) == [2, 4, 8]
  group = roles.Group(hardware.parse_cluster('8xH100'))
  knobs = rm.Knobs()
  at8 = dataclasses.replace(wan, sequence=8)
  options = {
      (o.detail['loop'], o.detail['chunk']): o
      for o in rm.grad_options(at8, group, 1, knobs, tsp=False)
  }
  compiled = {}
  for e in cache.entries():
    s = e.costs.settings
    if e.key.config == 'configs/wan21.py' and s.get('sequence_split') == 8:
      if s['fragment_samples'] == 1:
        compiled[e.key.step_loop or 'vmap'] = e.costs.programs['grad'].memory.temp_bytes
  assert set(compiled) == {'vmap', 'scan'}
  for loop in ('vmap', 'scan'):
    assert options[(loop, 1)].memory['temp'] == pytest.approx(compiled[loop], rel=1e-9), loop
  assert options[('scan', 1)].fits and not options[('vmap', 1)].fits  # 80 GB H100s
  # FLOPs: one video's K steps over 8 devices = split 1's per-device FLOPs of 1/8 video.
  prog = wan.grads[True]
  assert options[('vmap', 1)].detail['compute_s'] > 0
  per_device = prog.flops(8, wan.K / 8, 1)
  one = dataclasses.replace(wan, sequence=1)
  whole = prog.flops(8, wan.K, 8)
  assert per_device == pytest.approx(whole / 8, rel=0.05)
  # All-to-alls: none unsplit; (q - 1) / q of a device's slice at split q.
  assert one.all_to_all_seconds(3, 1.0, group, knobs) == 0
  a8 = at8.all_to_all_seconds(3, 1.0, group, knobs)
  a2 = dataclasses.replace(wan, sequence=2).all_to_all_seconds(3, 1.0, group, knobs)
  assert a8 / a2 == pytest.approx((7 / 8) / (1 / 2))


def test_a_scan_over_k_takes_the_memory_of_its_compile(qwen):
  """The gradient with the K steps as a scan keeps residuals of every step: its options read
  XLA's temp memory of the scan compiled at one and two images a device (the committed
  *_grad_scan.json), which is more than one step of the vmapped program's model."""
  assert set(qwen.scans) == {True}
  group = roles.Group(hardware.parse_cluster('16xH100'))
  options = {
      (o.detail['loop'], o.detail['chunk']): o
      for o in rm.grad_options(qwen, group, 32, rm.Knobs(), tsp=False)
  }
  compiled = {}
  for e in cache.entries():
    if e.key.config == 'configs/qwenimage.py' and e.key.finetune == 'lora' and e.key.step_loop:
      compiled[e.key.fragment_batch // e.key.devices] = e.costs.programs['grad'].memory.temp_bytes
  assert sorted(compiled) == [1, 2]
  for c in (1, 2):
    assert options[('scan', c)].memory['temp'] == pytest.approx(compiled[c], rel=1e-9)
    assert compiled[c] > qwen.grads[True].temp(c)  # more than one step's


def test_a_split_the_plan_cannot_model_is_one_clear_error(qwen, wan):
  """A config's config.parallel.sequence that the heads or devices refuse, that the cache has no
  compile of (and nothing may compile it), or under analytic costs: a PlanError naming the
  field and the fix, before any search."""
  settings = planning.Settings(steps=4, simulate_top=4)
  parts = hardware.parse_cluster('16xH100')
  cases = [
      (qwen, 5, "must divide the 16 devices of the cluster and the model's 24 heads"),
      (qwen, 8, 'holds no programs compiled at that split'),
      (analytic.run_model(analytic.HUNYUAN_VIDEO), 8, '--costs=analytic does not model'),
  ]
  for run, q, words in cases:
    with pytest.raises(planning.PlanError, match='config.parallel.sequence') as e:
      planning.plan(run, parts, settings, cluster='16xH100', sequence=q)
    assert words in str(e.value), str(e.value)
  # The cached split is planned alone when the config sets it.
  p = planning.plan(wan, parts, settings, cluster='16xH100', sequence=8)
  assert p['sequence'] == 8 and 'the config' in ' '.join(p['notes'])


@pytest.mark.parametrize(
    'args,words',
    [
        (['--cluster=8xB300'], 'unknown accelerator'),
        (['--cluster=8xH100+'], 'empty part'),
        (['--cluster=16xH100', '--trainer=16'], 'leaves the rollout 0'),
    ],
)
def test_cli_bad_input_is_one_line(args, words):
  proc = run_plan('--config=configs/shapes.py:pixel', *args)
  assert proc.returncode != 0
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('digen_jax.plan: '), proc.stderr[-2000:]
  assert words in lines[0]


@pytest.mark.parametrize(
    'cluster,trainer,words',
    [
        ('8xH100', '0', 'leaves the trainer 0 devices'),
        ('8xH100', '9', 'asks for 9xH100 SXM but the cluster 8xH100 has 8'),
        ('8xH100+8xH20', '8', 'ambiguous on the mixed cluster'),
        ('8xH100+8xH20', '4xA100', 'asks for 4xA100 80GB but the cluster'),
        ('0xH100', None, 'needs at least 1'),
        ('8 H100', None, 'is not COUNTxKIND'),
    ],
)
def test_bad_input_errors_name_the_fix(cluster, trainer, words):
  with pytest.raises(planning.PlanError) as e:
    planning.validate(cluster, trainer, planning.Settings())
  assert words in str(e.value) and '\n' not in str(e.value)


def test_bad_settings():
  for settings, words in (
      (planning.Settings(mfu=1.5), 'mfu'),
      (planning.Settings(steps=1), 'need >= 2'),
      (planning.Settings(memory_fraction=0), 'memory_fraction'),
  ):
    with pytest.raises(planning.PlanError, match=words):
      planning.validate('8xH100', None, settings)


def test_a_model_that_fits_nowhere_says_what_would_fit(qwen):
  hardware.register(
      hardware.Accelerator(
          'Tiny8',
          peak_bf16_flops=1e14,
          hbm_bw=1e12,
          memory_bytes=8 * 10**9,
          intra_node_bw=1e11,
          inter_node_bw=1e10,
          host_bw=1e10,
          source='test',
      ),
      replace=True,
  )
  with pytest.raises(planning.PlanError) as e:
    plan(qwen, '4xTiny8')
  msg = str(e.value)
  assert 'does not fit 4xTiny8' in msg and 'GiB' in msg and '\n' not in msg
  assert 'would fit' in msg or 'needs an accelerator with' in msg


def test_pretraining_config_is_refused():
  from configs import shapes_pretrain  # pylint: disable=g-import-not-at-top

  with pytest.raises(planning.PlanError, match='pretraining config'):
    run_models.run_model(
        'configs/shapes_pretrain.py', shapes_pretrain.get_config(), [], planning.Settings()
    )


# ---------------------------------------------------------------------------------------------
# The search.


def test_split_search_returns_the_best_split_it_tried(qwen):
  p = search.Planner(qwen, hardware.parse_cluster('16xH100'), steps=4, simulate_top=3)
  found = p.search()
  for mode, tried in found['tried'].items():
    best = found['modes'][mode]
    assert best is not None and tried
    assert best.samples_per_s == max(c.samples_per_s for c in tried), mode
  # Simulating every candidate of one mode finds nothing better than the search's pick by
  # more than the bound's blind spot allows.
  everything = [
      c
      for s in search.splits(p.parts)
      for m in (2, 4, 8)
      if (c := p.disagg('gap', s, m)) is not None
  ]
  top = max(p.simulate(c).samples_per_s for c in everything)
  assert found['modes']['gap'].samples_per_s >= 0.95 * top


def test_heterogeneous_cluster_assigns_roles(qwen):
  """8 H100 + 8 H20: the runnable split that trains on the H100s (FLOP-heavy gradients) and
  samples on the H20s wins; a mixed role runs at its slowest kind."""
  p = plan(qwen, '8xH100+8xH20')
  m = p['modes']['gap_tag']
  assert m['trainer'] == '8xH100 SXM' and m['rollout'] == '8xH20', m['split']
  # Without TAG the trainer keeps H100s only and the H20s roll out (some H100s may join them).
  m = p['modes']['gap']
  assert 'H20' not in m['trainer'] and '8xH20' in m['rollout'], m['split']
  g = roles.Group(hardware.parse_cluster('4xH100+4xH20'))
  h20 = roles.Group(hardware.parse_cluster('8xH20'))
  k = rm.Knobs()
  assert k.seconds(g, qwen.rollout, 1e15, 0) == k.seconds(h20, qwen.rollout, 1e15, 0)


def test_slower_rollout_accelerator_lowers_samples_per_s(qwen):
  fast = plan(qwen, '16xH100', trainer='8xH100')
  slow = plan(qwen, '8xH100+8xH20', trainer='8xH100')
  for mode in ('disagg', 'gap', 'gap_tag'):
    assert slow['modes'][mode]['samples_per_s'] < fast['modes'][mode]['samples_per_s'], mode


def test_tag_helps_when_the_rollout_is_the_bottleneck(qwen):
  p = plan(qwen, '8xH100+8xH20', trainer='8xH100')  # H20s sample ~7x slower
  gap, tag = p['modes']['gap'], p['modes']['gap_tag']
  assert tag['samples_per_s'] > 1.3 * gap['samples_per_s']
  assert tag['bts_inserts'] > 0
  # Trainer-bound (the trainer on the slow kind): BTS declines, TAG changes little.
  q = plan(qwen, '8xH100+8xH20', trainer='8xH20')
  assert q['modes']['gap_tag']['samples_per_s'] < 1.1 * q['modes']['gap']['samples_per_s']


def test_memory_report_per_role(qwen):
  p = plan(qwen, '16xH100')
  for mode in ('colocated', 'gap'):
    for what in ('rollout_option', 'grad_option'):
      o = p['modes'][mode][what]
      assert o['fits'] and 0 < o['memory_gib']['total'] <= 0.9 * 80e9 / 2**30
  # Full fine-tuning's FSDP state is larger per device than LoRA's.
  full = qwenimage.get_config('full')
  entries = cache.matching('configs/qwenimage.py', cache.config_digest(full), 'full', 0)
  run_full = cached_run.from_cache('full', full, entries)
  assert run_full.trainer_persistent(8) > 5 * qwen.trainer_persistent(8)


# ---------------------------------------------------------------------------------------------
# The cost model.


def test_program_model_reproduces_xla_and_scales(qwen):
  """At the compile's own devices and batch the model returns XLA's figures; the per-sample
  work halves with twice the devices; the temp fit passes through both memory points."""
  entry = next(
      e
      for e in cache.matching(
          'configs/qwenimage.py', cache.config_digest(qwenimage.get_config('')), 'lora', 64
      )
      if e.key.method == 'extrapolate' and e.key.remat and 'rollout' in e.key.programs
  )
  xla = entry.costs.programs
  r = qwen.rollout
  assert r.flops(16, 8, 128) == pytest.approx(xla['rollout'].flops, rel=1e-9)
  assert r.temp(8, accelerator=False) == pytest.approx(xla['rollout'].memory.temp_bytes, rel=1e-6)
  g = qwen.grads[True]
  assert g.flops(16, 5, 16) == pytest.approx(xla['grad'].flops, rel=1e-9)
  assert r.flops(32, 4, 128) < r.flops(16, 8, 128)
  per_unit = r.flops(16, 8, 128) - r.flops(16, 4, 128)
  assert per_unit == pytest.approx(4 * r.per_unit)
  assert 'affine' in r.temp_fit and 'affine' in g.temp_fit
  # XLA:CPU's f32 copy of the bf16 base dominates the rollout's temp; an accelerator has none.
  assert r.temp(2) < 0.1 * r.temp(2, accelerator=False)


def test_tsp_costs_the_2d_grid(qwen):
  """TSP lays K steps x the fragment's samples over a (t, b) grid (parallel/tsp_grid.py): 4
  samples with K = 5 on 8 devices run on t = 2 (K padded to 6) x b = 4, 3 sample-steps per
  device, against the plain gradient's 5 with half the devices idle (4 samples, 8 devices)."""
  g8 = roles.Group(hardware.parse_cluster('8xH100'))
  knobs = rm.Knobs()
  plain = rm.best(rm.grad_options(qwen, g8, 4, knobs, tsp=False))
  tsp = rm.best(rm.grad_options(qwen, g8, 4, knobs, tsp=True))
  assert qwen.K == 5 and tsp_grid.choose(5, 8, 4).work == 3
  assert tsp.detail['compute_s'] == pytest.approx(plain.detail['compute_s'] * 3 / 5, rel=0.03)


def test_cache_key_and_roundtrip(tmp_path):
  config = qwenimage.get_config('full')
  # ':full' and '--full' reach the same programs: one digest.
  flag = qwenimage.get_config('')
  flag.model.lora.rank = 0
  assert cache.config_digest(config) == cache.config_digest(flag)
  flag.sampler.num_steps = 12
  assert cache.config_digest(config) != cache.config_digest(flag)
  e = cache.matching('configs/qwenimage.py', cache.config_digest(config), 'full', 0)[0]
  doc = json.load(open(e.path))
  back = cache.costs_from_json(doc)
  assert back.programs.keys() == e.costs.programs.keys()
  assert back.to_json()['programs'] == doc['programs']
  path = cache.save(doc, e.key, e.digest, str(tmp_path))
  assert os.path.basename(path) == e.key.filename() and cache.load(path).key == e.key


def test_analytic_video_families():
  """HunyuanVideo from its published sizes; Wan2.1 from configs/wan21.py (its model code's one
  FLOP count, models/wan.flops_per_forward)."""
  from configs import wan21

  h = analytic.HUNYUAN_VIDEO
  assert 12e9 < h.params() < 13.5e9 and h.tokens == 33 * 34 * 60  # published 13B
  run = analytic.run_model(h)
  assert run.source == 'analytic' and run.K == 9 and run.batch == 32
  p = plan(run, '8xH100+8xH20', trainer='8xH100')
  assert p['modes']['gap_tag']['samples_per_s'] > p['modes']['disagg']['samples_per_s']
  assert any('analytic' in n for n in p['notes'])
  wan = analytic.run_model_of(wan21.get_config('full'), 'configs/wan21.py:full')
  assert wan.image_tokens == 21 * 30 * 52 and wan.K == 11 and wan.batch == 32
  assert '14.29B params' in wan.notes[0]  # the released 14B


def test_scaled_batch_keeps_the_model(qwen):
  twice = dataclasses.replace(qwen, prompts=2 * qwen.prompts)
  assert twice.batch == 2 * qwen.batch and twice.rollout is qwen.rollout


def test_committed_costs_match_the_configs_they_were_computed_for():
  """A config change that reaches the digest without reaching the programs (a new field) would
  make every plan recompile the 20B programs: each committed entry must match its config."""
  import importlib.util

  from digen_jax.perf import cache as cache_lib

  entries = cache_lib.entries()
  assert entries, 'digen_jax/perf/costs_data/ holds no cached costs'
  for e in entries:
    if e.key.overrides:
      continue
    spec = importlib.util.spec_from_file_location('cfg', os.path.join(cache_lib.REPO, e.key.config))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config(e.key.variant or None)
    assert cache_lib.config_digest(config) == e.digest, (e.path, e.key)


def test_trained_step_windows_are_planned_as_asked(qwen):
  """--trained_steps: each K planned (a K-step window costs K/K0 of the gradient); a K outside
  1..T-1 is refused naming the flag."""
  k2, k1 = run_models.trained_step_variants(qwen, ['2', '1'])
  assert (k2.K, k1.K) == (2, 1) and run_models.trained_step_variants(qwen, []) == [qwen]
  g = roles.Group(hardware.parse_cluster('8xH100'))
  full, two = (rm.best(rm.grad_options(r, g, 16, rm.Knobs(), tsp=False)) for r in (qwen, k2))
  assert two.detail['compute_s'] == pytest.approx(full.detail['compute_s'] * 2 / 5, rel=0.02)
  for bad in ('0', str(qwen.T), 'two'):
    with pytest.raises(planning.PlanError, match='--trained_steps'):
      run_models.trained_step_variants(qwen, [bad])


def test_overlapped_fsdp_exposes_only_the_first_layer(qwen):
  g = roles.Group(hardware.parse_cluster('16xH100'))
  on = rm.best(rm.grad_options(qwen, g, 16, rm.Knobs(overlap=True), tsp=False))
  off = rm.best(rm.grad_options(qwen, g, 16, rm.Knobs(overlap=False), tsp=False))
  assert on.seconds < off.seconds
  assert on.detail['fsdp_s'] < off.detail['fsdp_s'] / qwen.layers * 1.01


def test_frozen_base_gathered_once_per_step(qwen):
  """config.schedule.frozen_once_per_step as the planner costs it: a fragment gradient gathers
  only the adapters (the FSDP base once per step, charged to the step, a whole base beside the
  shard in memory); the planner takes it for fragments when it is faster, never for the fused
  update or colocated (which gather once per step already)."""
  g = roles.Group(hardware.parse_cluster('16xH100+16xH100'))
  knobs = rm.Knobs(overlap=False)
  per_call = rm.best(rm.grad_options(qwen, g, 16, knobs, tsp=False))
  once = rm.best(rm.grad_options(qwen, g, 16, knobs, tsp=False, frozen_once=True))
  assert not per_call.detail['frozen_once'] and per_call.detail['step_gather_s'] == 0
  assert once.detail['frozen_once'] and once.detail['fsdp_s'] < per_call.detail['fsdp_s']
  base = qwen.frozen_base_bytes * (1 - 1 / g.n)
  gather = g.gather_seconds(qwen.frozen_base_bytes, knobs.devices_per_node, knobs.eff)
  assert once.detail['step_gather_s'] == pytest.approx(gather) and gather > 0
  assert once.memory['state'] == pytest.approx(per_call.memory['state'] + base)
  planner = search.Planner(qwen, hardware.parse_cluster('16xH100+16xH100'), knobs=knobs)
  chosen = planner.grad(g, 16, False)
  assert chosen.seconds == min(per_call.seconds, once.seconds)
  assert not planner.grad(g, 16, False, per_step=False).detail['frozen_once']
