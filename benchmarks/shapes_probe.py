"""Does a ShapesBench generator listen to the shape word? A quick probe of a params folder.

  python benchmarks/shapes_probe.py [--params assets/shapes_latent_base] [--png OUT.png] [--json OUT.json]

Two measurements, both with fixed noise (seconds on the CPU, no training):
  * denoising: ground-truth single objects on white are noised to σ and denoised in one step
    (x̂0 = x_σ − σ·v); reported are the x̂0 MSE and how much x̂0 moves when only the shape word
    ("square" <-> "circle") or only the colour word of the prompt changes. A model that ignores the
    shape word moves ~0 for the shape swap; `shape_to_color_sensitivity` is the ratio of the two
    (mean over σ).
  * generation: "a <colour> <shape> on a white background" for 2 colours x 3 shapes x 8 noises,
    sampled with the config's ODE (10 Euler steps, shift 3); reported per prompted shape: the
    shapes the checker sees (circle/square/triangle/none) and the strict pass rate, plus the mean
    |image(square prompt) − image(circle prompt)| for the same noise.
--png saves the generated grid (rows = prompts, columns = noises).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs import shapes_pretrain  # noqa: E402
from digen_jax.experiment import build as experiment  # noqa: E402
from digen_jax.experiment import config as configlib  # noqa: E402
from digen_jax.outputs import visualize  # noqa: E402
from digen_jax.tasks.shapes import pretrain  # noqa: E402
from digen_jax.tasks.shapes import render  # noqa: E402
from digen_jax.models.io import params_io  # noqa: E402
from digen_jax.tasks.shapes import checker as shapes_checker  # noqa: E402

COLORS = ('red', 'blue')
SHAPES = ('circle', 'square', 'triangle')
SIGMAS = (0.2, 0.4, 0.6, 0.8)


def _prompt(color: str, shape: str) -> str:
  return f'a {color} {shape} on a white background'


def probe(params_dir: str, noises: int = 8, seed: int = 0) -> tuple[dict, np.ndarray, list[str]]:
  """Returns (report, generated images [6*noises, H, W, 3], their prompts)."""
  c = shapes_pretrain.get_config()
  folder = experiment.checkpoint_folder(params_dir, '--params')
  model = params_io.load_model(folder)
  mcfg = model.config
  graphdef, params = nnx.split(model)
  with open(os.path.join(folder, 'config.json')) as f:
    extra = json.load(f).get('extra', {})
  encoder = experiment.build_text_encoder(c)
  # The latent space the checkpoint was trained in (pretrain records it), else the config's.
  lat = extra.get('latent', {})
  c.latent.space, c.latent.ae = lat.get('space', 'pixel'), lat.get('ae', '')
  c.latent.height = c.latent.width = int(lat.get('height', c.latent.height))
  c.latent.channels = int(lat.get('channels', c.latent.channels))
  c.model.patch_size = patch = int(mcfg.patch_size)
  size = int(lat.get('image_size', c.latent.height))
  grid = int(c.latent.height)
  shape = (1, grid // patch, grid // patch)
  codec = pretrain.latent_codec(c)
  report: dict = {'params': params_dir, 'pooled_text': bool(mcfg.pooled_text)}

  @jax.jit
  def velocity(params, x_t, sigma, emb, mask):
    return nnx.merge(graphdef, params)(x_t, sigma, emb, mask, img_shape=shape)

  def x0_hat(x_t, sigma, prompts):
    emb, mask = encoder.encode(prompts)
    v = velocity(
        params,
        x_t,
        jnp.full((len(prompts),), sigma, jnp.float32),
        jnp.asarray(emb),
        jnp.asarray(mask),
    )
    return x_t - sigma * v

  # Denoising of ground truth, and sensitivity of x̂0 to the shape word and to the colour word.
  rng = np.random.default_rng(seed)
  gt_prompts = [_prompt(col, s) for col in COLORS for s in ('square', 'circle')] * 4
  gt = np.stack([render.render(p, size, rng) for p in gt_prompts])
  x0 = codec.to_tokens(codec.params, jnp.asarray(gt))
  shape_swapped = [
      p.replace('square', 'X').replace('circle', 'square').replace('X', 'circle')
      for p in gt_prompts
  ]
  color_swapped = [
      p.replace('red', 'X').replace('blue', 'red').replace('X', 'blue') for p in gt_prompts
  ]
  rows = []
  for i, s in enumerate(SIGMAS):
    eps = jax.random.normal(jax.random.key(seed + 1 + i), x0.shape, jnp.float32)
    x_t = (1.0 - s) * x0 + s * eps
    ref = x0_hat(x_t, s, gt_prompts)
    rows.append(
        {
            'sigma': s,
            'x0_mse': float(jnp.mean((ref - x0) ** 2)),
            'shape_swap_abs': float(jnp.mean(jnp.abs(x0_hat(x_t, s, shape_swapped) - ref))),
            'color_swap_abs': float(jnp.mean(jnp.abs(x0_hat(x_t, s, color_swapped) - ref))),
        }
    )
  report['denoising'] = rows
  # How much the shape word moves x̂0 relative to the colour word (1 = as much; ~0 = ignored).
  report['shape_to_color_sensitivity'] = float(
      np.mean([r['shape_swap_abs'] for r in rows])
      / max(np.mean([r['color_swap_abs'] for r in rows]), 1e-12)
  )

  # Generation with the config's ODE; the same noises for every prompt.
  sample = pretrain.make_sampler(
      graphdef, experiment.build_schedule(c, shape[1] * shape[2]), shape, codec.to_images
  )
  prompts = [_prompt(col, s) for col in COLORS for s in SHAPES]
  texts = [p for p in prompts for _ in range(noises)]
  x1 = jax.random.normal(
      jax.random.key(seed + 100), (noises, shape[1] * shape[2], mcfg.in_channels)
  )
  x1 = jnp.tile(x1, (len(prompts), 1, 1))
  emb, mask = encoder.encode(texts)
  imgs = np.asarray(
      sample(params, codec.params, x1, jnp.asarray(emb), jnp.asarray(mask), jax.random.key(0))
  )
  gen = {}
  for i, p in enumerate(prompts):
    col, want = p.split()[1], p.split()[2]
    seen = {k: 0 for k in SHAPES + ('none',)}
    for img in imgs[i * noises : (i + 1) * noises]:
      scene = shapes_checker.analyze(img)
      blobs = scene.blobs.get(col, []) if scene is not None else []
      seen[blobs[0].shape if blobs else 'none'] += 1
    strict = shapes_checker.shapes_strict(
        imgs[i * noises : (i + 1) * noises], texts[i * noises : (i + 1) * noises]
    )
    g = gen.setdefault(want, {'seen': {k: 0 for k in seen}, 'strict': []})
    for k, n in seen.items():
      g['seen'][k] += n
    g['strict'].append(float(strict.mean()))
  for g in gen.values():
    g['strict'] = float(np.mean(g['strict']))
  report['generation'] = gen
  per = imgs.reshape(len(COLORS), len(SHAPES), noises, *imgs.shape[1:])
  report['square_vs_circle_image_abs'] = float(np.abs(per[:, 1] - per[:, 0]).mean())
  report['color_swap_image_abs'] = float(np.abs(per[0] - per[1]).mean())
  return report, imgs, texts


def main() -> None:
  ap = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument(
      '--params',
      default=configlib.SHAPES_LATENT_BASE_CHECKPOINT,
      help="params folder (default: the main job's base)",
  )
  ap.add_argument('--noises', type=int, default=8, help='generated samples per prompt')
  ap.add_argument('--png', default='', help='save the generated grid here')
  ap.add_argument('--json', default='', help='save the report here')
  args = ap.parse_args()
  report, imgs, texts = probe(args.params, args.noises)
  print(json.dumps(report, indent=1))
  if args.png:
    visualize.save_grid(args.png, imgs, texts, cols=args.noises)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  main()
