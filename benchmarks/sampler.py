"""Sampling throughput, ours vs diffusers, on one device.

Loads the same random weights into diffusers' QwenImageTransformer2DModel and into our MMDiT, checks that they agree
(one forward, the sigma schedule, and the whole 10-step Euler trajectory), then times 10-step sampling of a batch in
both frameworks in one process, alternating call by call (warm-up excluded, medians), next to a float32 matmul probe
in each framework (the roofline, measured in the same run under the same load).

    python benchmarks/sampler.py                      # bench-s, 7 timed rounds
    python benchmarks/sampler.py --repeats 11 --json /tmp/sampler.json

What is timed:
  ours: ``digen_jax.diffusion.sampler.sample`` (the rollout's one-scan T-step loop) with the trainer's velocity
        function (``digen_jax.programs.make_velocity_fn``, float32, the text mask passed as the trainer passes it),
        all steps Euler (``sde_steps`` all False, a compile-time constant), one jitted call -> final latents.
  ref:  QwenImagePipeline's denoising loop without text encoder / VAE: FlowMatchEulerDiscreteScheduler(shift=3,
        static), ``set_timesteps(sigmas=linspace(1, 1/T, T))``, transformer(timestep=t/1000, mask=None as the
        pipeline passes for an all-ones mask) then ``scheduler.step``, under ``torch.inference_mode()``.
Threads: torch.set_num_threads(2); XLA CPU uses one intra-op thread per core (2). See benchmarks/common.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402  (benchmarks/ is not a package)

PARITY_FORWARD_TOL = 1e-4  # one forward, max |diff| / max |ref|
PARITY_SAMPLE_TOL = (
    1e-3  # final latents after T Euler steps (rounding differences compound over steps)
)


def build(size: C.BenchSize, seed: int = 0):
  """Both models with the same weights, the inputs, and the two sampling callables."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from digen_jax.diffusion import sampler as sampler_lib
  from digen_jax.diffusion.sde import SDEConfig
  from digen_jax.programs import make_velocity_fn

  torch = C.setup_torch()
  tmodel = C.make_torch_model(size, seed)
  model = C.ours_from_torch(tmodel)
  graphdef, params = nnx.split(model)
  inp = C.make_inputs(size, seed + 1)
  sigmas = C.bench_sigmas(size)

  velocity_fn = make_velocity_fn(graphdef, size.img_shape, jnp.float32)
  sde_steps = np.zeros(
      size.steps, bool
  )  # all Euler: a constant, so the unused SDE branch is compiled away

  def sample_final(params, cond, x0, key):
    traj = sampler_lib.sample(
        velocity_fn,
        params,
        cond,
        sigmas,
        key,
        latent_shape=size.latent_shape,
        sde_cfg=SDEConfig(),
        sde_steps=sde_steps,
        initial_latents=x0,
    )
    return traj.final

  ours_fn = jax.jit(sample_final)
  cond = {"text": jnp.asarray(inp["text"]), "text_mask": jnp.asarray(inp["text_mask"])}
  x0 = jnp.asarray(inp["latents"])
  key = jax.random.key(0)
  ours_args = (params, cond, x0, key)

  t_x0 = torch.from_numpy(inp["latents"])
  t_text = torch.from_numpy(inp["text"])
  # QwenImagePipeline.encode_prompt drops an all-ones mask (prompt_embeds_mask = None).
  t_mask = None if inp["text_mask"].all() else torch.from_numpy(inp["text_mask"])

  def ref_sample():
    sched = C.torch_scheduler(size)
    latents = t_x0.clone()
    with torch.inference_mode():
      for t in sched.timesteps:
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        v = C.torch_forward(tmodel, latents, timestep / 1000, t_text, size, t_mask)
        latents = sched.step(v, t, latents, return_dict=False)[0]
    return latents

  return dict(
      torch=torch,
      tmodel=tmodel,
      model=model,
      params=params,
      inp=inp,
      sigmas=sigmas,
      velocity_fn=velocity_fn,
      ours_fn=ours_fn,
      ours_args=ours_args,
      ref_sample=ref_sample,
      cond=cond,
  )


def check_parity(size: C.BenchSize, b: dict) -> dict:
  """Forward, schedule and whole-trajectory agreement; raises AssertionError naming the failed check."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  torch = b["torch"]
  inp = b["inp"]
  sched = C.torch_scheduler(size)
  sig_err = float(np.max(np.abs(sched.sigmas.numpy().astype(np.float64) - b["sigmas"])))
  assert sig_err <= 1e-6, f"sigma schedules differ: max |ours - diffusers| = {sig_err:.2e}"

  sigma = np.full((size.batch,), float(b["sigmas"][1]), np.float32)
  ours_v = jax.jit(b["velocity_fn"])(
      b["params"], jnp.asarray(inp["latents"]), jnp.asarray(sigma), b["cond"]
  )
  with torch.inference_mode():
    ref_v = C.torch_forward(
        b["tmodel"],
        torch.from_numpy(inp["latents"]),
        torch.from_numpy(sigma),
        torch.from_numpy(inp["text"]),
        size,
    ).numpy()
  fwd_err = C.rel_err(ours_v, ref_v)
  assert fwd_err <= PARITY_FORWARD_TOL, f"forward differs from diffusers: rel err {fwd_err:.2e}"

  ours_x = np.asarray(b["ours_fn"](*b["ours_args"]))
  ref_x = b["ref_sample"]().numpy()
  sample_err = C.rel_err(ours_x, ref_x)
  assert (
      sample_err <= PARITY_SAMPLE_TOL
  ), f"{size.steps}-step samples differ from diffusers: rel err {sample_err:.2e}"
  return {
      "forward_rel_err": fwd_err,
      "sample_rel_err": sample_err,
      "sigma_max_abs_err": sig_err,
      "ok": True,
  }


def run(size: C.BenchSize, repeats: int, warmup: int = 1, compile_report: bool = True) -> dict:
  import jax
  from digen_jax.models.transformers.mmdit import flops_per_forward

  b = build(size)
  result = {"size": size.name, "machine": C.machine_info(), "repeats": repeats}

  # Compile first, cold (persistent cache off), so the figure is not hidden by a cache hit.
  compiled, lower_s, compile_s = C.compile_seconds(b["ours_fn"], *b["ours_args"])
  result["compile"] = {"lower_s": lower_s, "compile_cold_s": compile_s}
  if compile_report:
    result["compile"]["compile_warm_cache_s"] = C.warm_cache_compile_seconds(
        b["ours_fn"], *b["ours_args"]
    )

  result["parity"] = check_parity(size, b)
  print(f"  parity ok: {result['parity']}\n  compile: {result['compile']}", flush=True)

  flops_step = flops_per_forward(b["model"].config, size.batch, size.n_img, size.n_txt)
  reps = C.probe_reps(size.steps * flops_step)
  jax_mm, mm_flops = C.jax_matmul_probe(reps=reps)
  torch_mm, _ = C.torch_matmul_probe(reps=reps)
  ours_fn, args = b["ours_fn"], b["ours_args"]
  fns = {
      "ours": lambda: jax.block_until_ready(ours_fn(*args)),
      "ref": b["ref_sample"],
      "jax_matmul": jax_mm,
      "torch_matmul": torch_mm,
  }
  times = C.alternate(fns, repeats=repeats, warmup=warmup, progress=True)
  # Same shapes every call: the sampler must have compiled exactly once (the parity call included).
  n_compiled = ours_fn._cache_size()
  assert n_compiled == 1, f"sampler recompiled: {n_compiled} executables for one input signature"

  t_ours, t_ref = C.median(times["ours"]), C.median(times["ref"])
  ours_gflops = size.steps * flops_step / t_ours / 1e9
  ref_gflops = size.steps * flops_step / t_ref / 1e9
  jax_mm_gflops = mm_flops / C.median(times["jax_matmul"]) / 1e9
  torch_mm_gflops = mm_flops / C.median(times["torch_matmul"]) / 1e9
  result.update(
      {
          "ours_images_per_s": size.batch / t_ours,
          "ref_images_per_s": size.batch / t_ref,
          "ratio": t_ref / t_ours,
          # Conservative: the reference's best call against our median (torch's OpenMP fork/join suffers most when
          # the machine is shared; this is the ratio if it had never been disturbed).
          "ratio_ref_best": min(times["ref"]) / t_ours,
          "roofline_fraction": ours_gflops / jax_mm_gflops,
          "ref_roofline_fraction": ref_gflops / torch_mm_gflops,
          "flops_per_step": flops_step,
          "ours_gflops": ours_gflops,
          "ref_gflops": ref_gflops,
          "jax_matmul_gflops": jax_mm_gflops,
          "torch_matmul_gflops": torch_mm_gflops,
          "matmul_probe_n": C.ROOFLINE_N,
          "matmul_probe_reps": reps,
          "times_s": times,
          "executables_compiled": n_compiled,
      }
  )
  return result


def report(r: dict) -> str:
  t = r["times_s"]
  lines = [
      f"sampler benchmark, size={r['size']}, {r['repeats']} alternating rounds, load avg {r['machine']['load_avg_1m']:.2f}",
      f"  parity: forward rel err {r['parity']['forward_rel_err']:.2e}, "
      f"sample rel err {r['parity']['sample_rel_err']:.2e}, sigmas max err {r['parity']['sigma_max_abs_err']:.1e}",
      f"  ours  {C.spread(t['ours'])} per batch -> {r['ours_images_per_s']:.2f} images/s, "
      f"{r['ours_gflops']:.1f} GFLOP/s",
      f"  diffusers {C.spread(t['ref'])} per batch -> {r['ref_images_per_s']:.2f} images/s, "
      f"{r['ref_gflops']:.1f} GFLOP/s",
      f"  ratio ours/diffusers = {r['ratio']:.2f}x (medians); {r['ratio_ref_best']:.2f}x against diffusers' best "
      f"call",
      f"  analytic FLOPs per step {r['flops_per_step'] / 1e9:.3f} GFLOP",
      f"  matmul probe ({r['matmul_probe_reps']} chained {r['matmul_probe_n']}^3 f32 matmuls): jax {r['jax_matmul_gflops']:.1f} GFLOP/s "
      f"[{C.spread(t['jax_matmul'])}], torch {r['torch_matmul_gflops']:.1f} GFLOP/s",
      f"  roofline fraction: ours {r['roofline_fraction']:.3f} of the jax matmul; "
      f"diffusers {r['ref_roofline_fraction']:.3f} of the torch matmul",
      f"  compile (cold, cache off): lower {r['compile']['lower_s']:.2f}s + compile "
      f"{r['compile']['compile_cold_s']:.2f}s; warm persistent cache: "
      f"{r['compile'].get('compile_warm_cache_s')}",
  ]
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", default="bench-s", help=f"one of {sorted(C.SIZES)}")
  p.add_argument(
      "--repeats", type=int, default=7, help="timed alternating rounds (>= 5 for a reported figure)"
  )
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument(
      "--no-warm-cache", action="store_true", help="skip the persistent-cache compile measurement"
  )
  p.add_argument("--json", default=None, help="write the result here")
  a = p.parse_args(argv)
  if a.repeats < 1:
    raise ValueError(f"--repeats={a.repeats}: must be >= 1")
  r = run(C.get_size(a.size), a.repeats, a.warmup, compile_report=not a.no_warm_cache)
  print(report(r))
  C.write_json(a.json, r)
  return r


if __name__ == "__main__":
  main()
