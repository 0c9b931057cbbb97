"""GRPO update throughput, ours vs a plain PyTorch implementation on the diffusers model, on one device.

One update = the GRPO policy loss over the K = T-1 selected timesteps ('all_but_last') of a batch of stored
trajectories, its gradient, and one AdamW step. Both frameworks start from the same weights and the same stored
trajectories (sampled once with our SDE sampler); the loss values, the recomputed log-probs and the gradients are
checked to agree before anything is timed. Then both updates are timed in one process, alternating call by call
(warm-up excluded, medians). Peak memory of each is measured in a child process per framework (one process's
high-water mark cannot be split between two frameworks).

    python benchmarks/train_step.py                                   # bench-s, default variant, 5 rounds
    python benchmarks/train_step.py --variants all --json /tmp/t.json # + remat / step-loop trade-off table

ours: ``digen_jax.rl.objective.grpo_objective`` with the trainer's velocity function
      (``digen_jax.programs.make_velocity_fn``), jax.value_and_grad, optax.adamw; one jitted program, params and
      optimizer state donated, compiled once. Variants (VARIANTS below): the K steps as one K*B batch ('vmap'), one
      after another under autodiff ('scan'), or one value_and_grad per step with gradients summed ('accum':
      grpo_objective's ``denominator`` makes each step's loss its share of the full loss); each with or without
      per-block rematerialisation (MMDiTConfig.remat) and layers scanned or unrolled (MMDiTConfig.scan_layers).
      The default, 'scan+remat', is what the trainer runs on a one-device mesh (rl.step_loop='auto', model.remat).
ref:  what a Flow-GRPO user writes: for each selected timestep, transformer forward (diffusers, eager, autograd),
      Flow-GRPO's SDE log-prob, the PPO-clip loss / K, ``loss.backward()`` (gradients accumulate over timesteps),
      then ``AdamW.step()``.
The behaviour log-probs are shifted by a fixed random offset (|offset| <= 0.3) before training so that the
importance ratios are not 1 and the loss, with its clipping, depends on the recomputed log-probs (at ratio 1 the
loss value is -mean(A) whatever the model computes, and the value check would prove nothing).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402  (benchmarks/ is not a package)

CLIP_RANGE = 0.2
NOISE_LEVEL = 0.7
LR, BETAS, EPS, WEIGHT_DECAY = 1e-5, (0.9, 0.999), 1e-8, 1e-4
LOSS_TOL = 1e-4  # relative
GRAD_TOL = 1e-3  # relative (max |diff| / max |ref| per checked tensor; global norm)
# Our update's execution options (same math): how the K selected steps run (grpo_objective's step_loop: 'vmap' = one
# K*B batch, 'scan' = one step after another; 'accum' = one value_and_grad per step inside a lax.scan, gradients
# summed, as the torch loop does), "+remat" = MMDiTConfig.remat (recompute each block in the backward
# pass), "+unroll" = MMDiTConfig.scan_layers=False (layers as straight-line code instead of a lax.scan).
VARIANTS = {  # name -> (step_loop, remat, scan_layers)
    f"{loop}{'+unroll' if unroll else ''}{'+remat' if remat else ''}": (loop, remat, not unroll)
    for loop in ("vmap", "scan", "accum")
    for unroll in (False, True)
    for remat in (False, True)
}
DEFAULT_VARIANT = "scan+remat"  # what the trainer runs on one device (rl.step_loop auto + model.remat); fastest measured (RESULTS.md)


def make_problem(size: C.BenchSize, seed: int = 0) -> dict:
  """Weights (diffusers model), stored trajectories from our SDE sampler, advantages, behaviour log-probs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from digen_jax.diffusion import sampler as sampler_lib
  from digen_jax.diffusion.sde import SDEConfig
  from digen_jax.programs import make_velocity_fn
  from digen_jax.rl import timesteps as ts

  tmodel = C.make_torch_model(size, seed)
  model = C.ours_from_torch(tmodel)
  graphdef, params = nnx.split(model)
  inp = C.make_inputs(size, seed + 1)
  sigmas = C.bench_sigmas(size)
  sde_cfg = SDEConfig(kind="flow_grpo", noise_level=NOISE_LEVEL, logprob_reduce="mean")
  sel = ts.TimestepSelection(kind="all_but_last")
  sde_steps = ts.sde_step_mask(sel, size.steps, 0)
  indices = ts.select_timesteps(sel, size.steps, jax.random.key(1), 0)
  cond = {"text": jnp.asarray(inp["text"]), "text_mask": jnp.asarray(inp["text_mask"])}
  velocity_fn = make_velocity_fn(graphdef, size.img_shape, jnp.float32)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(2), i))(jnp.arange(size.batch))
  traj = jax.jit(
      lambda p, c, k: sampler_lib.sample(
          velocity_fn,
          p,
          c,
          sigmas,
          k,
          latent_shape=size.latent_shape,
          sde_cfg=sde_cfg,
          sde_steps=sde_steps,
      )
  )(params, cond, keys)
  rng = np.random.default_rng(seed + 3)
  offset = rng.uniform(-0.3, 0.3, size=traj.log_probs.shape).astype(np.float32)
  offset[~np.asarray(traj.sde_steps)] = 0.0  # deterministic steps keep log-prob 0
  traj = traj.replace(log_probs=traj.log_probs + jnp.asarray(offset))
  adv = np.clip(rng.standard_normal(size.batch).astype(np.float32), -5, 5)
  return dict(
      tmodel=tmodel,
      graphdef=graphdef,
      params=params,
      inp=inp,
      sigmas=sigmas,
      sde_cfg=sde_cfg,
      indices=np.asarray(indices),
      traj=traj,
      cond=cond,
      adv=adv,
      config=model.config,
  )


# ----------------------------------------------------------------------------------------------------------------
# Ours.


def make_ours(prob: dict, size: C.BenchSize, step_loop: str, remat: bool, scan_layers: bool):
  """(jitted update, initial (params, opt_state), static args, grad_fn for the parity check)."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from digen_jax.programs import make_velocity_fn
  from digen_jax.rl.objective import grpo_objective

  graphdef = prob["graphdef"]
  if (remat, scan_layers) != (prob["config"].remat, prob["config"].scan_layers):
    # Same params, another graphdef: the config is static module metadata.
    model = nnx.merge(graphdef, prob["params"])
    model.config = dataclasses.replace(model.config, remat=remat, scan_layers=scan_layers)
    graphdef, _ = nnx.split(model)
  velocity_fn = make_velocity_fn(graphdef, size.img_shape, jnp.float32)
  optimizer = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)

  def loss_fn(params, traj, cond, adv, valid, indices, denominator=None):
    return grpo_objective(
        velocity_fn,
        params,
        traj,
        cond,
        adv,
        valid,
        indices,
        sde_cfg=prob["sde_cfg"],
        clip_range=CLIP_RANGE,
        step_loop="vmap" if step_loop == "accum" else step_loop,
        denominator=denominator,
    )

  def loss_and_grads(params, traj, cond, adv, valid, indices):
    if step_loop != "accum":
      (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, traj, cond, adv, valid, indices
      )
      return loss, grads
    # Gradient accumulation over timesteps (what the torch loop does): each selected step's loss is its pairs'
    # share of the full loss (same denominator: the total weight), its backward pass runs inside the step,
    # so no step keeps residuals for another. The sum of the steps' losses and gradients is the full ones.
    den = jnp.sum(
        valid.astype(jnp.float32)[None, :] * traj.sde_steps[indices].astype(jnp.float32)[:, None]
    )

    def one(carry, idx):
      g_acc, l_acc = carry
      (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(
          params, traj, cond, adv, valid, idx[None], den
      )
      return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss), _ = jax.lax.scan(one, (zeros, jnp.zeros((), jnp.float32)), indices)
    return loss, grads

  def update(params, opt_state, traj, cond, adv, valid, indices):
    loss, grads = loss_and_grads(params, traj, cond, adv, valid, indices)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.array, prob["params"])  # own copy: the update donates it
  state = (params, optimizer.init(params))
  args = (
      prob["traj"],
      prob["cond"],
      jnp.asarray(prob["adv"]),
      jnp.ones((size.batch,), bool),
      jnp.asarray(prob["indices"], jnp.int32),
  )
  grad_fn = jax.jit(loss_and_grads)
  return jax.jit(update, donate_argnums=(0, 1)), state, args, grad_fn


# ----------------------------------------------------------------------------------------------------------------
# Reference: plain PyTorch, as in Flow-GRPO's training loop.


def make_ref(prob: dict, size: C.BenchSize):
  """(update() -> loss float, loss_and_grads() for the parity check). Trains prob['tmodel'] in place."""
  import numpy as np

  torch = C.setup_torch()
  model = prob["tmodel"]
  model.train()
  opt = torch.optim.AdamW(
      model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
  )
  traj = prob["traj"]
  latents = torch.from_numpy(np.array(traj.latents))
  logp_old = torch.from_numpy(np.array(traj.log_probs))
  sigmas = torch.from_numpy(np.array(traj.sigmas))
  text = torch.from_numpy(prob["inp"]["text"])
  adv = torch.from_numpy(prob["adv"])
  indices = [int(i) for i in prob["indices"]]
  k = len(indices)
  a = NOISE_LEVEL
  sigma_max = sigmas[1]

  def sde_log_prob(x_next, x, v, sigma, sigma_next):
    # Flow-GRPO sde_step_with_logprob (noise_level a, sigma_max = sigmas[1]), log-prob averaged over latent dims.
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * a
    mean = (
        x * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_dev_t * torch.sqrt(-dt)
    logp = (
        -((x_next.detach() - mean) ** 2) / (2 * std**2)
        - torch.log(std)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return logp.mean(dim=tuple(range(1, logp.ndim)))

  def accumulate():
    """Forward + backward per timestep, gradients accumulated; returns (loss, logp_new [K, B])."""
    total, logps = 0.0, []
    for j, t in enumerate(indices):
      x, x_next = latents[t], latents[t + 1]
      sigma = sigmas[t]
      v = model(
          hidden_states=x,
          timestep=sigma.expand(size.batch),
          encoder_hidden_states=text,
          encoder_hidden_states_mask=None,
          img_shapes=[[size.img_shape]] * size.batch,
          return_dict=False,
      )[0]
      logp = sde_log_prob(x_next, x, v, sigma, sigmas[t + 1])
      ratio = torch.exp(logp - logp_old[t])
      unclipped = -adv * ratio
      clipped = -adv * torch.clamp(ratio, 1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE)
      loss = torch.maximum(unclipped, clipped).mean() / k
      loss.backward()
      total += loss.item()
      logps.append(logp.detach())
    return total, torch.stack(logps)

  def update():
    opt.zero_grad(set_to_none=True)
    loss, _ = accumulate()
    opt.step()
    return loss

  def loss_and_grads():
    opt.zero_grad(set_to_none=True)
    loss, logps = accumulate()
    # The last block's text-stream output feeds nothing (only image tokens reach the head): torch leaves those
    # grads None, ours computes zeros.
    grads = {
        n: (
            p.grad.detach().clone().numpy()
            if p.grad is not None
            else np.zeros(tuple(p.shape), np.float32)
        )
        for n, p in model.named_parameters()
    }
    opt.zero_grad(set_to_none=True)
    return loss, logps.numpy(), grads

  return update, loss_and_grads


# ----------------------------------------------------------------------------------------------------------------


def check_parity(prob: dict, size: C.BenchSize, grad_fn, args, params, ref_loss_and_grads) -> dict:
  """Loss value, recomputed log-probs and gradients of ours vs the PyTorch reference, same weights and data."""
  import jax
  import numpy as np
  from digen_jax.rl.objective import step_log_probs

  loss, grads = grad_fn(params, *args)
  ref_loss, ref_logp, ref_grads = ref_loss_and_grads()
  loss = float(loss)
  loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
  assert (
      loss_err <= LOSS_TOL
  ), f"loss differs: ours {loss:.8g}, torch {ref_loss:.8g} (rel {loss_err:.2e})"
  traj, cond = args[0], args[1]
  velocity_fn_logp = jax.jit(
      lambda p: step_log_probs(
          _velocity_fn(prob, size), p, traj, cond, args[4], sde_cfg=prob["sde_cfg"]
      )[0]
  )
  logp = np.asarray(velocity_fn_logp(params))
  logp_err = float(np.max(np.abs(logp - ref_logp)))
  assert logp_err <= 1e-4, f"recomputed log-probs differ: max |ours - torch| = {logp_err:.2e}"
  # Gradients: global norm (layout-free) and three tensors that exercise different paths: layer 0's Q
  # projection (RMSNorm + RoPE, whose head dims our model reorders internally), the last MLP, the output head.
  flat = [np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)]
  norm = float(np.sqrt(sum(float(f @ f) for f in flat)))
  ref_norm = float(
      np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in ref_grads.values()))
  )
  checks = {"grad_norm_rel_err": abs(norm - ref_norm) / ref_norm}
  last = size.model["num_layers"] - 1
  pairs = {
      "attn.to_q[0]": (
          grads["blocks"]["attn"]["to_q"]["kernel"][0],
          ref_grads["transformer_blocks.0.attn.to_q.weight"].T,
      ),
      f"img_mlp.fc2[{last}]": (
          grads["blocks"]["img_mlp"]["fc2"]["kernel"][last],
          ref_grads[f"transformer_blocks.{last}.img_mlp.net.2.weight"].T,
      ),
      "proj_out": (grads["proj_out"]["kernel"], ref_grads["proj_out.weight"].T),
  }
  for name, (ours_g, ref_g) in pairs.items():
    checks[f"grad_rel_err[{name}]"] = C.rel_err(np.asarray(ours_g), ref_g)
  bad = {k: v for k, v in checks.items() if not v <= GRAD_TOL}
  assert not bad, f"gradients differ from torch autograd: {bad}"
  return {
      "loss_ours": loss,
      "loss_ref": ref_loss,
      "loss_rel_err": loss_err,
      "logp_max_abs_err": logp_err,
      **checks,
      "ok": True,
  }


def _velocity_fn(prob, size):
  import jax.numpy as jnp
  from digen_jax.programs import make_velocity_fn

  return make_velocity_fn(prob["graphdef"], size.img_shape, jnp.float32)


def run(
    size: C.BenchSize,
    repeats: int,
    variants: list[str],
    warmup: int = 1,
    memory: bool = True,
    compile_report: bool = True,
) -> dict:
  import jax

  C.setup_torch()  # thread count before any torch work
  prob = make_problem(size)
  k = len(prob["indices"])
  result = {
      "size": size.name,
      "machine": C.machine_info(),
      "repeats": repeats,
      "K": k,
      "batch": size.batch,
      "variants": {},
  }

  ours = {}
  for name in variants:
    step_loop, remat, scan_layers = VARIANTS[name]
    update, state, args, grad_fn = make_ours(prob, size, step_loop, remat, scan_layers)
    compiled, lower_s, compile_s = C.compile_seconds(update, *state, *args)
    info = {
        "step_loop": step_loop,
        "remat": remat,
        "scan_layers": scan_layers,
        "lower_s": lower_s,
        "compile_cold_s": compile_s,
    }
    mem = compiled.memory_analysis()
    if mem is not None:
      info["xla_temp_mib"] = mem.temp_size_in_bytes / 2**20
      info["xla_argument_mib"] = mem.argument_size_in_bytes / 2**20
    if compile_report and name == variants[0]:
      info["compile_warm_cache_s"] = C.warm_cache_compile_seconds(update, *state, *args)
    ours[name] = dict(update=update, state=[state], args=args, grad_fn=grad_fn)
    result["variants"][name] = info

  ref_update, ref_loss_and_grads = make_ref(prob, size)
  head = variants[0]
  result["parity"] = check_parity(
      prob, size, ours[head]["grad_fn"], ours[head]["args"], prob["params"], ref_loss_and_grads
  )
  print(f"  parity ok: {result['parity']}\n  compile: {result['variants']}", flush=True)

  def ours_call(o):
    def call():
      params, opt_state = o["state"][0]
      params, opt_state, loss = o["update"](params, opt_state, *o["args"])
      jax.block_until_ready(loss)
      o["state"][0] = (params, opt_state)  # the old buffers were donated

    return call

  fns = {f"ours[{n}]": ours_call(o) for n, o in ours.items()}
  fns["ref"] = ref_update
  times = C.alternate(fns, repeats=repeats, warmup=warmup, progress=True)
  for n, o in ours.items():
    n_compiled = o["update"]._cache_size()
    assert (
        n_compiled == 1
    ), f"update {n} recompiled: {n_compiled} executables for one input signature"

  pairs = size.batch * k
  t_ref = C.median(times["ref"])
  for n in variants:
    t = C.median(times[f"ours[{n}]"])
    result["variants"][n].update({"samples_timesteps_per_s": pairs / t, "ratio": t_ref / t})
  result.update(
      {
          "ours_variant": head,
          "ours_samples_timesteps_per_s": result["variants"][head]["samples_timesteps_per_s"],
          "ref_samples_timesteps_per_s": pairs / t_ref,
          "ratio": result["variants"][head]["ratio"],
          # Conservative: torch's best call against our median (see sampler.py).
          "ratio_ref_best": min(times["ref"]) / C.median(times[f"ours[{head}]"]),
          "times_s": times,
      }
  )

  if memory:
    script = os.path.abspath(__file__)
    result["memory"] = {"ref": C.run_child(script, ["--size", size.name, "--_memory", "ref"])}
    for n in variants:
      result["memory"][f"ours[{n}]"] = C.run_child(script, ["--size", size.name, "--_memory", n])
  return result


def memory_probe(size: C.BenchSize, which: str) -> dict:
  """Child process: build one framework's update, run it once to warm up, then measure the next update's peak RSS."""
  import jax

  prob = make_problem(size)
  if which == "ref":
    update, _ = make_ref(prob, size)
    update()
    return C.measure_peak_rss(update)
  upd, state, args, _ = make_ours(prob, size, *VARIANTS[which])
  del prob  # the problem's own param copy is not part of the update's working set
  holder = [state]

  def call():
    params, opt_state, loss = upd(*holder[0], *args)
    jax.block_until_ready(loss)
    holder[0] = (params, opt_state)

  call()
  return C.measure_peak_rss(call)


def report(r: dict) -> str:
  t = r["times_s"]
  p = r["parity"]
  lines = [
      f"GRPO update benchmark, size={r['size']}, B={r['batch']} x K={r['K']} timesteps, {r['repeats']} alternating "
      f"rounds, load avg {r['machine']['load_avg_1m']:.2f}",
      f"  parity: loss ours {p['loss_ours']:.6g} vs torch {p['loss_ref']:.6g} (rel {p['loss_rel_err']:.1e}); "
      f"log-probs max abs err {p['logp_max_abs_err']:.1e}; grad norm rel err {p['grad_norm_rel_err']:.1e}; "
      + ", ".join(
          f"{k[len('grad_rel_err'):]} {v:.1e}"
          for k, v in p.items()
          if k.startswith("grad_rel_err[")
      ),
      f"  torch (Flow-GRPO style, autograd): {C.spread(t['ref'])} -> {r['ref_samples_timesteps_per_s']:.2f} "
      f"samples*timesteps/s",
  ]
  for n, v in r["variants"].items():
    mem = r.get("memory", {}).get(f"ours[{n}]")
    lines.append(
        f"  ours[{n}]: {C.spread(t[f'ours[{n}]'])} -> {v['samples_timesteps_per_s']:.2f} samples*timesteps/s, "
        f"ratio {v['ratio']:.2f}x; compile cold {v['lower_s']:.2f}+{v['compile_cold_s']:.2f}s"
        + (
            f", warm cache {v['compile_warm_cache_s']:.2f}s"
            if v.get("compile_warm_cache_s")
            else ""
        )
        + (f"; XLA temp {v['xla_temp_mib']:.0f} MiB" if "xla_temp_mib" in v else "")
        + (f"; step peak +{mem['step_extra_mib']:.0f} MiB RSS" if mem else "")
    )
  if "memory" in r:
    m = r["memory"]["ref"]
    lines.append(
        f"  torch step peak +{m['step_extra_mib']:.0f} MiB RSS over {m['live_mib']:.0f} MiB live"
    )
    for n in r["variants"]:
      m = r["memory"][f"ours[{n}]"]
      lines.append(
          f"  ours[{n}] step peak +{m['step_extra_mib']:.0f} MiB RSS over {m['live_mib']:.0f} MiB live"
      )
  lines.append(
      f"  headline ratio (ours[{r['ours_variant']}] / torch) = {r['ratio']:.2f}x (medians); "
      f"{r['ratio_ref_best']:.2f}x against torch's best call"
  )
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", default="bench-s", help=f"one of {sorted(C.SIZES)}")
  p.add_argument(
      "--repeats", type=int, default=5, help="timed alternating rounds (>= 5 for a reported figure)"
  )
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument(
      "--variants",
      default=DEFAULT_VARIANT,
      help=f"comma-separated ours variants from {list(VARIANTS)}, or 'all'; the first is the headline",
  )
  p.add_argument(
      "--no-memory", action="store_true", help="skip the child-process peak-memory probes"
  )
  p.add_argument(
      "--no-warm-cache", action="store_true", help="skip the persistent-cache compile measurement"
  )
  p.add_argument("--json", default=None, help="write the result here")
  p.add_argument(
      "--_memory", default=None, help=argparse.SUPPRESS
  )  # internal: child-process memory probe
  a = p.parse_args(argv)
  size = C.get_size(a.size)
  if a._memory:
    import json

    print(json.dumps(memory_probe(size, a._memory)))
    return None
  variants = (
      list(VARIANTS)
      if a.variants == "all"
      else [v.strip() for v in a.variants.split(",") if v.strip()]
  )
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    raise ValueError(f"--variants: unknown {unknown}; use names from {list(VARIANTS)} or 'all'")
  if a.repeats < 1:
    raise ValueError(f"--repeats={a.repeats}: must be >= 1")
  r = run(
      size,
      a.repeats,
      variants,
      a.warmup,
      memory=not a.no_memory,
      compile_report=not a.no_warm_cache,
  )
  print(report(r))
  C.write_json(a.json, r)
  return r


if __name__ == "__main__":
  main()
