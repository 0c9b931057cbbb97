"""Attention: the one attention function and its implementations (kernels), and
the same attention with each sample's tokens split over devices (sequence_parallel)."""
