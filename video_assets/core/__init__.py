"""Pure logic of every stage: no Dagster import here or below (``tests/test_layout.py`` enforces it),
so each rule is testable without an instance."""
