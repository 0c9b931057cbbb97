"""Tests of core/outputs."""
