"""Rewards: the name -> function registry (registry.py) and the generic pure-code rewards
(jpeg.py). A task's own rewards live with the task (tasks/shapes/checker.py) and register
themselves under their names; registry.py loads the built-in ones on first use."""
