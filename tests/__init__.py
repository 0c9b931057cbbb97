"""The test suite: tests/helpers/ holds what several test files share; tests/run.py runs it."""
