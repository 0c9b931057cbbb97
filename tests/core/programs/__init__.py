"""Tests of core/programs."""
