"""Weights in and out: diffusers checkpoints read (tensor sources, streaming onto meshes,
each family's key table), our params folders, diffusers export, random initialization."""
