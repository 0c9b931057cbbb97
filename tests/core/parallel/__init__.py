"""Tests of core/parallel."""
