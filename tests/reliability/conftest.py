"""Make the repository root importable: the scenarios live in `bench/reliability` (not installed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
