"""Tests of core/process."""
