"""Reliability scenarios, each against a real `kvstore serve` or store: `tests/reliability/` runs
them small, `bench/chaos.py` full size (docs/reliability.md). Nothing here is installed.
"""
