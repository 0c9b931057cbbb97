"""Tests of core/experiment."""
