"""Make the repository root importable, so `bench` (plain scripts, not installed) imports."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
