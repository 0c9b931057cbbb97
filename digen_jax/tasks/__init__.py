"""The tasks: what a run learns, plugged into the core through its registries. Importing this
package registers every built-in task's parts (the entry points do; so does whoever builds a
run of a task in-process):

  shapes       ShapesBench: prompt set 'shapes_bench' (alias 'shapes'), rewards 'shapes',
               'shapes_dense', 'shapes_strict', 'shapes_strict_atoms', eval metrics (strict
               accuracy), the word encoder's vocabulary 'word', latent space 'ae'
  text_render  prompt set 'text_render' (alias 'text'), scored by the core's OCR reward

The core never imports this package: a config naming a prompt set, reward, vocabulary or latent
space that no task registered is one error naming the field and the registered names.
"""

from digen_jax.tasks.shapes import checker as _checker  # noqa: F401  (registers its rewards)
from digen_jax.tasks.shapes import eval_metrics as _eval_metrics  # noqa: F401
from digen_jax.tasks.shapes import latent_space as _latent_space  # noqa: F401
from digen_jax.tasks.shapes import prompts as _shapes_prompts  # noqa: F401
from digen_jax.tasks.shapes import vocabulary as _vocabulary  # noqa: F401
from digen_jax.tasks.text_render import prompts as _text_render_prompts  # noqa: F401
