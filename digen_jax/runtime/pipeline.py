"""DigenRL's pipelined schedule (DESIGN.md §3): GAP, TSP, TAG with BTS, TCSS.

The logical batch of a step is cut into M fragments (runtime/fragments.py). The rollout claims
fragments one at a time, samples and scores each with the published policy and streams it to
the trainer. The trainer computes advantages as soon as a fragment's prompt groups are
complete and accumulates its gradient (programs.make_fragment_grad; TSP shards the timestep
axis over the trainer mesh); after the last fragment it makes exactly one optimizer step
(programs.make_apply) and one weight publish. The update equals the full-batch update to float
rounding: every sample's noise key folds in its batch position, the loss denominator is the
whole batch's pair weight, applied once at the end.

TAG: when the trainer has no trainable fragment, BTS (runtime/bts.py) predicts whether the
step ends sooner if the trainer samples an unclaimed fragment itself (the rollout program
compiled for the trainer mesh, with the trainer's current weights, which are the published
ones: no optimizer step happens inside a batch); claims are atomic (a lock in one process, a
create-only key in the jax.distributed key-value store across processes), so a fragment is
sampled once. The helper only adds scored fragments; it never touches the accumulated gradient
or the optimizer state.

TCSS (opt-in, schedule.tcss_fraction = phi > 0): after its share of a batch, while the next
policy is not published yet, the rollout may start up to floor(phi * M) fragments of the next
batch with the current (soon previous) policy; they carry that version (staleness 1), their
behaviour log-probs are the ones the ratio uses, and metrics show the staleness mix.

Roles run concurrently: in one process the rollout is a thread and both roles' devices are
local (a LocalLink: device_put between meshes); across two processes (launch/local.py) a
ChannelLink moves weights and fragments over transfer.Channel. Every device's busy spans go to
a trace.Tracer (trace.json, timeline.png, per-step utilization).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import threading
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import checkpoint as ckpt_lib
from digen_jax import metrics as metrics_lib
from digen_jax import programs
from digen_jax.rl import advantages as adv_lib
from digen_jax.runtime import bts as bts_lib
from digen_jax.runtime import distributed
from digen_jax.runtime import fragments as frag_lib
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import publish
from digen_jax.runtime import trace as trace_lib
from digen_jax.runtime import transfer
from digen_jax.runtime import workers

_KV = 'digen/pipe'
PEER_TIMEOUT_S = 3600.0
FRAG_TAG = 'frag'


def enabled(config) -> bool:
  """Whether config.schedule asks for the pipelined schedule (else the synchronous loops)."""
  s = config.schedule
  return s.fragments > 1 or s.tag or s.tsp or s.tcss_fraction > 0


def plan_of(config) -> frag_lib.FragmentPlan:
  return frag_lib.FragmentPlan(config.rl.prompts_per_step, config.rl.group_size,
                               config.schedule.fragments, config.schedule.fragment_unit)


# ------------------------------------------------------------------------------ sampling


@dataclasses.dataclass
class Fragment:
  """A scored fragment. traj: Trajectory of plan.size samples (on the holder's mesh)."""
  step: int
  index: int
  version: int
  traj: Any
  rewards: np.ndarray          # [size] float32
  producer: str                # 'rollout' | 'trainer' (TAG)
  sample_s: float = 0.0        # device span of sampling + decode
  reward_s: float = 0.0
  images: Any = None
  t_start: float = 0.0         # wall clock (time.time()) of the span's start and end
  t_end: float = 0.0
  arrived: float = 0.0         # wall clock at which the trainer held it (rollout fragments)
  eval_s: float = 0.0          # the producer's eval before this step's first fragment


class FragmentSampler:
  """Samples and scores fragments on `mesh` with params laid out as `param_shardings`: the
  rollout's copy on the rollout mesh, or the trainer's FSDP params on the trainer mesh (TAG)."""

  def __init__(self, exp, mesh, param_shardings, plan: frag_lib.FragmentPlan, role: str,
               tracer: trace_lib.Tracer, guard_level: str, param_dtype=None, *,
               frozen_fsdp: bool = True):
    self.exp, self.mesh, self.plan, self.role, self.tracer = exp, mesh, plan, role, tracer
    self.guard_level = guard_level
    self.traj_shardings = workers.trajectory_shardings(mesh)
    rep = mesh_lib.replicated(mesh)
    self._rep = rep
    # Compiled ahead of time: a first TAG insertion must not pay (and BTS must not profile)
    # the compilation, and the timeline then shows run time only.
    c, n = exp.config, plan.size
    sds = jax.ShapeDtypeStruct
    data = lambda nd: mesh_lib.batch_sharding(mesh, nd)
    cond = exp.cond_abstract(n, data)
    scalar = lambda dt: sds((), dt, sharding=rep)
    # Frozen weights on this mesh (TAG: the trainer's own FSDP copy, shared through the cache).
    frozen = exp.weights.frozen(mesh, fsdp=frozen_fsdp, decode=True)
    self._program = programs.make_rollout(
        exp, mesh, param_shardings, self.traj_shardings, with_offset=True, frozen=frozen).lower(
            transfer.abstract(exp.params, param_shardings, param_dtype), cond, cond,
            scalar(jax.random.key(0).dtype), scalar(jnp.int32), scalar(jnp.int32)).compile()
    self._base_key = jax.device_put(jax.random.key(exp.config.seed), rep)
    self._uncond = workers.uncond(exp, plan.size, mesh)
    self._devices = list(mesh.devices.flat)

  def sample(self, params, version: int, batch_prompts: list[str], step: int,
             f: int) -> Fragment:
    """Fragment f of step `step`'s batch (batch_prompts: one per sample) with `params`."""
    prompts = self.plan.prompts(f, batch_prompts)
    cond = workers.encode(self.exp, prompts, self.mesh)
    program = 'rollout' if self.role == 'rollout' else 'tag_rollout'
    with workers.guard(self.guard_level):
      step_arr = jax.device_put(np.int32(step), self._rep)
      offset = jax.device_put(np.int32(f * self.plan.size), self._rep)
      t0 = time.time()
      with self.tracer.span(self._devices, self.role, program, step=step, fragment=f,
                            version=version):
        k_rollout, _ = workers._step_keys(self._base_key, step_arr)  # pylint: disable=protected-access
        uncond = self._uncond if self._uncond is not None else cond
        traj, images = self._program(params, cond, uncond, k_rollout, step_arr, offset)
        images = jax.device_get(images)
      t1 = time.time()
    rewards = np.asarray(self.exp.reward_fn(images, prompts), np.float32)
    return Fragment(step, f, version, traj, rewards, self.role, t1 - t0, time.time() - t1,
                    images, t_start=t0, t_end=t1)


def abstract_fragment(exp, plan, shardings) -> Any:
  """ShapeDtypeStructs of one fragment's Trajectory on `shardings` (what the trainer process
  receives): the batch abstract with the sample axis cut to plan.size."""
  ab = workers.abstract_batch(exp)['traj']
  cut = lambda x, ax: jax.ShapeDtypeStruct(
      x.shape[:ax] + (plan.size,) + x.shape[ax + 1:], x.dtype)
  ab = ab._replace(latents=cut(ab.latents, 1), log_probs=cut(ab.log_probs, 1),
                   stds=cut(ab.stds, 1)) if hasattr(ab, '_replace') else dataclasses.replace(
                       ab, latents=cut(ab.latents, 1), log_probs=cut(ab.log_probs, 1),
                       stds=cut(ab.stds, 1))
  return workers.with_shardings(ab, shardings)


# ------------------------------------------------------------------------------ links


class _Stop(Exception):
  pass


class LocalLink:
  """Both roles in one process (the rollout is a thread): weights and fragments move by
  jax.device_put onto the other role's mesh; claims under a lock."""

  def __init__(self, cluster, trainer_traj_shardings, rollout_param_shardings, dtype):
    self._cv = threading.Condition()
    self._policies: dict[int, publish.Policy] = {}
    self._frags: queue.Queue = queue.Queue()
    self._claims: dict[tuple[int, int], dict] = {}
    self._kv: dict[str, Any] = {}
    self.error: BaseException | None = None
    self._traj_sh = trainer_traj_shardings
    self._param_sh, self._dtype = rollout_param_shardings, dtype
    # Colocated roles share devices: a publish onto the same sharding would alias the
    # trainer's buffers, which the optimizer step donates; copy instead.
    self._copy = bool(set(cluster.trainer.devices) & set(cluster.rollout.devices))

  def _wait(self, pred, what: str):
    with self._cv:
      while not pred():
        if self.error is not None:
          raise _Stop(f'peer failed while waiting for {what}') from self.error
        self._cv.wait(0.2)

  def fail(self, e: BaseException):
    with self._cv:
      self.error = e
      self._cv.notify_all()

  # weights
  def publish(self, params, version: int) -> None:
    policy = publish.publish_local(params, version, self._param_sh, self._dtype)
    if self._copy:
      policy = publish.Policy(jax.tree.map(jnp.copy, policy.params), version)
    jax.block_until_ready(policy.params)
    with self._cv:
      self._policies = {v: p for v, p in self._policies.items() if v >= version - 1}
      self._policies[version] = policy
      self._cv.notify_all()

  def weights_delivered(self) -> None:
    pass

  def close(self) -> None:
    pass

  def policy_ready(self, version: int) -> bool:
    with self._cv:
      return version in self._policies

  def wait_policy(self, version: int) -> tuple[publish.Policy, float]:
    self._wait(lambda: version in self._policies, f'policy {version}')
    with self._cv:
      return self._policies[version], 0.0

  # small shared values (prompts, eval rows)
  def put(self, key: str, value) -> None:
    with self._cv:
      self._kv[key] = value
      self._cv.notify_all()

  def get(self, key: str):
    self._wait(lambda: key in self._kv, key)
    with self._cv:
      return self._kv[key]

  # claims
  def claim(self, step: int, f: int, who: str) -> bool:
    with self._cv:
      if (step, f) in self._claims:
        return False
      self._claims[(step, f)] = {'who': who, 't': time.time()}
      return True

  def claims(self, step: int, num: int) -> dict[int, dict]:
    with self._cv:
      return {f: self._claims[(step, f)] for f in range(num) if (step, f) in self._claims}

  # fragments
  def send_fragment(self, frag: Fragment, spans: list[dict]) -> None:
    traj = jax.block_until_ready(publish.move_batch_local(frag.traj, self._traj_sh))
    self._frags.put((dataclasses.replace(frag, traj=traj, arrived=time.time()), spans))

  def poll(self) -> bool:
    return not self._frags.empty()

  def receive_fragment(self) -> tuple[Fragment, list[dict], float]:
    while True:
      try:
        frag, spans = self._frags.get(timeout=0.2)
        return frag, spans, 0.0
      except queue.Empty:
        if self.error is not None:
          raise _Stop('rollout failed') from self.error

  def release_before(self, step: int) -> None:
    pass

  def finish_rollout(self) -> None:
    pass


class ChannelLink:
  """Trainer and rollout in two processes: transfer.Channel for weights and fragments, the
  jax.distributed key-value store for prompts, claims and eval rows."""

  def __init__(self, cluster, me: str, *, weights, weights_abstract=None, frag_abstract=None,
               dtype=None, wait_for_pull: bool = False, shared_claims: bool = True):
    peer = cluster.rollout.process if me == 'trainer' else cluster.trainer.process
    self.wait_for_pull = wait_for_pull  # rollout side: see config.schedule.wait_for_pull
    # Claims go through the key-value store only when the trainer may sample too (TAG): each
    # store operation is a round trip to the coordinator, on the trainer's busy host.
    self.shared_claims = shared_claims
    self.chan = transfer.Channel(peer, name='pipeline', timeout_s=PEER_TIMEOUT_S)
    self._weights = weights             # the run's Weights: LoRA manifests out and checks in
    self._digest_sent = False
    self._weights_abstract, self._frag_abstract, self._dtype = (weights_abstract, frag_abstract,
                                                                dtype)
    self._held: list[tuple[int, Fragment]] = []   # sent fragments kept alive until pulled
    self._next_version: int | None = None
    self._weights_acked = True
    # Trainer side: a receiver thread pulls each fragment as soon as it is offered, so the
    # hand-over overlaps the gradient of the fragment before it instead of sitting between
    # two gradients (and a waiting rollout, schedule.wait_for_pull, is released at once).
    self._inbox: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self.error: BaseException | None = None
    self._receiver = None
    if frag_abstract is not None:
      self._receiver = threading.Thread(target=self._receive_loop, name='fragment-receiver',
                                        daemon=True)
      self._receiver.start()

  def _receive_loop(self):
    try:
      while not self._stop.is_set():
        if not self.chan.wait_posted(FRAG_TAG, 0.5):
          continue
        d = self.chan.receive_full(self._frag_abstract, FRAG_TAG)
        i = d.info
        frag = Fragment(i['step'], i['fragment'], i['version'], d.tree,
                        np.asarray(i['rewards'], np.float32), 'rollout', i['sample_s'],
                        i['reward_s'], t_start=i['t_start'], t_end=i['t_end'],
                        arrived=time.time(), eval_s=i['eval_s'])
        self._inbox.put((frag, i['spans'], d.pull_s))
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def fail(self, e):
    self.close()

  def close(self) -> None:
    """Stops the receiver thread (the trainer is done or failed)."""
    self._stop.set()
    if self._receiver is not None:
      self._receiver.join()

  def publish(self, params, version: int) -> None:
    # The first publish of a process carries an adapter digest (a host copy of the adapters);
    # later ones names and shapes only.
    manifest = publish.adapter_manifest(self._weights, params, digest=not self._digest_sent)
    self._digest_sent = True
    publish.send_weights(self.chan, params, version, self._dtype, manifest)
    self._weights_acked = False

  def weights_delivered(self) -> None:
    """Blocks until the rollout holds the latest published weights (once per publish)."""
    if not self._weights_acked:
      self.chan.wait_delivered(publish.WEIGHTS_TAG)
      self._weights_acked = True

  def policy_ready(self, version: int) -> bool:
    return self.chan.poll(publish.WEIGHTS_TAG)

  def wait_policy(self, version: int) -> tuple[publish.Policy, float]:
    policy, pull_s = publish.receive_weights(self.chan, self._weights_abstract)
    if policy.version != version:
      raise RuntimeError(f'rollout expected policy version {version}, got {policy.version}')
    publish.verify_policy(self._weights, policy)
    return policy, pull_s

  def put(self, key: str, value) -> None:
    distributed.kv_set(f'{_KV}/{key}', json.dumps(value), overwrite=True)

  def get(self, key: str):
    return json.loads(distributed.kv_get(f'{_KV}/{key}', PEER_TIMEOUT_S))

  def claim(self, step: int, f: int, who: str) -> bool:
    if not self.shared_claims:   # only the rollout samples (no TAG): nothing to arbitrate
      return True
    try:
      distributed.kv_set(f'{_KV}/claim/{step}/{f}', json.dumps({'who': who, 't': time.time()}))
      return True
    except jax.errors.JaxRuntimeError as e:
      if 'ALREADY_EXISTS' in str(e) or 'already exists' in str(e).lower():
        return False
      raise

  def claims(self, step: int, num: int) -> dict[int, dict]:
    out = {}
    for f in range(num):
      v = distributed.kv_try_get(f'{_KV}/claim/{step}/{f}')
      if v is not None:
        out[f] = json.loads(v)
    return out

  def send_fragment(self, frag: Fragment, spans: list[dict]) -> None:
    info = {'step': frag.step, 'fragment': frag.index, 'version': frag.version,
            'rewards': [float(r) for r in frag.rewards], 'sample_s': frag.sample_s,
            'reward_s': frag.reward_s, 'spans': spans, 't_start': frag.t_start,
            't_end': frag.t_end, 'eval_s': frag.eval_s}
    seq = self.chan.send(frag.traj, FRAG_TAG, info=info)
    self._held.append((frag.step, frag))
    if self.wait_for_pull:  # schedule.wait_for_pull: hand over before the next program starts
      self.chan.wait_delivered(FRAG_TAG, seq)

  def poll(self) -> bool:
    return not self._inbox.empty()

  def receive_fragment(self) -> tuple[Fragment, list[dict], float]:
    while True:
      try:
        return self._inbox.get(timeout=0.2)
      except queue.Empty:
        if self.error is not None:
          raise RuntimeError('receiving a fragment from the rollout failed') from self.error

  def release_before(self, step: int) -> None:
    """Policy `step` arrived: the trainer has pulled every fragment of earlier steps."""
    self._held = [(s, f) for s, f in self._held if s >= step]

  def finish_rollout(self) -> None:
    # With wait_for_pull every fragment was already delivered (and its ack consumed).
    if self.chan._sent.get(FRAG_TAG) and not self.wait_for_pull:  # pylint: disable=protected-access
      self.chan.wait_delivered(FRAG_TAG, timeout_s=PEER_TIMEOUT_S)
    self._held = []


# ------------------------------------------------------------------------------ rollout role


def rollout_loop(exp, workdir: str, cluster, link, tracer: trace_lib.Tracer, start: int,
                 sampler: FragmentSampler, evals) -> None:
  """The rollout role: per step, receive the policy, draw the prompts (the data position has
  one owner), eval if due, then claim and sample fragments in order; with TCSS, start up to
  floor(phi*M) fragments of the next batch with the current policy while the next one is not
  published."""
  config = exp.config
  plan = plan_of(config)
  total = config.total_steps
  n_stale = frag_lib.stale_count(plan.num, config.schedule.tcss_fraction)
  drawn = set()
  grid: dict[int, list[Fragment]] = {}      # this role's fragments per step, for samples/
  every = config.sample_grid_every

  def draw(step):
    if step not in drawn:
      prompts = exp.prompts.next_batch()
      batch_prompts = [p for p in prompts for _ in range(plan.group_size)]
      link.put(f'prompts/{step}', {'batch_prompts': batch_prompts,
                                   'data_position': exp.prompts.position})
      drawn.add(step)
    return link.get(f'prompts/{step}')['batch_prompts']

  def produce(policy, step, f, batch_prompts, eval_s=0.0):
    frag = sampler.sample(policy.params, policy.version, batch_prompts, step, f)
    frag.eval_s = eval_s
    link.send_fragment(frag, tracer.take_new())
    if every and (step + 1) % every == 0:
      grid.setdefault(step, []).append(dataclasses.replace(frag, traj=None))
    logging.info('rollout: step %d fragment %d/%d (policy v%d) sampled in %.3fs', step + 1,
                 f + 1, plan.num, policy.version, frag.sample_s)

  for step in range(start, total):
    # The prompts do not depend on the policy: draw them while the trainer finishes the
    # previous batch, so neither role waits for them after the publish (the step's fill).
    batch_prompts = draw(step)
    policy, pull_s = link.wait_policy(step)
    link.release_before(step)
    eval_rows, t_eval = [], time.perf_counter()
    if evals.due(step, start):
      eval_rows.append(evals(policy))
    eval_info = {'rows': eval_rows, 'eval_s': time.perf_counter() - t_eval, 'pull_s': pull_s}
    eval_s = eval_info['eval_s']
    for f in range(plan.num):
      if link.claim(step, f, 'rollout'):
        produce(policy, step, f, batch_prompts, eval_s)
        eval_s = 0.0
    link.put(f'evals/{step}', eval_info)   # the trainer reads it after its last fragment
    if grid.get(step):
      _write_grid(workdir, step + 1, sorted(grid.pop(step), key=lambda x: x.index),
                  batch_prompts, plan)
    if n_stale and step + 1 < total:
      nxt = draw(step + 1)
      for f in range(n_stale):
        if link.policy_ready(step + 1):
          break
        if link.claim(step + 1, f, 'rollout'):
          produce(policy, step + 1, f, nxt)
  if evals.enabled and start < total:
    policy, _ = link.wait_policy(total)
    link.put('final_evals', [evals(policy)])
  link.finish_rollout()


def _write_grid(workdir: str, step: int, frags: list[Fragment], batch_prompts, plan):
  """samples/step_<step>.png of the fragments this role sampled (TAG ones are not here)."""
  from digen_jax import visualize  # pylint: disable=g-import-not-at-top
  images = np.concatenate([f.images for f in frags])
  captions = [f'{p} | r={r:.3f} | frag {f.index} v{f.version}' for f in frags
              for p, r in zip(plan.prompts(f.index, batch_prompts), f.rewards)]
  visualize.save_grid(os.path.join(workdir, 'samples', f'step_{step:06d}.png'), images,
                      captions, cols=plan.group_size)


# ------------------------------------------------------------------------------ trainer role


class FragmentTrainer:
  """The trainer role's per-fragment programs on top of a workers.TrainerWorker."""

  def __init__(self, exp, trainer: workers.TrainerWorker, plan: frag_lib.FragmentPlan,
               tsp: bool):
    self.exp, self.t, self.plan = exp, trainer, plan
    mesh = trainer.mesh
    self.mesh = mesh
    self.traj_shardings = workers.trajectory_shardings(mesh)
    self._zero = programs.make_zero_acc(trainer.param_shardings, mesh)
    self._grad = programs.make_fragment_grad(exp, mesh, trainer.param_shardings,
                                             self.traj_shardings, tsp=tsp, frozen=trainer.frozen)
    self._apply = programs.make_apply(exp, mesh, trainer.param_shardings, trainer.opt_shardings)
    self._select = programs.make_select(exp, mesh)
    self._rep = mesh_lib.replicated(mesh)
    self._uncond = workers.uncond(exp, plan.size, mesh)
    c = exp.config.rl
    self._adv_fn = functools.partial(adv_lib.grpo_advantages, group_size=c.group_size,
                                     std_mode=c.adv_std, eps=c.adv_eps, clip=c.adv_clip)
    self._advs: dict[tuple[int, int], Any] = {}
    self.devices = list(mesh.devices.flat)
    K, K_pad = programs.tsp_steps(exp, mesh)
    if tsp:
      logging.info('TSP: %d timesteps per fragment (padded to %d) sharded over %d trainer '
                   'devices', K, K_pad, mesh.devices.size)

  def _adv_program(self, n_groups: int, lo: int):
    key = (n_groups, lo)
    if key not in self._advs:
      size, data = self.plan.size, mesh_lib.batch_sharding(self.mesh, 1)

      def adv(rewards):
        a, v = self._adv_fn(rewards)
        return a[lo:lo + size], v[lo:lo + size]
      self._advs[key] = jax.jit(adv, in_shardings=self._rep, out_shardings=(data, data))
    return self._advs[key]

  def advantages(self, f: int, rewards: np.ndarray):
    """(adv [size], valid [size]) of fragment f from the batch's rewards [B] (host; only the
    groups of f need to be filled in)."""
    groups = self.plan.groups_of(f)
    G = self.plan.group_size
    r = rewards[groups.start * G:groups.stop * G]
    lo = f * self.plan.size - groups.start * G
    return self._adv_program(len(groups), lo)(jax.device_put(r, self._rep))

  def begin(self, step: int):
    step_arr = jax.device_put(np.int32(step), self._rep)
    _, k_update = workers._step_keys(self.t._base_key, step_arr)  # pylint: disable=protected-access
    return self._select(k_update, step_arr), self._zero(self.t.params)

  def encode(self, prompts: list[str]):
    """Text conditioning of a fragment on the trainer mesh (host encoder: outside the spans)."""
    return workers.encode(self.exp, prompts, self.mesh)

  def grad(self, acc, indices, traj, cond, adv, valid):
    uncond = self._uncond if self._uncond is not None else cond
    return self._grad(self.t.params, acc, traj, cond, uncond, adv, valid, indices,
                      self.t.ref_params)

  def apply(self, acc) -> dict:
    self.t.params, self.t.opt_state, m = self._apply(self.t.params, self.t.opt_state, acc)
    return m


def train(exp, workdir: str, cluster) -> dict:
  """Runs the pipelined schedule for this process's role(s). Returns {'params', 'opt_state',
  'step'} where this process trains, else {'step'}."""
  config = exp.config
  level = config.runtime.transfer_guard
  plan = plan_of(config)
  tracer = trace_lib.Tracer(config.schedule.trace)
  if cluster.multi_process:
    me = distributed.process_info().process_id
    role = cluster.role_of(me)
    if role == 'rollout':
      return _rollout_process(exp, workdir, cluster, plan, tracer, level)
    if role != 'trainer':
      raise ValueError(f'config.cluster gives process {me} no role')
  from digen_jax.runtime import disagg  # pylint: disable=g-import-not-at-top  (cycle)
  ckpt_cls = disagg.ProcessCheckpointer if cluster.multi_process else ckpt_lib.Checkpointer
  trainer = workers.TrainerWorker(
      exp, cluster.trainer.mesh,
      ckpt_cls(os.path.join(workdir, 'checkpoints'), max_to_keep=config.keep_checkpoints,
               save_every=config.checkpoint_every), level)
  start = trainer.start
  dtype = publish.rollout_param_dtype(cluster)
  ft = FragmentTrainer(exp, trainer, plan, config.schedule.tsp)
  tag_sampler = (FragmentSampler(exp, cluster.trainer.mesh, trainer.param_shardings, plan,
                                 'trainer', tracer, level) if config.schedule.tag else None)
  rollout_thread = None
  if cluster.multi_process:
    distributed.kv_set(f'{_KV}/start', json.dumps({'step': start,
                                                   'data_position': trainer.data_position}))
    link = ChannelLink(cluster, 'trainer', weights=exp.weights, dtype=dtype,
                       frag_abstract=abstract_fragment(exp, plan, ft.traj_shardings))
  else:
    if start:
      exp.prompts.restore(trainer.data_position)
    rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
    link = LocalLink(cluster, ft.traj_shardings, rollout_sh, dtype)
    sampler = FragmentSampler(exp, cluster.rollout.mesh, rollout_sh, plan, 'rollout', tracer,
                              level, dtype, frozen_fsdp=publish.rollout_frozen_fsdp(cluster))
    evals = workers.EvalRunner(exp, cluster.rollout.mesh, workdir,
                               frozen_fsdp=publish.rollout_frozen_fsdp(cluster))

    def run_rollout():
      try:
        rollout_loop(exp, workdir, cluster, link, tracer, start, sampler, evals)
      except _Stop:
        pass
      except BaseException as e:  # pylint: disable=broad-except
        logging.exception('rollout thread failed')
        link.fail(e)
    rollout_thread = threading.Thread(target=run_rollout, name='rollout', daemon=True)
    rollout_thread.start()
  try:
    out = _trainer_loop(exp, workdir, cluster, trainer, ft, tag_sampler, link, tracer, plan,
                        start, level)
  except BaseException as e:
    link.fail(e)
    raise
  link.close()
  if rollout_thread is not None:
    rollout_thread.join()
    if link.error is not None:
      raise RuntimeError('the rollout thread failed') from link.error
  return out


def _rollout_process(exp, workdir, cluster, plan, tracer, level) -> dict:
  config = exp.config
  start_info = json.loads(distributed.kv_get(f'{_KV}/start', PEER_TIMEOUT_S))
  start = int(start_info['step'])
  exp.prompts.restore(int(start_info['data_position']))
  rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
  link = ChannelLink(cluster, 'rollout', weights=exp.weights, weights_abstract=transfer.abstract(
      exp.params, rollout_sh, publish.rollout_param_dtype(cluster)),
                     wait_for_pull=config.schedule.wait_for_pull,
                     shared_claims=config.schedule.tag)
  sampler = FragmentSampler(exp, cluster.rollout.mesh, rollout_sh, plan, 'rollout', tracer,
                            level, publish.rollout_param_dtype(cluster),
                            frozen_fsdp=publish.rollout_frozen_fsdp(cluster))
  evals = workers.EvalRunner(exp, cluster.rollout.mesh, workdir,
                             frozen_fsdp=publish.rollout_frozen_fsdp(cluster))
  rollout_loop(exp, workdir, cluster, link, tracer, start, sampler, evals)
  return {'step': config.total_steps}


def _trainer_loop(exp, workdir, cluster, trainer, ft: FragmentTrainer, tag_sampler, link,
                  tracer: trace_lib.Tracer, plan, start: int, level: str) -> dict:
  config = exp.config
  sched = config.schedule
  writer = metrics_lib.MetricsWriter(workdir)
  progress = metrics_lib.Progress(start, config.total_steps)
  publish_mb = publish.publish_megabytes(exp.params, publish.rollout_param_dtype(cluster))
  costs = bts_lib.Costs()
  decisions_total = 0
  early: dict[int, list[Fragment]] = {}      # fragments of a later step that arrived early (TCSS)

  published_at: dict[int, float] = {}       # policy version -> wall clock after its publish

  def publish_now(version: int) -> float:
    t = time.perf_counter()
    with workers.guard(level):
      with tracer.span(ft.devices, 'trainer', 'publish', step=version, version=version):
        link.publish(trainer.params, version)
    published_at[version] = time.time()
    published_at.pop(version - 2, None)
    return time.perf_counter() - t

  last_from_rollout: dict[int, Fragment] = {}  # step -> the rollout's latest fragment of it

  def take(step: int) -> tuple[Fragment, float]:
    """The next fragment from the rollout (blocking); profiles the rollout's costs for BTS."""
    with workers.guard(level):
      frag, spans, pull_s = link.receive_fragment()
    tracer.extend(trace_lib.Span.from_json(s) for s in spans if cluster.multi_process)
    if frag.sample_s > 0:
      costs.observe('roll', frag.sample_s)
      costs.observe('deliver', max(0.0, frag.arrived - frag.t_end))
      prev = last_from_rollout.get(frag.step)
      if prev is not None and prev.version == frag.version:
        costs.observe('gap', max(0.0, frag.t_start - prev.t_end))
      elif prev is None and frag.version == frag.step and frag.step in published_at:
        costs.observe('start', max(0.0, frag.t_start - frag.eval_s - published_at[frag.step]))
      last_from_rollout[frag.step] = frag
      for s in [s for s in last_from_rollout if s < step]:
        del last_from_rollout[s]
    return frag, pull_s

  final_eval = config.eval.every > 0 and start < config.total_steps
  # Step windows are contiguous: step n's wall time runs from the start of its policy's
  # publish to the start of the next one, so nothing the trainer does is left out of them.
  t_step = time.time()
  publish_s = publish_now(start) if start < config.total_steps else 0.0
  for step in range(start, config.total_steps):
    batch_prompts = link.get(f'prompts/{step}')['batch_prompts']
    # Text conditioning of every fragment now, while the first fragment is being sampled.
    conds = {f: ft.encode(plan.prompts(f, batch_prompts)) for f in range(plan.num)}
    rewards = np.full((plan.batch,), np.nan, np.float32)
    scored: dict[int, Fragment] = {}
    trained: set[int] = set()
    adv_valid: dict[int, tuple] = {}
    decisions = []
    move_s, grad_s, tag_s = 0.0, 0.0, 0.0
    with workers.guard(level):
      indices, acc = ft.begin(step)

    def add(frag: Fragment):
      if frag.step != step:
        early.setdefault(frag.step, []).append(frag)
        return
      scored[frag.index] = frag
      rewards[list(plan.samples(frag.index))] = frag.rewards

    for frag in early.pop(step, []):
      add(frag)
    while len(trained) < plan.num:
      while link.poll():
        frag, pull_s = take(step)
        move_s += pull_s
        add(frag)
      ready = plan.trainable(set(scored), trained)
      if ready:
        f = ready[0]
        t0 = time.perf_counter()
        with workers.guard(level):
          with tracer.span(ft.devices, 'trainer', 'grad', step=step, fragment=f,
                           version=step):
            adv_valid[f] = ft.advantages(f, rewards)
            acc = jax.block_until_ready(ft.grad(acc, indices, scored[f].traj, conds[f],
                                                *adv_valid[f]))
        dt = time.perf_counter() - t0
        grad_s += dt
        costs.observe('train', dt)
        trained.add(f)
        continue
      if tag_sampler is not None:
        claims = link.claims(step, plan.num)
        mine_in_flight = [c for f, c in claims.items()
                          if c['who'] == 'rollout' and f not in scored]
        now = time.time()
        if mine_in_flight:   # its device is busy until about its claim + one fragment
          rollout_free_at = max(c['t'] for c in mine_in_flight) + (costs.roll or 0)
        else:                # idle, or (at a step's start) still fetching the policy
          rollout_free_at = published_at.get(step, now) + costs.start
        dec = bts_lib.decide(costs, now=now, rollout_free_at=rollout_free_at,
                             in_flight=min(1, len(mine_in_flight)),
                             unclaimed=plan.num - len(claims), backlog=0,
                             trainer_speed=cluster.trainer.speed,
                             rollout_speed=cluster.rollout.speed)
        dec.update(step=step + 1, t=now)
        if dec['action'] == 'insert':
          f = next(f for f in range(plan.num) if f not in claims)
          if link.claim(step, f, 'trainer'):
            dec['fragment'] = f
            t0 = time.perf_counter()
            frag = tag_sampler.sample(trainer.params, step, batch_prompts, step, f)
            dt = time.perf_counter() - t0
            tag_s += dt
            costs.observe('tag', frag.sample_s + frag.reward_s)
            costs.observe('switch', max(0.0, dt - frag.sample_s - frag.reward_s))
            add(frag)
          else:
            dec.update(action='wait', reason=f'fragment {f} was claimed by the rollout first')
        logging.info('BTS step %d: %s (%s)%s', step + 1, dec['action'], dec['reason'],
                     '' if 'makespan_wait' not in dec else
                     f" predicted {dec['makespan_wait']:.3f}s wait vs "
                     f"{dec['makespan_insert']:.3f}s insert")
        tracer.decision(dec)
        decisions.append(dec)
        if dec['action'] == 'insert':
          continue
      frag, pull_s = take(step)
      move_s += pull_s
      add(frag)

    evals_info = link.get(f'evals/{step}')
    for row in evals_info['rows']:
      writer.write(row)
    link.weights_delivered()        # the rollout holds its copy: params may be donated
    t0 = time.perf_counter()
    with workers.guard(level):
      with tracer.span(ft.devices, 'trainer', 'apply', step=step, version=step + 1):
        m = jax.device_get(ft.apply(acc))
      for _ in range(1, config.rl.inner_epochs):     # further PPO epochs over the stored batch
        _, acc = ft.begin(step)
        with tracer.span(ft.devices, 'trainer', 'grad', step=step, version=step + 1):
          for f in range(plan.num):
            acc = ft.grad(acc, indices, scored[f].traj, conds[f], *adv_valid[f])
          jax.block_until_ready(acc)
        with tracer.span(ft.devices, 'trainer', 'apply', step=step, version=step + 1):
          m_e = jax.device_get(ft.apply(acc))
        m['nonfinite'] = max(float(m['nonfinite']), float(m_e['nonfinite']))
    apply_s = time.perf_counter() - t0
    m = {k: float(v) for k, v in m.items()}
    t_end = time.time()
    wall = t_end - t_step - evals_info['eval_s']
    step_publish_s, step_t0 = publish_s, t_step
    # The next policy goes out before this step's bookkeeping: the rollout starts the next
    # batch while the trainer writes metrics and checkpoints (that time counts to the next step).
    if step + 1 < config.total_steps or final_eval:
      publish_s = publish_now(step + 1)
      if not sched.tcss_fraction:
        # The rollout's first fragment waits for this pull, and the trainer has nothing to do
        # before that fragment arrives: let the pull run alone rather than beside the
        # bookkeeping below (on a shared host the two compete; measured 6-8 ms vs 9-15 ms).
        link.weights_delivered()
    t_step = t_end
    if m['nonfinite'] > 0:
      logging.error('step %d: non-finite loss/gradient; the update was skipped (weights '
                    'unchanged)', step + 1)
    valid_frac = float(np.mean([np.mean(jax.device_get(adv_valid[f][1]))
                                for f in range(plan.num)]))
    versions = np.repeat([scored[f].version for f in range(plan.num)], plan.size)
    row = workers.step_row(
        step=step + 1, policy_version=int(versions.min()), rewards=rewards,
        valid_frac=valid_frac, metrics=m, wall_s=wall,
        rollout_s=sum(s.sample_s for s in scored.values() if s.producer == 'rollout'),
        reward_s=sum(s.reward_s for s in scored.values()), update_s=grad_s + apply_s,
        publish_s=step_publish_s + evals_info['pull_s'], publish_mb=publish_mb, batch_move_s=move_s,
        cluster=cluster, utilization=tracer.utilization(step_t0, t_end, cluster.num_devices))
    row.update(fragments=plan.num, tag_fragments=sum(s.producer == 'trainer'
                                                      for s in scored.values()),
               tag_s=tag_s, bts_decisions=len(decisions),
               bts_inserts=sum(d['action'] == 'insert' for d in decisions))
    if sched.tcss_fraction > 0:
      lags = step - versions
      row['staleness_mix'] = {str(k): float(np.mean(lags == k)) for k in range(2)}
    decisions_total += len(decisions)
    writer.write(row)
    if (step + 1) % config.log_every == 0 or step + 1 == config.total_steps:
      progress.log(step + 1, row)
    data_position = link.get(f'prompts/{step}')['data_position']
    trainer.save(step + 1, data_position, force=step + 1 == config.total_steps)
  if final_eval:   # policy total_steps was published after the last step
    for row in link.get('final_evals'):
      writer.write(row)
    link.weights_delivered()
  if sched.trace:
    tracer.write(workdir, title=_title(config))
  trainer.close()
  writer.close()
  return {'params': trainer.params, 'opt_state': trainer.opt_state, 'step': config.total_steps,
          'decisions': tracer.decisions}


def _title(config) -> str:
  s = config.schedule
  parts = [config.runtime.mode, f'M={s.fragments} ({s.fragment_unit})']
  parts += [n for n, on in (('TSP', s.tsp), ('TAG/BTS', s.tag)) if on]
  if s.tcss_fraction > 0:
    parts.append(f'TCSS phi={s.tcss_fraction}')
  return ' + '.join(parts)
