"""Small repository checks used by pre-commit and the test suite."""
