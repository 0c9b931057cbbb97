"""Tests of tasks/shapes."""
