"""The embedded default task: GRPO on ShapesBench from the shipped base generator, on a CPU.

  python -m digen_jax.main --config=configs/shapes.py --workdir=/tmp/shapes
  python -m digen_jax.main --config=configs/shapes.py:jpeg --workdir=/tmp/jpeg   # DDPO's JPEG reward
  python launch/local.py --num_processes=2 -- \
      python -m digen_jax.main --config=configs/shapes.py:disagg --workdir=/tmp/shapes_disagg

The base model (assets/shapes_base, made by configs/shapes_pretrain.py) follows prompts only
partly; the reward is the pure-code checker's partial credit; eval is strict accuracy on the
held-out eval compositions with deterministic ODE sampling.
"""
import ml_collections

from digen_jax import configlib


def get_config(arg: str | None = None):
  c = configlib.base_config()
  configlib.shapes_base(c)
  c.total_steps = 150
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.rl.adv_std = 'group'
  c.rl.clip_range = 1e-3
  c.rl.timesteps = 'random_fraction'  # 4 of the 9 stochastic steps per update: half the cost
  c.rl.timestep_fraction = 0.5
  c.optim.lr = 6e-5                   # 3e-4 collapses the 1.9M-param model within 20 steps
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.eval.every = 25
  c.eval.samples_per_prompt = 2
  c.eval.batch_size = 100
  c.sample_grid_every = 25
  c.checkpoint_every = 25

  variants = [v for v in (arg or '').split(',') if v]
  for v in variants:
    if v == 'jpeg':
      c.reward.weights = ml_collections.ConfigDict({'jpeg_compressibility': 1.0})
      c.total_steps = 40
      c.eval.every = 20
    elif v == 'disagg':
      # Rollout and trainer on their own meshes ('auto' layout: 2 processes -> one role each;
      # 1 process -> half of its devices each); same math as the colocated default.
      configlib.set_disagg(c)
    else:
      raise ValueError(f'configs/shapes.py: unknown variant {v!r}; known: jpeg, disagg '
                       '(comma-separated, e.g. :jpeg,disagg)')
  return c
