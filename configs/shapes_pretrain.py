"""Pretraining of the ShapesBench base generator (flow matching, CPU-sized), and `:test`.

  python -m digen_jax.tasks.shapes.pretrain --config=configs/shapes_pretrain.py --workdir=/tmp/shapes_pre
  python -m digen_jax.tasks.shapes.pretrain --config=configs/shapes_pretrain.py:test --workdir=/tmp/x
  python -m digen_jax.tasks.shapes.pretrain --config=configs/shapes_pretrain.py:ae --workdir=/tmp/gen \
      [--config.latent.ae=AE/params]  # the latent-space base (default AE: assets/shapes_ae)

`pretrain.caption_noise` trains on a share of pairs whose caption is wrong in one attribute
(a count, the relation, or which object has which shape; `grammar.miscaption`), so a base that
draws every concept binds them to the prompt unreliably: the regime RL post-training works in.

The `model`, `latent`, `text` and `sampler` fields are the ones the ShapesBench RL config reuses:
`:ae` made assets/shapes_latent_base, the main job's base (configs/shapes.py; how, in the README
beside it), and the default variant made assets/shapes_base, the `configs/shapes.py:pixel` base
(`apply_shapes_base(c)` sets an RL config's fields to exactly its own).

Design of the default variant (measured on the 2-core CPU, see assets/shapes_base/README.md):
  * 16x16 RGB pixel space, patch 2 -> 64 image tokens of 12 channels; identity decoder
    (configlib.shapes_base holds the architecture; the RL config uses the same function).
  * MMDiT with 3 double-stream blocks, 4 heads x 32 = 128 wide, ~1.9M params.
  * Frozen word encoder, dim 64 = joint_attention_dim, 16 tokens. Its table is seeded by
    config.text.seed (experiment.build_text_encoder), so an RL run must keep text.seed=0 (its own
    config.seed is free); the checkpoint records a digest of the table to catch a mismatch.
  * No CFG: trained without text dropout; RL samples with guidance_scale=0.
"""

import ml_collections

from digen_jax.experiment import config as configlib

SHAPES_BASE_CHECKPOINT = 'assets/shapes_base'
VARIANTS = ('ae', 'test')


def apply_shapes_base(c: ml_collections.ConfigDict, *, checkpoint: str = SHAPES_BASE_CHECKPOINT):
  """Sets model/latent/text/sampler of `c` to the ShapesBench base generator's (in place)."""
  return configlib.shapes_base(c, checkpoint=checkpoint)


def get_config(arg: str | None = None):
  c = configlib.base_config()
  c.seed = 0
  apply_shapes_base(c, checkpoint='')  # pretraining starts from random init

  p = c.pretrain = ml_collections.ConfigDict()
  p.steps = 3000
  p.batch = 32
  p.lr = 2e-3
  p.warmup = 200
  p.final_lr_frac = 0.1  # cosine decay to lr * final_lr_frac
  p.weight_decay = 0.0
  p.grad_clip = 1.0
  p.ema = 0.999  # 0 = no EMA; eval and saves use the EMA weights when > 0
  p.sigma_sampling = 'uniform'  # 'logit_normal' (SD3) | 'uniform'
  p.logit_mean = 0.0
  p.logit_std = 1.0
  p.sigma_shift = 3.0  # static shift of training sigmas; = sampler.shift
  p.zero_init = True  # adaLN-Zero init of modulations and output (DiT)
  p.init_from = ''  # a params folder to warm-start from (e.g. assets/shapes_base)
  p.text_dropout = 0.0  # > 0 trains the empty prompt too (enables CFG); off: RL uses no CFG
  p.single_fraction = 0.5  # share of single-object prompts per batch (train split is ~7%
  # singles); < 0 = uniform over the split's prompts
  p.single_count_weights = ''  # e.g. '1,2,3': weights of counts 1..3 among singles ('' = equal)
  p.image_size = 16  # must equal latent.height == latent.width
  p.caption_noise = 0.0  # share of pairs whose caption is wrong in one attribute
  p.caption_noise_kinds = 'count,relation,binding'  # grammar.MISCAPTION_KINDS to draw from
  p.data_workers = 0  # processes rendering batches ahead (0 = in the training process)
  p.log_every = 50
  p.eval_every = 500  # 0 = only at the end
  p.eval_prompts = 100  # prompts per split in periodic evals (eval split has 100)
  p.eval_samples = 2  # samples per prompt in periodic evals
  p.final_eval_prompts = 100
  p.final_eval_samples = 8
  p.eval_batch = 200  # images per jitted sampling call
  p.save_every = 500  # 0 = only at the end

  if arg == 'ae':
    # The same MMDiT at patch 1 on the 8 x 8 x 8 latents of a 32 px ShapesBench autoencoder
    # (models/shapes_ae.py: shape and colour channels), caption noise on relations and binding
    # only, so single-object captions stay true (benchmarks/RESULTS.md).
    configlib.shapes_latent_base(c, checkpoint='')
    p.image_size = 32
    p.caption_noise = 0.1
    p.caption_noise_kinds = 'relation,binding'
  elif arg == 'test':
    # A few seconds on a CPU: tiny model on 16x16 images, loss must still fall.
    c.model.num_layers = 1
    c.model.num_attention_heads = 2
    c.model.attention_head_dim = 16
    c.model.axes_dims_rope = (4, 6, 6)
    c.model.joint_attention_dim = 32
    c.latent.height = c.latent.width = 16
    c.sampler.num_steps = 4
    p.image_size = 16
    p.steps = 60
    p.batch = 16
    p.lr = 3e-3
    p.warmup = 5
    p.ema = 0.9
    p.log_every = 10
    p.eval_every = 0
    p.eval_prompts = p.final_eval_prompts = 4
    p.eval_samples = p.final_eval_samples = 2
    p.eval_batch = 8
    p.save_every = 0
  elif arg:
    raise ValueError(
        f'configs/shapes_pretrain.py: unknown variant {arg!r}; known: {", ".join(VARIANTS)}'
    )
  return c
