"""Tests of tasks/text_render."""
