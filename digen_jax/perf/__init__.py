"""Cost model of digen_jax's programs: XLA's own FLOP, byte and memory analyses of the real
compiled programs on fake devices (costs.py), accelerator figures (hardware.py) and a roofline
time model (timing.py)."""
