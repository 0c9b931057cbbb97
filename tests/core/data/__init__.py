"""Tests of core/data."""
