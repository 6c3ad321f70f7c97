"""The reliability scenarios (bench/reliability, importable through pytest's `pythonpath`); their
full-size variants are marked slow and run with `pytest -m slow tests/reliability`."""
