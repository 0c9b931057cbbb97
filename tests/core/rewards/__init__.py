"""Tests of core/rewards."""
