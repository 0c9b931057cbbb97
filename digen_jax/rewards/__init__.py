"""Rewards: the name -> function registry (registry.py) and the generic pure-code rewards
(jpeg.py, video.py), loaded on first use; the eval metrics that tasks add beside the reward
(eval_metrics.py). A task's own rewards live with the task (tasks/shapes/checker.py) and register
themselves under their names when digen_jax.tasks is imported."""
