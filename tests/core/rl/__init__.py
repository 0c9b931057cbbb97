"""Tests of core/rl."""
