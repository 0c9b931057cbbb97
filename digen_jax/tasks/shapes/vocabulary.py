"""The word encoder's vocabulary for ShapesBench (config.text.encoder='word', models/text/encoders.py):
the grammar's words, registered on import."""

from digen_jax.models.text import encoders as text_lib
from digen_jax.tasks.shapes import grammar

text_lib.register_vocabulary('word', grammar.grammar_words)
