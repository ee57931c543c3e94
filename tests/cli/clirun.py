"""Run `pagelab ARGS` in a fresh Python process, as a user would (works from a fresh clone: PYTHONPATH)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: the repo on PYTHONPATH, a wide console unless COLUMNS is set."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    e.setdefault("COLUMNS", "400")
    return e


def pagelab(*args, cwd: Path | None = None, timeout: float = 120, **extra_env: str):
    """`pagelab ARGS` -> CompletedProcess with text stdout/stderr."""
    return subprocess.run([sys.executable, "-c", "from cli import main; main()", *map(str, args)],
                          cwd=cwd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)


def start(*args, cwd: Path | None = None, **extra_env: str) -> subprocess.Popen:
    """`pagelab ARGS` started in the background (for signals)."""
    return subprocess.Popen([sys.executable, "-c", "from cli import main; main()", *map(str, args)],
                            cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def one_line_error(result, code: int = 2) -> str:
    """Assert a user error: exit `code`, no traceback, one `error:` line; return that line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]
