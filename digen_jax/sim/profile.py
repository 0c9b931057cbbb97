"""Costs of a run's real programs, timed on this machine in the ladder's layouts (sim/engine.py's
input when the simulator predicts measured runs).

    python -m digen_jax.sim.profile --config=configs/shapes.py:pixel,disagg --out=/tmp/profile.json \
        --fragments=16 --fragment_unit=group [--layouts=colocated,sp,mp2] \
        [--fragment_grads=plain,tsp] [--config.k=v ...]

Each layout is profiled the way benchmarks/ladder.py runs it, in child processes this command
starts (the device count must be fixed before jax is imported):
  colocated  one process, 2D forced CPU devices, one mesh for both roles
  sp         one process, 2D devices: the first D train, the other D roll out
  mp2        two processes through launch/local.py --cpu_pinning (one core each, D devices
             each): process 0 trains, process 1 rolls out; hand-overs go through the transfer
             server, as in the real run
Every program is built as the runtime builds it (runtime/workers.py, runtime/rollout.py,
runtime/fragment_trainer.py), run once to compile, then timed --repeats times with nothing else
running (the median is kept): the full-batch rollout and update of the synchronous loops, the
fragment rollout (device span and host scoring apart), the fragment gradient with and without
TSP (--fragment_grads: only those the predicted rungs use), the optimizer apply, the
trainer-side (TAG) fragment rollout, the weight publish and pull, the batch and fragment
hand-overs, and the trainer's per-step host work (text conditioning of the fragments, the step's
selection program) and the checkpoint save (its blocking part and the asynchronous rest).
Nothing here is fitted to a run's throughput.

Output: {'config', 'overrides', 'machine', 'layouts': {name: {'trainer_devices',
'rollout_devices', 'shared', 'colocated', 'batch', 'fragment', 'seconds': {key: s}}}} with keys
rollout/<n>, reward/<n>, update/<B>, move/<B>, grad/<n>, grad_tsp/<n>, adv/<n>, apply,
tag_rollout/<n>, publish, pull, handover/<n>, encode/<n>, begin, checkpoint_block,
checkpoint; and checkpoint_every (the config's: one save per that many steps).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from digen_jax.process import cli

LAYOUTS = ('colocated', 'sp', 'mp2')
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OUT = flags.DEFINE_string('out', None, 'where the profile JSON goes')
_LAYOUTS = flags.DEFINE_list('layouts', list(LAYOUTS), f'subset of {",".join(LAYOUTS)}')
_FRAGMENTS = flags.DEFINE_integer('fragments', 16, 'M of the fragment programs profiled')
_UNIT = flags.DEFINE_enum('fragment_unit', 'group', ['group', 'sample'], 'fragment unit')
_DEVICES = flags.DEFINE_integer('devices_per_process', 1, 'D (colocated and sp get 2*D)')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'timed calls per program (median kept)')
FRAGMENT_GRADS = ('plain', 'tsp')
_GRADS = flags.DEFINE_list(
    'fragment_grads',
    list(FRAGMENT_GRADS),
    'the fragment gradients to time: plain (grad/<n>, the gap rung) and/or tsp (grad_tsp/<n>, '
    'the tsp, tag and tcss rungs); each compiles for seconds',
)
_CHILD = flags.DEFINE_string('child', None, 'internal: the layout this process profiles')


def _timed(fn, repeats: int) -> tuple[float, list]:
  """(median seconds of fn() over `repeats` calls after one warm-up call (it compiles), the
  timed calls' results)."""
  fn()
  times, results = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    results.append(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), results


def _median_time(fn, repeats: int) -> float:
  """Median seconds of fn() over `repeats` calls after one warm-up call (it compiles)."""
  return _timed(fn, repeats)[0]


def _layout_config(config, layout: str, fragments: int, unit: str):
  config = config.copy_and_resolve_references()
  with config.unlocked():
    if layout == 'colocated':
      config.runtime.mode = 'colocated'
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
  """Times the programs of `layout` in this process (and its peer, for mp2); of the fragment
  gradients, those in `fragment_grads` (see the flag). `workdir` takes the runs' checkpoints."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import fragment_trainer  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import fragments as frag_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import publish  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import rollout as rollout_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import trace as trace_lib  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import transfer  # pylint: disable=g-import-not-at-top
  from digen_jax.runtime import workers  # pylint: disable=g-import-not-at-top
  from digen_jax import programs  # pylint: disable=g-import-not-at-top

  from digen_jax.process import compile_cache  # pylint: disable=g-import-not-at-top

  info = distributed.maybe_initialize()
  compile_cache.enable()  # the runs it predicts then start from the same compiled programs
  config = _layout_config(config, layout, fragments, unit)
  multi = info.num_processes > 1
  if layout == 'colocated':
    cluster = cluster_lib.colocated(jax.local_devices())
  else:
    cluster = cluster_lib.resolve(config)
  exp = cli.build_experiment(config, workdir, max(cluster.rollout.size, cluster.trainer.size))
  me = info.process_id
  is_trainer = not multi or cluster.role_of(me) == 'trainer'
  is_rollout = not multi or cluster.role_of(me) == 'rollout'
  level = 'allow'
  tracer = trace_lib.Tracer(False)
  plan = frag_lib.plan_of(config)
  B, n = plan.batch, plan.size
  prompts = exp.prompts.next_batch()
  batch_prompts = [p for p in prompts for _ in range(plan.group_size)]
  out: dict[str, float] = {}
  chan = (
      transfer.Channel(
          cluster.rollout.process if is_trainer else cluster.trainer.process, name='profile'
      )
      if multi
      else None
  )

  def barrier(name):
    if multi:
      distributed.barrier(f'digen/profile/{name}', timeout_s=1800)

  rollout_sh = publish.rollout_param_shardings(cluster, exp.params)
  dtype = publish.rollout_param_dtype(cluster)
  if is_trainer:
    run = steps_lib.TrainerRun(exp, workdir, cluster, tracer)
    trainer = run.trainer
  if is_rollout:
    policy = publish.publish_local(exp.params, 0, rollout_sh, dtype)
    rollout = workers.RolloutWorker(
        exp,
        cluster.rollout.mesh,
        rollout_sh,
        level,
        frozen_fsdp=publish.rollout_frozen_fsdp(cluster),
    )
  if is_rollout and layout != 'colocated':
    sampler = rollout_lib.FragmentSampler(
        exp,
        cluster.rollout.mesh,
        rollout_sh,
        plan,
        'rollout',
        tracer,
        level,
        dtype,
        frozen_fsdp=publish.rollout_frozen_fsdp(cluster),
    )

  # Compile what needs no input from the other process before the first barrier, side by side:
  # the fragment samplers compile as they are built (the trainer's is TAG's), the update from
  # the batch's abstract layout, the full-batch rollout on its first call (the timed loops'
  # warm-up calls then run them compiled).
  if is_trainer:
    trainer.compile_update()
    if layout != 'colocated':
      tag = rollout_lib.FragmentSampler(
          exp, cluster.trainer.mesh, trainer.param_shardings, plan, 'trainer', tracer, level
      )
  if is_rollout:
    rollout.generate(policy, prompts, 0, tracer)

  # ---- the full-batch programs of the synchronous loops (M = 1).
  barrier('full')
  if is_rollout:
    out[f'rollout+reward/{B}'], samples = _timed(
        lambda: rollout.generate(policy, prompts, 0, tracer), repeats
    )
    out[f'reward/{B}'] = statistics.median(s.reward_s for s in samples)
    out[f'rollout/{B}'] = statistics.median(s.rollout_s for s in samples)
    full_batch = samples[-1].batch
  barrier('full_rollout')
  batch_abstract = workers.abstract_batch(exp)
  if multi:
    if is_rollout:
      for _ in range(repeats + 1):
        publish.send_batch(chan, full_batch, {})
        chan.wait_delivered(publish.BATCH_TAG)
    else:
      ab = workers.with_shardings(batch_abstract, trainer.batch_shardings)
      moves = [publish.receive_batch(chan, ab) for _ in range(repeats + 1)]
      out[f'move/{B}'] = statistics.median(m[2] for m in moves[1:])
      trainer_batch = moves[-1][0]
  else:

    def move():
      return jax.block_until_ready(publish.move_batch_local(full_batch, trainer.batch_shardings))

    out[f'move/{B}'] = _median_time(move, repeats)
    trainer_batch = move()
  barrier('full_move')
  if is_trainer:
    out[f'update/{B}'] = _median_time(
        lambda: trainer.train_step(trainer_batch, batch_prompts, 0, tracer), repeats
    )
    # The checkpoint each step ends with (config.checkpoint_every): what the save call blocks,
    # then the asynchronous rest (serialization, compression, commit, digest) on this core,
    # which in a run competes with the next step's programs.
    every, blocks, rests = config.checkpoint_every, [], []
    for k in range(1, repeats + 2):
      t0 = time.perf_counter()
      trainer.save(k * every, 0)
      t1 = time.perf_counter()
      trainer.checkpointer.wait()
      blocks.append(t1 - t0)
      rests.append(time.perf_counter() - t1)
    out['checkpoint_block'] = statistics.median(blocks[1:])
    out['checkpoint'] = statistics.median(rests[1:])
  barrier('full_update')

  # ---- the weight publish (trainer) and pull (rollout).
  if multi:
    if is_trainer:
      sends = []
      for v in range(repeats + 1):
        t0 = time.perf_counter()
        publish.send_weights(chan, trainer.params, v, dtype)
        sends.append(time.perf_counter() - t0)
        chan.wait_delivered(publish.WEIGHTS_TAG)
      out['publish'] = statistics.median(sends[1:])
    else:
      ab = transfer.abstract(exp.params, rollout_sh, dtype)
      pulls = [publish.receive_weights(chan, ab)[1] for _ in range(repeats + 1)]
      out['pull'] = statistics.median(pulls[1:])
  else:
    out['publish'] = _median_time(
        lambda: jax.block_until_ready(
            publish.publish_local(trainer.params, 1, rollout_sh, dtype).params
        ),
        repeats,
    )
    out['pull'] = 0.0
  barrier('weights')

  # ---- the fragment programs of the pipelined schedule (M = plan.num; disagg only).
  if layout == 'colocated':
    return {
        'trainer_devices': cluster.trainer.size,
        'rollout_devices': cluster.rollout.size,
        'shared': True,
        'colocated': True,
        'batch': B,
        'fragment': n,
        'fragments': plan.num,
        'group_size': plan.group_size,
        'checkpoint_every': config.checkpoint_every,
        'seconds': out,
    }
  if is_rollout:
    frags = [
        sampler.sample(policy.params, 0, batch_prompts, 0, f % plan.num) for f in range(repeats + 1)
    ][1:]
    out[f'rollout/{n}'] = statistics.median(f.sample_s for f in frags)
    out[f'reward/{n}'] = statistics.median(f.reward_s for f in frags)
    frag = frags[0]
  barrier('frag_rollout')
  traj_shardings = programs.trajectory_shardings(cluster.trainer.mesh)
  if multi:
    if is_rollout:
      for _ in range(repeats + 1):
        chan.send(frag.traj, 'frag')
        chan.wait_delivered('frag')
    else:
      ab = workers.with_shardings(
          rollout_lib.abstract_fragment(exp, plan, traj_shardings), traj_shardings
      )
      pulls = [chan.receive_full(ab, 'frag') for _ in range(repeats + 1)]
      out[f'handover/{n}'] = statistics.median(d.pull_s for d in pulls[1:])
      traj = pulls[-1].tree
  else:

    def hand_over():
      return jax.block_until_ready(jax.device_put(frag.traj, traj_shardings))

    out[f'handover/{n}'] = _median_time(hand_over, repeats)
    traj = hand_over()
  barrier('frag_move')
  if is_trainer:
    rewards = np.zeros((B,), np.float32) if multi else np.resize(frag.rewards, B)
    cond = None
    for tsp in [g == 'tsp' for g in FRAGMENT_GRADS if g in fragment_grads]:
      ft = fragment_trainer.FragmentTrainer(exp, trainer, plan, tsp)
      indices, acc = ft.begin(0)
      cond = ft.encode(plan.prompts(0, batch_prompts))
      adv = ft.advantages(0, rewards)
      state = {'acc': acc}  # the gradient accumulator is donated: thread it through

      def grad():
        state['acc'] = jax.block_until_ready(ft.grad(state['acc'], indices, traj, cond, *adv))

      out[f'{"grad_tsp" if tsp else "grad"}/{n}'] = _median_time(grad, repeats)
    out[f'adv/{n}'] = _median_time(
        lambda: jax.block_until_ready(ft.advantages(0, rewards)), repeats
    )
    out[f'encode/{n}'] = _median_time(lambda: ft.encode(plan.prompts(0, batch_prompts)), repeats)
    out['begin'] = _median_time(lambda: jax.block_until_ready(ft.begin(0)), repeats)
    applies = []
    for _ in range(repeats + 1):  # apply donates the accumulator: a fresh one each time
      acc = jax.block_until_ready(ft.grad(ft.begin(0)[1], indices, traj, cond, *adv))
      t0 = time.perf_counter()
      jax.device_get(ft.apply(acc))
      applies.append(time.perf_counter() - t0)
    out['apply'] = statistics.median(applies[1:])
    tags = [
        tag.sample(trainer.params, 0, batch_prompts, 0, f % plan.num) for f in range(repeats + 1)
    ][1:]
    out[f'tag_rollout/{n}'] = statistics.median(f.sample_s for f in tags)
    out[f'tag_reward/{n}'] = statistics.median(f.reward_s for f in tags)
  barrier('done')
  if multi:
    if is_rollout:
      distributed.kv_set('digen/profile/rollout', json.dumps(out))
      return {}
    out.update(json.loads(distributed.kv_get('digen/profile/rollout', 600)))
  return {
      'trainer_devices': cluster.trainer.size,
      'rollout_devices': cluster.rollout.size,
      'shared': layout == 'sp',
      'colocated': layout == 'colocated',
      'batch': B,
      'fragment': n,
      'fragments': plan.num,
      'group_size': plan.group_size,
      'checkpoint_every': config.checkpoint_every,
      'seconds': out,
  }


def _child_command(layout: str, argv: list[str], out: str) -> tuple[list[str], dict]:
  """argv and environment of the processes that profile `layout`."""
  d = _DEVICES.value
  words = [a for a in argv[1:] if not a.startswith(('--out', '--layouts', '--child'))]
  cmd = [sys.executable, '-m', 'digen_jax.sim.profile', *words, f'--child={layout}', f'--out={out}']
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
  return launcher + ['--num_processes=1', f'--devices_per_process={2 * d}', '--'] + cmd, env


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


def main(argv):
  config, _ = cli.config_and_workdir()
  if _CHILD.value:
    # The timed checkpoints (tens of MB) go to a folder removed on the way out.
    with tempfile.TemporaryDirectory(prefix='digen_profile_') as workdir:
      result = profile_child(
          _CHILD.value,
          config,
          workdir,
          _FRAGMENTS.value,
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
  if _REPEATS.value < 1 or _FRAGMENTS.value < 1 or _DEVICES.value < 1:
    cli.fail('--repeats, --fragments and --devices_per_process must be >= 1')
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
