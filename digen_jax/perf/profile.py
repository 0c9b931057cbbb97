"""Costs of a run's real programs, timed on this machine in the ladder's layouts (perf/engine.py's
input when the simulator predicts measured runs).

    python -m digen_jax.perf.profile --config=configs/shapes.py:pixel,disagg --out=/tmp/profile.json \
        --fragments=16 --fragment_unit=group [--layouts=colocated,sp,mp2] \
        [--fragment_grads=plain,tsp] [--config.k=v ...]

Each layout is profiled the way benchmarks/ladder.py runs it, in child processes this command
starts (the device count must be fixed before jax is imported):
  colocated  one process, 2D forced CPU devices, one mesh for both roles
  sp         one process, 2D devices: the first D train, the other D roll out
  mp2        two processes through launch/local.py --cpu_pinning (one core each, D devices
             each): process 0 trains, process 1 rolls out; hand-overs go through the transfer
             server, as in the real run
Every program is built as the runtime builds it (runtime/trainer.py, runtime/rollout.py,
runtime/links.py), run once to compile, then timed --repeats times with nothing else running
(the mean is kept: a run's throughput follows its programs' mean times, slow calls included,
and a run's spans are averaged too), for a fragment of the whole batch (n = B: the colocated
and naive disaggregation rungs, the fused update) and, on the disaggregated layouts, of B / M
samples: the fragment rollout (device span and host scoring apart; then again as the runtime
samples fragments, each scored beside the next one's span), its hand-over to the trainer, the
trainer's encode, advantages and gradient (with and without TSP: --fragment_grads, only those
the predicted rungs use), the optimizer apply, the trainer-side (TAG) fragment rollout, the
weight publish and pull, the step's selection program and the checkpoint save (its blocking
part and the asynchronous rest). Nothing here is fitted to a run's throughput.

Output: {'config', 'overrides', 'machine', 'layouts': {name: {'trainer_devices',
'rollout_devices', 'shared', 'colocated', 'batch', 'fragment', 'seconds': {key: s}}}} with keys
rollout/<n>, reward/<n>, rollout_piped/<n>, rollout_host/<n>, handover/<n>, encode/<n>,
adv/<n>, update/<B>, grad/<n>, grad_tsp/<n>, apply, tag_rollout/<n>, tag_reward/<n>, publish,
pull, begin, checkpoint_block, checkpoint; and checkpoint_every (the config's: one save per
that many steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from digen_jax.experiment import config as configlib
from digen_jax.process import cli

LAYOUTS = ('colocated', 'sp', 'mp2')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OUT = flags.DEFINE_string('out', None, 'where the profile JSON goes')
_LAYOUTS = flags.DEFINE_list('layouts', list(LAYOUTS), f'subset of {",".join(LAYOUTS)}')
_FRAGMENTS = flags.DEFINE_integer(
    'fragments',
    0,
    'M of the fragment programs profiled; 0: the largest of 16, 8, 4, 2, 1 that divides the '
    "config's batch in --fragment_unit units",
)
_UNIT = flags.DEFINE_enum('fragment_unit', 'group', ['group', 'sample'], 'fragment unit')
_DEVICES = flags.DEFINE_integer('devices_per_process', 1, 'D (colocated and sp get 2*D)')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'timed calls per program (their mean kept)')
FRAGMENT_GRADS = ('plain', 'tsp')
_GRADS = flags.DEFINE_list(
    'fragment_grads',
    list(FRAGMENT_GRADS),
    'the fragment gradients to time: plain (grad/<n>, the gap rung) and/or tsp (grad_tsp/<n>, '
    'the tsp, tag and tcss rungs); each compiles for seconds',
)
_CHILD = flags.DEFINE_string('child', None, 'internal: the layout this process profiles')


def _timed(fn, repeats: int) -> tuple[float, list]:
  """(mean seconds of fn() over `repeats` calls after one warm-up call (it compiles), the
  timed calls' results)."""
  fn()
  times, results = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    results.append(fn())
    times.append(time.perf_counter() - t0)
  return statistics.fmean(times), results


def _mean_time(fn, repeats: int) -> float:
  """Mean seconds of fn() over `repeats` calls after one warm-up call (it compiles)."""
  return _timed(fn, repeats)[0]


def layout_config(config, layout: str, fragments: int, unit: str):
  """`config` as the profile of `layout` runs it: colocated, or disaggregated (a colocated
  config gets the 'auto' roles: half of the devices each), with M fragments of `unit`."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    if layout == 'colocated':
      config.runtime.mode = 'colocated'
    elif config.runtime.mode != 'disagg':  # a colocated config's roles: the 'auto' layout
      configlib.set_disagg(config)
    config.schedule.fragments = fragments
    config.schedule.fragment_unit = unit
    # Disagg: the trainer's frozen weights include the decoder (TAG samples on its mesh).
    config.schedule.tag = layout != 'colocated'
    config.schedule.trace = False
    config.eval.every = 0
  return config


def profile_child(
    layout: str,
    config,
    workdir: str,
    fragments: int,
    unit: str,
    repeats: int,
    fragment_grads: tuple[str, ...] = FRAGMENT_GRADS,
) -> dict:
  """Times the programs of `layout` in this process (and its peer, for mp2): the one-fragment
  programs of the colocated and naive-disaggregation rungs (n = B: the fused update), and on
  the disaggregated layouts the M-fragment ones (n = B / M) with the gradients in
  `fragment_grads` (see the flag) and TAG's trainer-side rollout. `workdir` takes the
  checkpoints."""
  import jax  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import run as run_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.process import compile_cache  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
  from digen_jax.experiment import entry  # pylint: disable=g-import-not-at-top
  import digen_jax.tasks  # noqa: F401  pylint: disable=g-import-not-at-top  (registers the tasks)

  info = distributed.maybe_initialize()
  compile_cache.enable()  # the runs it predicts then start from the same compiled programs
  config = layout_config(config, layout, fragments, unit)
  if layout == 'colocated':
    cluster = cluster_lib.colocated(jax.local_devices())
  else:
    cluster = cluster_lib.resolve(run_lib.cluster_spec(config))
  exp = entry.build_experiment(config, workdir, max(cluster.rollout.size, cluster.trainer.size))
  prof = _Profile(exp, cluster, workdir, repeats, info.num_processes > 1, info.process_id)
  plan = exp.plan
  one = dataclasses.replace(plan, num=1, unit='group')
  prof.weights()
  prof.fragment(one, [('update', False)], checkpoint=True)
  if layout != 'colocated':
    grads = [(g, g == 'tsp') for g in FRAGMENT_GRADS if g in fragment_grads]
    prof.fragment(plan, grads, tag=True)
  out = prof.finish()
  if not out:
    return {}
  return {
      'trainer_devices': cluster.trainer.size,
      'rollout_devices': cluster.rollout.size,
      'shared': layout != 'mp2',
      'colocated': layout == 'colocated',
      'batch': plan.batch,
      'fragment': plan.size,
      'fragments': plan.num,
      'group_size': plan.group_size,
      'checkpoint_every': config.checkpoint_every,
      'seconds': out,
  }


class _Profile:
  """The programs of one layout, built as the runtime builds them (runtime/trainer.py,
  runtime/rollout.py, runtime/links.py), each timed `repeats` times after a warm-up call with
  nothing else running; with two processes both run the same phases between barriers."""

  def __init__(self, exp, cluster, workdir: str, repeats: int, multi: bool, me: int):
    from digen_jax.runtime import bookkeeping  # pylint: disable=g-import-not-at-top
    from digen_jax.runtime import publish  # pylint: disable=g-import-not-at-top
    from digen_jax.runtime import trace as trace_lib  # pylint: disable=g-import-not-at-top
    from digen_jax.runtime import transfer  # pylint: disable=g-import-not-at-top

    self.exp, self.cluster, self.repeats, self.multi = exp, cluster, repeats, multi
    self.is_trainer = not multi or cluster.role_of(me) == 'trainer'
    self.is_rollout = not multi or cluster.role_of(me) == 'rollout'
    self.tracer = trace_lib.Tracer(False)
    self.checkpointer = None  # the trainer's (the ProcessCheckpointer lives in process 0)
    if self.is_trainer:
      self.checkpointer = bookkeeping.checkpointer(exp.output, workdir, multi)
    self.rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
    self.dtype = publish.rollout_param_dtype(cluster)
    self.frozen_fsdp = publish.rollout_frozen_fsdp(cluster)
    self.chan = None
    if multi:
      peer = cluster.rollout.process if self.is_trainer else cluster.trainer.process
      self.chan = transfer.Channel(peer, name='profile')
    prompts = exp.prompts.next_batch()
    self.batch_prompts = [p for p in prompts for _ in range(exp.plan.group_size)]
    self.out: dict[str, float] = {}
    self.policy = None

  def barrier(self, name: str) -> None:
    if self.multi:
      from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top

      distributed.barrier(f'digen/profile/{name}', timeout_s=1800)

  def trainer(self, plan, tsp: bool, tag: bool = False):
    from digen_jax.runtime import trainer as trainer_lib  # pylint: disable=g-import-not-at-top

    mesh = self.cluster.trainer.mesh
    return trainer_lib.Trainer(self.exp, mesh, self.checkpointer, plan, tag=tag, tsp=tsp)

  def weights(self) -> None:
    """The weight publish (trainer) and pull (rollout), through the links the runtime uses."""
    from digen_jax.runtime import links  # pylint: disable=g-import-not-at-top
    from digen_jax.runtime import transfer  # pylint: disable=g-import-not-at-top

    exp, cluster, r = self.exp, self.cluster, self.repeats
    if not self.multi:
      trainer = self.trainer(exp.plan, tsp=False)
      link = links.LocalLink(
          cluster, exp.weights, trainer.traj_shardings, self.rollout_sh, self.dtype
      )
      self.out['publish'] = _mean_time(lambda: link.publish(trainer.params, 0), r)
      self.out['pull'] = 0.0
      self.policy = link.wait_policy(0)[0]
      return
    if self.is_trainer:
      trainer = self.trainer(exp.plan, tsp=False)
      link = links.ChannelLink(cluster, 'trainer', weights=exp.weights, dtype=self.dtype)
      sends = []
      for v in range(r + 1):
        t0 = time.perf_counter()
        link.publish(trainer.params, v)
        sends.append(time.perf_counter() - t0)
        link.weights_delivered()
      self.out['publish'] = statistics.fmean(sends[1:])
    else:
      ab = transfer.abstract(exp.params, self.rollout_sh, self.dtype)
      link = links.ChannelLink(cluster, 'rollout', weights=exp.weights, weights_abstract=ab)
      pulls = [link.wait_policy(v) for v in range(r + 1)]
      self.out['pull'] = statistics.fmean(p[1] for p in pulls[1:])
      self.policy = pulls[-1][0]
    self.barrier('weights')

  def fragment(self, plan, grads, *, checkpoint: bool = False, tag: bool = False) -> None:
    """The programs of a fragment of plan.size samples: sampling and scoring, the hand-over,
    the trainer's encode, advantages and gradient(s) (grads: [(name, tsp)]), the optimizer
    step, the checkpoint save (checkpoint) and TAG's trainer-side rollout (tag)."""
    n = plan.size
    frag = self._rollout(plan) if self.is_rollout else None
    self.barrier(f'rollout/{n}')
    traj = self._handover(plan, frag)
    self.barrier(f'handover/{n}')
    if self.is_trainer:
      rewards = (
          np.zeros((plan.batch,), np.float32)
          if frag is None
          else np.resize(frag.rewards, plan.batch)
      )
      for name, tsp in grads:
        trainer = self.trainer(plan, tsp=tsp, tag=tag)
        self._trainer_programs(trainer, plan, name, traj, rewards)
        if checkpoint:
          self._checkpoint(trainer)
          checkpoint = False
      if tag:
        self._tag_rollout(trainer, plan)
      trainer.close()
    self.barrier(f'trainer/{n}')

  def _rollout(self, plan):
    from digen_jax.runtime import rollout as rollout_lib  # pylint: disable=g-import-not-at-top

    sampler = rollout_lib.Sampler(
        self.exp,
        self.cluster.rollout.mesh,
        self.rollout_sh,
        plan,
        'rollout',
        self.tracer,
        'allow',
        self.dtype,
        frozen_fsdp=self.frozen_fsdp,
    )
    frags = [
        sampler.sample(self.policy.params, 0, self.batch_prompts, 0, f % plan.num)
        for f in range(self.repeats + 1)
    ][1:]
    self.out[f'rollout/{plan.size}'] = statistics.fmean(f.sample_s for f in frags)
    self.out[f'reward/{plan.size}'] = statistics.fmean(f.reward_s for f in frags)
    if plan.num > 1:
      self._piped_rollout(sampler, plan)
    return frags[0]

  def _piped_rollout(self, sampler, plan) -> None:
    """Fragments sampled as the runtime's rollout samples them (runtime/rollout.py): each one
    scored while the next one samples, on the same host. rollout_piped/<n>: the mean span
    then; rollout_host/<n>: the mean host time from a span's end to the next one's start
    (encode, dispatch, taking the previous scores in)."""
    from digen_jax.runtime import rollout as rollout_lib  # pylint: disable=g-import-not-at-top

    spans, hosts, prev = [], [], None
    for f in range(self.repeats + 2):
      frag = sampler.sample(self.policy.params, 0, self.batch_prompts, 0, f % plan.num, wait=False)
      if f > 1:  # the first pair warms up
        spans.append(frag.sample_s)
        hosts.append(frag.t_start - prev.t_end)
      if prev is not None:
        rollout_lib.complete(prev)
      prev = frag
    rollout_lib.complete(prev)
    self.out[f'rollout_piped/{plan.size}'] = statistics.fmean(spans)
    self.out[f'rollout_host/{plan.size}'] = statistics.fmean(hosts)

  def _handover(self, plan, frag):
    """A fragment's trajectory onto the trainer's layout (a jax.device_put in one process, the
    transfer server across two); its seconds as handover/<n>. Returns it (trainer side)."""
    import jax  # pylint: disable=g-import-not-at-top
    from digen_jax import programs  # pylint: disable=g-import-not-at-top
    from digen_jax.runtime import rollout as rollout_lib  # pylint: disable=g-import-not-at-top

    sh = programs.trajectory_shardings(self.cluster.trainer.mesh, self.exp)
    key = f'handover/{plan.size}'
    if not self.multi:
      move = lambda: jax.block_until_ready(jax.device_put(frag.traj, sh))
      self.out[key] = _mean_time(move, self.repeats)
      return move()
    if self.is_rollout:
      for _ in range(self.repeats + 1):
        self.chan.send(frag.traj, 'frag')
        self.chan.wait_delivered('frag')
      return None
    ab = rollout_lib.abstract_fragment(self.exp, plan, sh)
    pulls = [self.chan.receive_full(ab, 'frag') for _ in range(self.repeats + 1)]
    self.out[key] = statistics.fmean(d.pull_s for d in pulls[1:])
    return pulls[-1].tree

  def _trainer_programs(self, trainer, plan, name: str, traj, rewards) -> None:
    import jax  # pylint: disable=g-import-not-at-top

    n, r = plan.size, self.repeats
    cond = trainer.encode(plan.prompts(0, self.batch_prompts))
    self.out[f'encode/{n}'] = _mean_time(
        lambda: trainer.encode(plan.prompts(0, self.batch_prompts)), r
    )
    self.out[f'adv/{n}'] = _mean_time(
        lambda: jax.block_until_ready(trainer.advantages(0, rewards)), r
    )
    self.out['begin'] = _mean_time(lambda: jax.block_until_ready(trainer.begin(0)), r)
    adv = trainer.advantages(0, rewards)
    state = {'s': trainer.begin(0)}  # the accumulator (or params) is donated: thread it

    def train():
      state['s'] = jax.block_until_ready(trainer.train(state['s'], traj, cond, *adv))

    key = {'update': 'update', 'plain': 'grad', 'tsp': 'grad_tsp'}[name]
    self.out[f'{key}/{n}'] = _mean_time(train, r)
    if trainer.fused:
      return
    applies = []
    for _ in range(r + 1):  # apply donates the accumulator: a fresh one each time
      s = jax.block_until_ready(trainer.train(trainer.begin(0), traj, cond, *adv))
      t0 = time.perf_counter()
      jax.device_get(trainer.apply(s))
      applies.append(time.perf_counter() - t0)
    self.out['apply'] = statistics.fmean(applies[1:])

  def _checkpoint(self, trainer) -> None:
    """The checkpoint each step ends with (config.checkpoint_every): what the save call
    blocks, then the asynchronous rest (serialization, compression, commit, digest) on this
    core, which in a run competes with the next step's programs."""
    every, blocks, rests = self.exp.output.checkpoint_every, [], []
    for k in range(1, self.repeats + 2):
      t0 = time.perf_counter()
      trainer.save(k * every, 0)
      t1 = time.perf_counter()
      trainer.checkpointer.wait()
      blocks.append(t1 - t0)
      rests.append(time.perf_counter() - t1)
    self.out['checkpoint_block'] = statistics.fmean(blocks[1:])
    self.out['checkpoint'] = statistics.fmean(rests[1:])

  def _tag_rollout(self, trainer, plan) -> None:
    from digen_jax.runtime import rollout as rollout_lib  # pylint: disable=g-import-not-at-top

    mesh = self.cluster.trainer.mesh
    sampler = rollout_lib.Sampler(
        self.exp, mesh, trainer.param_shardings, plan, 'trainer', self.tracer, 'allow'
    )
    tags = [
        sampler.sample(trainer.params, 0, self.batch_prompts, 0, f % plan.num)
        for f in range(self.repeats + 1)
    ][1:]
    self.out[f'tag_rollout/{plan.size}'] = statistics.fmean(f.sample_s for f in tags)
    self.out[f'tag_reward/{plan.size}'] = statistics.fmean(f.reward_s for f in tags)

  def finish(self) -> dict:
    """The seconds (the trainer process gets the rollout's through the key-value store)."""
    if self.checkpointer is not None:
      self.checkpointer.close()
    if not self.multi:
      return self.out
    from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top

    if self.is_rollout:
      distributed.kv_set('digen/profile/rollout', json.dumps(self.out))
      return {}
    self.out.update(json.loads(distributed.kv_get('digen/profile/rollout', 600)))
    return self.out


_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def _child_command(layout: str, argv: list[str], out: str) -> tuple[list[str], dict]:
  """argv and environment of the processes that profile `layout`."""
  d = _DEVICES.value
  words = [a for a in argv[1:] if not a.startswith(('--out', '--layouts', '--child'))]
  cmd = [
      sys.executable,
      '-m',
      'digen_jax.perf.profile',
      *words,
      f'--child={layout}',
      f'--out={out}',
  ]
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get('PYTHONPATH')) if p),
      PYTHONUNBUFFERED='1',
  )
  launcher = [sys.executable, os.path.join(REPO, 'launch', 'local.py')]
  if layout == 'mp2':
    return (
        launcher + ['--num_processes=2', f'--devices_per_process={d}', '--cpu_pinning', '--'] + cmd,
        env,
    )
  if layout == 'sp':
    cmd += ['--config.runtime.mode=disagg']
  # One process, started as the ladder starts its colocated and sp runs: without the launcher,
  # whose jax.distributed job of one process routes the devices' collectives through gloo (the
  # fused update took 2x as long as in the runs it predicts).
  flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith(_DEVICE_COUNT_FLAG)]
  env['XLA_FLAGS'] = ' '.join([*flags, f'{_DEVICE_COUNT_FLAG}={2 * d}'])
  return cmd, env


def machine() -> dict:
  """Where a profile was taken (the simulator's predictions hold for this machine)."""
  import platform  # pylint: disable=g-import-not-at-top

  cpu = ''
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((l.split(':', 1)[1].strip() for l in f if l.startswith('model name')), '')
  except OSError:
    pass
  return {
      'platform': platform.platform(),
      'cpu': cpu,
      'cores': sorted(os.sched_getaffinity(0)),
      'load_avg_1m': os.getloadavg()[0],
      'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
  }


def fragments_for(config, unit: str, asked: int) -> int:
  """`asked`, or (0) the largest of 16, 8, 4, 2, 1 dividing the batch in `unit` units: groups
  (rl.prompts_per_step) or samples (times rl.group_size)."""
  if asked:
    return asked
  units = config.rl.prompts_per_step * (config.rl.group_size if unit == 'sample' else 1)
  return next(m for m in (16, 8, 4, 2, 1) if units % m == 0)


def main(argv):
  config, _ = cli.config_and_workdir()
  fragments = fragments_for(config, _UNIT.value, _FRAGMENTS.value)
  if _CHILD.value:
    # The timed checkpoints (tens of MB) go to a folder removed on the way out.
    with tempfile.TemporaryDirectory(prefix='digen_profile_') as workdir:
      result = profile_child(
          _CHILD.value,
          config,
          workdir,
          fragments,
          _UNIT.value,
          _REPEATS.value,
          tuple(_GRADS.value),
      )
    if result:
      with open(_OUT.value, 'w') as f:
        json.dump(result, f)
    return
  if not _OUT.value:
    cli.fail('--out: give the file the profile JSON goes to')
  bad = [x for x in _LAYOUTS.value if x not in LAYOUTS]
  if bad or not _LAYOUTS.value:
    cli.fail(f'--layouts={",".join(_LAYOUTS.value)}: use a subset of {",".join(LAYOUTS)}')
  bad = [x for x in _GRADS.value if x not in FRAGMENT_GRADS]
  if bad or not _GRADS.value:
    cli.fail(
        f'--fragment_grads={",".join(_GRADS.value)}: use a subset of {",".join(FRAGMENT_GRADS)}'
    )
  if _REPEATS.value < 1 or _FRAGMENTS.value < 0 or _DEVICES.value < 1:
    cli.fail('--repeats and --devices_per_process must be >= 1, --fragments >= 0 (0: auto)')
  layouts = {}
  for layout in _LAYOUTS.value:
    part = f'{_OUT.value}.{layout}.part'
    cmd, env = _child_command(layout, sys.argv, part)
    t0 = time.time()
    done = subprocess.run(cmd, env=env, check=False)
    if done.returncode:
      cli.fail(f'profiling the {layout} layout failed (exit {done.returncode})')
    with open(part) as f:
      layouts[layout] = json.load(f)
    os.remove(part)
    print(
        f'[profile] {layout}: {time.time() - t0:.0f}s '
        + ' '.join(f'{k}={v * 1e3:.1f}ms' for k, v in layouts[layout]['seconds'].items()),
        flush=True,
    )
  with open(_OUT.value, 'w') as f:
    json.dump({'argv': sys.argv[1:], 'machine': machine(), 'layouts': layouts}, f, indent=1)
  print(f'[profile] {_OUT.value}')


if __name__ == '__main__':
  flags.FLAGS.set_default('workdir', tempfile.gettempdir())  # cli's flag; nothing is written there
  app.run(main, flags_parser=cli.parse_flags)
