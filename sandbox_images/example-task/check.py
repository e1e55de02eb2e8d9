"""Example task asset: exits 0 when /workspace/answer.txt holds the expected answer."""

import sys
from pathlib import Path

answer = Path("/workspace/answer.txt")
sys.exit(0 if answer.is_file() and answer.read_text().strip() == "42" else 1)
