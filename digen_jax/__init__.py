"""digen_jax: GRPO post-training of flow-matching image/video generators in JAX."""
