"""digen_jax/perf: XLA's counts of the real programs (trip counts included) against the analytic
MMDiT / FLUX FLOP counts on toy sizes, per-device memory under FSDP, the accelerator table and
cluster specs, and the roofline time model."""

import json
import subprocess
import sys

import jax
import pytest

from configs import flux as flux_config
from configs import qwenimage
from digen_jax.models.transformers import mmdit
from digen_jax.parallel import mesh as mesh_lib
from digen_jax.perf import program_costs as costs
from digen_jax.perf import program_flops as flops
from digen_jax.perf import abstract
from digen_jax.perf import hardware
from digen_jax.perf import timing
from tests.helpers import xla_env
from tests.helpers.paths import REPO

# XLA counts elementwise ops (norms, softmax, RoPE, SDE step) besides the matmuls the analytic
# count holds, and CSEs the step-invariant text projection: a few percent either way at toy
# widths. Forgetting a trip count is off by a factor of T or L (>= 2 here).
ANALYTIC_RTOL = 0.06


def mesh_of(n):
  return mesh_lib.make_mesh(jax.devices()[:n])


def qwen_toy(*, cfg: bool = True, lora: int = 0, remat: bool = False):
  """configs/qwenimage.py:tiny, wider (matmuls dominate) and with true CFG / LoRA / remat."""
  c = qwenimage.get_config('tiny')
  c.model.num_attention_heads = 4  # D = 128
  c.model.attention_head_dim = 32
  c.sampler.guidance_scale = 4.0 if cfg else 0.0
  c.model.lora.rank = lora
  c.model.lora.alpha = float(2 * lora)
  c.model.remat = remat
  return c


def rel(a, b):
  return abs(a - b) / abs(b)


@pytest.mark.slow
def test_rollout_flops_count_every_step_and_layer():
  """Qwen-Image toy with CFG and LoRA: the extrapolated count equals the fully unrolled
  program's, agrees with the analytic count, and the raw (loop bodies once) figure does not."""
  config, mesh, batch = qwen_toy(cfg=True, lora=4), mesh_of(4), 8
  fitted, fit, _ = costs.fit_counts('rollout', config, mesh, batch, 'replicated', 'auto')
  unrolled, _ = costs.count_unrolled('rollout', config, mesh, batch, 'replicated', 'auto')
  assert rel(fitted[0], unrolled[0]) < 1e-3, (fitted, unrolled)
  assert rel(fitted[1], unrolled[1]) < 0.02, (fitted, unrolled)  # bytes: fusion may differ
  exp, _ = abstract.abstract_run(config)
  analytic = flops.analytic_flops('rollout', exp, mesh, batch)
  assert rel(fitted[0], analytic) < ANALYTIC_RTOL, (fitted[0], analytic)
  # Per step per layer: one block forward on B x 2 (CFG) rows, on each of 4 devices.
  block = (
      2
      * batch
      * 2
      * mmdit.block_macs(exp.model_config.inner_dim, exp.latent_shape[0] + config.text.max_length)
      / 4
  )
  assert rel(fit['c_num_layers'], block) < ANALYTIC_RTOL, (fit, block)


@pytest.mark.slow
def test_program_cost_grad_full_remat_and_raw_undercount():
  config, mesh = qwen_toy(cfg=True, remat=True), mesh_of(2)
  p = costs.program_cost('grad', config, mesh, batch=2)
  assert p.method == 'extrapolate' and p.trip_counts == {
      'num_layers': 2,
      'steps': 5,
      'cfg_branches': 2,
  }
  assert abs(p.xla_vs_analytic - 1) < ANALYTIC_RTOL, p
  # XLA's own figure for the scanned program counts one of the 2 layers (forward, recompute
  # and backward): far below the counted one.
  assert p.raw_flops < 0.75 * p.flops, p
  m = p.memory
  assert min(m.argument_bytes, m.output_bytes, m.temp_bytes) > 0
  assert m.alias_bytes > 0  # the gradient accumulator is donated
  assert p.compile_s > 0 and p.count_compile_s > 0 and p.bytes_accessed > 0


@pytest.mark.slow
def test_grad_lora_backward_counts():
  """LoRA's backward: data gradients (linear layers once, attention twice) plus the full weight
  gradient of each adapted kernel (the merged weight is what the forward reads). XLA's cost of
  one block per trained step agrees with that count, and not with adapter-only gradients nor
  with full fine-tuning's (every weight gradient)."""
  config, mesh, batch = qwen_toy(cfg=False, lora=4), mesh_of(2), 4
  fitted, fit, _ = costs.fit_counts('grad', config, mesh, batch, 'replicated', 'auto')
  exp, _ = abstract.abstract_run(config)
  rows, layers = batch // 2, config.model.num_layers  # per device, no CFG
  s, d = exp.latent_shape[0] + config.text.max_length, exp.model_config.inner_dim
  forward = 2 * rows * mmdit.block_macs(d, s)
  attention = 2 * rows * 2 * s * s * d
  weight_grads = flops.lora_weight_grad_flops(exp, rows) / layers
  data_grads = forward + attention  # linear once, attention twice
  per_block = fit['c_num_layers']
  assert rel(per_block, forward + data_grads + weight_grads) < ANALYTIC_RTOL, fit
  assert per_block > (1 + ANALYTIC_RTOL) * (forward + data_grads)
  assert per_block < 0.9 * 3 * forward
  # The whole program: within a looser bound (XLA hoists step-invariant work out of the K steps).
  assert rel(fitted[0], flops.analytic_flops('grad', exp, mesh, batch)) < 2 * ANALYTIC_RTOL


@pytest.mark.slow
def test_flux_rollout_counts_both_block_kinds():
  c = flux_config.get_config('tiny')
  c.model.num_attention_heads = 4
  c.model.attention_head_dim = 32
  c.model.axes_dims_rope = (8, 12, 12)
  mesh, batch = mesh_of(2), 4
  fitted, fit, _ = costs.fit_counts('rollout', c, mesh, batch, 'replicated', 'auto')
  exp, _ = abstract.abstract_run(c)
  assert set(fit) == {
      'a',
      'b',
      'c_num_layers',
      'c_num_single_layers',
      'd_num_layers',
      'd_num_single_layers',
  }
  assert rel(fitted[0], flops.analytic_flops('rollout', exp, mesh, batch)) < ANALYTIC_RTOL
  # A double-stream block costs more than a single-stream one (two streams' projections).
  assert fit['c_num_layers'] > fit['c_num_single_layers'] > 0


@pytest.mark.slow
def test_memory_per_device_falls_with_fsdp_devices():
  config = qwen_toy(cfg=False)
  per = {n: costs.program_cost('apply', config, mesh_of(n), batch=0) for n in (1, 2, 4)}
  for p in per.values():
    m = p.memory
    assert min(m.argument_bytes, m.output_bytes, m.alias_bytes) > 0 and m.total_bytes > 0
    assert p.method == 'exact' and p.flops > 0 and p.trip_counts == {}
  args = [per[n].memory.argument_bytes for n in (1, 2, 4)]
  assert args[0] > args[1] > args[2], args
  # FSDP splits params, gradient and both Adam moments: close to 1/n (small leaves replicate).
  assert args[2] < 0.4 * args[0], args
  assert per[4].flops < per[1].flops  # the update math is split too


def test_cli_prints_table_and_json(tmp_path):
  out = tmp_path / 'c.json'
  env = xla_env.env_with_devices(1)
  proc = subprocess.run(
      [
          sys.executable,
          '-m',
          'digen_jax.perf.costs',
          '--config=configs/qwenimage.py:tiny',
          '--devices=2',
          '--programs=apply',
          f'--json={out}',
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'apply' in proc.stdout and '2 devices' in proc.stdout
  data = json.loads(out.read_text())
  assert data['devices'] == 2 and data['programs']['apply']['memory']['total_bytes'] > 0
  assert data['command'].startswith('python -m digen_jax.perf.costs')


# ---------------------------------------------------------------------------------------------
# Accelerators and cluster specs.


def test_accelerator_table_has_sourced_figures():
  for name in ('H100 SXM', 'H200', 'H20', 'A100 80GB', 'L40S', 'RTX 4090', 'TPU v5e', 'TPU v5p'):
    acc = hardware.get(name)
    assert acc.peak_bf16_flops > 1e14 and acc.hbm_bw > 5e11 and acc.memory_bytes > 1e10
    assert len(acc.source) > 40
  assert hardware.get('h100').hbm_bw < hardware.get('H200').hbm_bw
  assert hardware.get('H20').peak_bf16_flops < hardware.get('A100').peak_bf16_flops


def test_parse_cluster():
  parts = hardware.parse_cluster('8xH100+8xH20')
  assert [(p.count, p.accelerator.name) for p in parts] == [(8, 'H100 SXM'), (8, 'H20')]
  assert hardware.parse_cluster(' 4 x tpu-v5p ')[0].accelerator.name == 'TPU v5p'
  assert hardware.parse_cluster('L40S')[0].count == 1


@pytest.mark.parametrize(
    'spec, names',
    [
        ('8xH100+4xH999', '4xH999'),
        ('8xH100++8xH20', 'empty part'),
        ('0xH100', '0xH100'),
        ('8H100', '8H100'),
        ('', 'empty'),
    ],
)
def test_parse_cluster_errors_name_the_part(spec, names):
  with pytest.raises(ValueError, match=names):
    hardware.parse_cluster(spec)


def test_register_and_load_json(tmp_path):
  entry = {
      'name': 'Toy9000',
      'peak_bf16_flops': 1e15,
      'hbm_bw': 1e12,
      'memory_bytes': 10**11,
      'intra_node_bw': 1e11,
      'inter_node_bw': 1e10,
      'host_bw': 1e10,
      'source': 'made up for a test',
      'aliases': ['t9k'],
  }
  path = tmp_path / 'accs.json'
  path.write_text(json.dumps([entry]))
  hardware.load_json(str(path), replace=True)
  assert hardware.parse_cluster('2xT9K')[0].accelerator.peak_bf16_flops == 1e15
  with pytest.raises(ValueError, match='taken'):
    hardware.register(hardware.Accelerator(**dict(entry, name='Other', aliases=('t9k',))))
  with pytest.raises(ValueError, match='hbm_bw'):
    hardware.Accelerator(**dict(entry, hbm_bw=0, aliases=()))


# ---------------------------------------------------------------------------------------------
# Time model.


def fake_program(name, flops, bytes_accessed, batch=16):
  return costs.ProgramCost(
      name=name,
      devices=8,
      batch=batch,
      flops=flops,
      bytes_accessed=bytes_accessed,
      transcendentals=0.0,
      analytic_flops=flops,
      memory=costs.Memory(1, 1, 0, 1),
      raw_flops=flops,
      raw_bytes_accessed=bytes_accessed,
      trip_counts={},
      method='raw',
      compile_s=0.0,
      count_compile_s=0.0,
  )


def test_roofline_is_monotone_and_bound_by_the_slower_side():
  h100, h20 = hardware.get('H100'), hardware.get('H20')
  eff = timing.Efficiency(mfu=0.5, hbm=1.0, link=1.0)
  t = lambda f, b, acc=h100, e=eff: timing.roofline_seconds(f, b, acc, e)
  assert t(1e15, 1e9) == pytest.approx(1e15 / (0.5 * h100.peak_bf16_flops))
  assert t(1e9, 1e12) == pytest.approx(1e12 / h100.hbm_bw)
  for f, b in ((1e14, 1e10), (1e15, 1e11), (1e16, 1e12)):
    assert t(2 * f, b) > t(f, b) and t(f, 1e3 * b) > t(f, b)
    assert t(f, b, h20) > t(f, b, h100)  # compute-bound: H20 is slower
    assert t(f, b, e=timing.Efficiency(mfu=0.25)) > t(f, b, e=timing.Efficiency(mfu=0.5))
  # Memory-bound work is faster on the H20 (4.0 vs 3.35 TB/s).
  assert t(1e9, 1e12, h20) < t(1e9, 1e12, h100)
  with pytest.raises(ValueError):
    timing.Efficiency(mfu=0)


def test_transfer_terms_are_monotone():
  h100 = hardware.get('H100')
  pub = lambda b, **kw: timing.publish_seconds(b, h100, **kw)
  assert pub(2e9) > pub(1e9) > 0
  assert pub(1e9, across_nodes=True) > pub(1e9, across_nodes=False)
  assert pub(1e9, layout='fsdp', rollout_devices=8) == pytest.approx(pub(1e9) / 8)
  fsdp = lambda n, **kw: timing.fsdp_seconds(4e10, 1e9, n, h100, **kw)
  assert fsdp(1) == 0
  assert 0 < fsdp(2) < fsdp(4) < fsdp(8) < fsdp(16)  # (n-1)/n grows, then the NIC takes over
  assert fsdp(16) > 5 * fsdp(8)
  sw = lambda **kw: timing.switch_seconds(4e10, 3e9, 8, h100, **kw)
  assert sw()['offload'] == 0 and sw(offload_optimizer=True)['offload'] > 0
  assert sw(layout='fsdp')['total'] < sw()['total']


def test_step_breakdown():
  c = costs.Costs(
      config='fake',
      devices=8,
      settings={'rollout_layout': 'replicated'},
      trainable_bytes=10**9,
      optimizer_state_bytes=2 * 10**9,
      frozen_base_bytes=4 * 10**10,
      published_bytes=10**9,
      rollout_param_bytes=41 * 10**9,
      gathered_bytes=41 * 10**9,
      programs={
          'rollout': fake_program('rollout', 4e15, 1e12, batch=128),
          'grad': fake_program('grad', 1e15, 1e11, batch=16),
          'apply': fake_program('apply', 1e9, 1e10),
      },
  )
  h100 = hardware.get('H100')
  co = timing.step_breakdown(c, h100, mode='colocated')
  dis = timing.step_breakdown(c, h100, mode='disagg')
  assert co['grad'] == pytest.approx(8 * timing.program_seconds(c.programs['grad'], h100))
  assert 'switch' in co and 'publish' in dis and co['rollout'] == dis['rollout']
  assert co['total'] == pytest.approx(sum(v for k, v in co.items() if k != 'total'))
  slower = timing.step_breakdown(c, hardware.get('H20'), mode='colocated')
  assert slower['total'] > co['total']
  del c.programs['apply']
  with pytest.raises(ValueError, match='apply'):
    timing.step_breakdown(c, h100)
