"""Smoke tests of benchmarks/sampler.py and benchmarks/train_step.py at a tiny size, and of the model's execution
options that the benchmarks rely on being numerically neutral."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from digen_jax.models.transformers import mmdit
from digen_jax.models.transformers import rope
from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import common as C  # noqa: E402

import torch  # noqa: E402,F401  (a missing test dependency must fail, not skip)
import diffusers  # noqa: E402,F401
from tests.helpers import xla_env  # noqa: E402


def _run(script: str, args: list[str], tmp_path) -> dict:
  out = tmp_path / (os.path.basename(script) + ".json")
  env = xla_env.env_with_devices(None)  # the benchmarks are single-device; no fake CPU devices
  proc = subprocess.run(
      [
          sys.executable,
          os.path.join(REPO, "benchmarks", script),
          "--size",
          "tiny",
          "--json",
          str(out),
          *args,
      ],
      capture_output=True,
      text=True,
      timeout=900,
      env=env,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_sampler_benchmark_tiny(tmp_path):
  r = _run("sampler.py", ["--repeats", "1"], tmp_path)
  for key in ("ours_images_per_s", "ref_images_per_s", "ratio", "roofline_fraction"):
    assert isinstance(r[key], float) and np.isfinite(r[key]) and r[key] > 0, key
  assert (
      r["parity"]["ok"]
      and r["parity"]["forward_rel_err"] <= 1e-4
      and r["parity"]["sample_rel_err"] <= 1e-3
  )
  assert r["ratio"] == pytest.approx(r["ours_images_per_s"] / r["ref_images_per_s"])
  assert r["executables_compiled"] == 1
  assert r["compile"]["compile_cold_s"] > 0


@pytest.mark.slow
def test_train_step_benchmark_tiny(tmp_path):
  r = _run("train_step.py", ["--repeats", "1", "--variants", "accum", "--no-warm-cache"], tmp_path)
  assert isinstance(r["ratio"], float) and np.isfinite(r["ratio"]) and r["ratio"] > 0
  p = r["parity"]
  assert (
      p["ok"]
      and p["loss_rel_err"] <= 1e-4
      and p["logp_max_abs_err"] <= 1e-4
      and p["grad_norm_rel_err"] <= 1e-3
  )
  # The offset behaviour log-probs make the ratios differ from 1, so the loss is not just -mean(A).
  assert abs(p["loss_ours"] - p["loss_ref"]) <= 1e-4 * abs(p["loss_ref"])
  assert set(r["variants"]) == {"accum"} and r["ours_variant"] == "accum"
  for name in ("ref", "ours[accum]"):
    assert r["memory"][name]["peak_mib"] >= r["memory"][name]["live_mib"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Execution options of MMDiT used for speed: same math.


def _tiny_model():
  tiny = C.get_size("tiny")
  size = dataclasses.replace(
      tiny, model={**tiny.model, "num_layers": 3}
  )  # several layers: scan vs unrolled
  model = C.ours_from_torch(C.make_torch_model(size))
  inp = C.make_inputs(size)
  inp["text_mask"][1, 5:] = 0  # a padded row exercises the key bias
  args = (
      jnp.asarray(inp["latents"]),
      jnp.asarray([0.3, 0.9], jnp.float32),
      jnp.asarray(inp["text"]),
      jnp.asarray(inp["text_mask"]),
  )
  return size, model, args


def test_rope_half_split_equals_interleaved():
  rng = np.random.default_rng(0)
  heads, hd = 3, 16
  x = jnp.asarray(rng.standard_normal((2, 5, heads, hd), dtype=np.float32))
  ang = rng.uniform(-3, 3, (5, hd // 2)).astype(np.float32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  ref = rope.apply_rope(x, cos, sin)
  flat = x.reshape(2, 5, heads * hd)
  half = rope.to_half_split(flat, hd).reshape(x.shape)
  out = rope.apply_rope_half(half, *rope.half_split_tables(cos, sin))
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(rope.to_half_split(ref.reshape(2, 5, -1), hd)).reshape(x.shape)
  )


@pytest.mark.slow
def test_unrolled_layers_do_not_change_outputs_or_grads():
  options = dict(scan_layers=False)
  size, model, args = _tiny_model()
  graphdef, params = nnx.split(model)
  other = nnx.merge(graphdef, params)
  other.config = dataclasses.replace(other.config, **options)
  graphdef2, _ = nnx.split(other)

  def loss(g, p):
    out = nnx.merge(g, p)(*args, img_shape=size.img_shape)
    return jnp.sum(out * jnp.cos(out)), out

  (l1, o1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(graphdef, p), has_aux=True))(params)
  (l2, o2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(graphdef2, p), has_aux=True))(params)
  assert C.rel_err(o2, o1) <= 1e-5
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    assert C.rel_err(a, b) <= 1e-4


def test_execution_option_validation():
  with pytest.raises(ValueError, match="scan_layers"):
    mmdit.MMDiTConfig(scan_layers="no")
