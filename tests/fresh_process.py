"""Running a test's script in a fresh Python process (allocator and Arrow pool settings from scratch)."""
from __future__ import annotations

import subprocess
import sys


def run_script(script: str, *args: object, env: dict[str, str] | None = None) -> str:
    """What `script` prints (stripped), run with `args` as its argv in a fresh process."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         check=True, env=env)
    return out.stdout.strip()
