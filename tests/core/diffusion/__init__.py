"""Tests of core/diffusion."""
