"""Reliability scenarios: crash, corruption, full disk, load, hostile input, tenants.

Each module runs one scenario against a real `kvstore serve` subprocess or a real store and
returns its figures; `tests/reliability/` runs them small and asserts, `bench/chaos.py` runs
them full size and prints the README's Reliability table. Nothing here is installed.
"""
