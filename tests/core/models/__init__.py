"""Tests of core/models."""
