"""Weight interpolation of two params folders of one architecture (a "model soup").

  python benchmarks/interpolate_params.py A B --alpha=0.5 --out=DIR

Writes (1 - alpha) * A + alpha * B to DIR (params_io format; `extra` is B's less the measurements
of B's own weights, 'final_eval' and 'loss', with the two sources and alpha recorded under
extra['interpolated']). Meant for a fine-tune B of A: the straight line
between them trades what B gained for what it lost (e.g. a count-weighted continuation of the
ShapesBench base counted better and listened less to the shape word of held-out pairs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402

from digen_jax.models.io import params_io  # noqa: E402


def interpolate(a: str, b: str, alpha: float, out: str) -> str:
  """Saves (1 - alpha) * params(a) + alpha * params(b) to `out`; returns `out`."""
  if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
    raise ValueError(f'--alpha={alpha!r} must be in [0, 1] (0 = A, 1 = B)')
  cfg_a, params_a, _ = params_io.load_params(a)
  cfg_b, params_b, extra = params_io.load_params(b)
  if cfg_a != cfg_b:
    raise ValueError(f'{a} and {b} hold different architectures: {cfg_a} vs {cfg_b}')
  mixed = jax.tree.map(lambda x, y: (1.0 - alpha) * x + alpha * y, params_a, params_b)
  # B's eval and loss describe B's weights, not these.
  extra = {k: v for k, v in extra.items() if k not in ('final_eval', 'loss')}
  extra['interpolated'] = {'a': a, 'b': b, 'alpha': alpha}
  return params_io.save_params(out, mixed, cfg_b, extra)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('a', help='params folder at alpha = 0')
  ap.add_argument('b', help='params folder at alpha = 1')
  ap.add_argument('--alpha', type=float, required=True, help='weight of B, in [0, 1]')
  ap.add_argument('--out', required=True, help='folder to write')
  args = ap.parse_args(argv)
  print(interpolate(args.a, args.b, args.alpha, args.out))


if __name__ == '__main__':
  main()
