"""Docs, README, changelog and code say what the software does and why, never how the work was done.

A diary word ("the fifth sit-ting", "iss-ue 15's row", "the GPU l-ent to us", "this ta-sk", "other
age-nts' test suites", a work sess-ion) tells a reader about its authors' day, not about pagelab. The
domain's own words are content and are allowed by pattern where they occur: a chat session, BurstGPT's
`Session ID` column, pytest's `scope="session"`, Mooncake's toolagent trace.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagelab", "simulator", "traces", "viz", "gpu_backend", "cli", "bench", "tests", "docs")
TEXT_FILES = ("README.md", "CHANGELOG.md", "mkdocs.yml", "Makefile", "pyproject.toml")

# Written so that this file does not match itself (`t{2}`, `[e]`).
DIARY = {
    "sit*ing": r"\bsit{2}ings?\b",
    "issue N": r"\bissues?[ -]?#?\d+|(?<![\w&#/])#\d{1,3}\b(?![\w-])",
    "l*nt": r"\bl[e]nt\b",
    "this t*sk": r"\bthis tas[k]\b",
    "other ag*nts": r"\bother agen[t]s?\b|\bagen[t]s'",
    "sess*on": r"\bsess[i]ons?\b",
    "time of day": r"\b(?:this|that|the same) (?:morni[n]g|aftern[o]on|eveni[n]g|nig[h]t)\b",
    "kind of day": r"\b(?:a|the|on) (?:slow|fast|quiet) da[y]s?\b",
}
# Domain words that contain a diary word: each pattern covers the match it allows, and nothing wider.
ALLOWED = (
    r"\bchat sess[i]ons?\b",
    r"\bconversation sess[i]ons?\b",
    r"\bSess[i]on ID\b",
    r"""scope=["']sess[i]on["']""",
    r"\bdebugging sess[i]ons\b",
    r'\bsess[i]on = "," in header',  # BurstGPT files with or without the Session ID column
    r"\bif sess[i]on else\b",
)


def diary_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, line) for each diary word in `text` that no ALLOWED pattern covers."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [m.span() for p in ALLOWED for m in re.finditer(p, line, re.I)]
        for rule, pattern in DIARY.items():
            for m in re.finditer(pattern, line, re.I):
                if not any(a <= m.start() and m.end() <= b for a, b in allowed):
                    found.append((number, rule, line.strip()))
    return found


def _tracked(*patterns: str) -> list[Path]:
    """Files git tracks (or would add) matching the pathspecs; outside git, the same by globbing."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *patterns], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        return sorted(ROOT / p for p in out if (ROOT / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        return sorted({p for pat in patterns for p in ROOT.glob(pat) if p.is_file()})


def _report(paths: list[Path]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: [{rule}] {line[:160]}"
            for p in paths for n, rule, line in diary_lines(p.read_text(encoding="utf-8"))]


def doc_files() -> list[Path]:
    """Markdown and project text files: the docs, README, changelog, data notes, build files."""
    return [p for p in _tracked("*.md", "**/*.md", *TEXT_FILES) if ".venv" not in p.parts]


def code_files() -> list[Path]:
    """Every .py file of the project's packages and tests."""
    return _tracked(*(f"{pkg}/**/*.py" for pkg in PACKAGES))


@pytest.mark.parametrize(("line", "rule"), [
    ("Eighth sit" "ting (2026-11-24): 1M in 58 s", "sit*ing"),
    ("see iss" "ue 15's row", "issue N"),
    ("Where #" "15 stands", "issue N"),
    ("the first GPU l" "ent to us", "l*nt"),
    ("as this ta" "sk asks", "this t*sk"),
    ("while other age" "nts' test suites ran", "other ag*nts"),
    ("the GPU sess" "ion ran the profile", "sess*on"),
    ("measured this after" "noon", "time of day"),
    ("on a slow d" "ay the VM ran 2x slower", "kind of day"),
])
def test_diary_words_are_found(line, rule):
    assert [r for _, r, _ in diary_lines(line)] == [rule]


@pytest.mark.parametrize("line", [
    "a chat sess" "ion of Mooncake's conversation trace",
    "Mooncake's toolagent trace",
    "Timestamp,Sess" "ion ID,Elapsed time,Model",
    '@pytest.fixture(scope="sess' 'ion")',
    "subprocess.Popen(args, start_new_sess" "ion=True)",
    "colour #000000 and #0072B2",
    "PR #" "12a is a hash, 1.0 MiB is not a #",
])
def test_domain_words_are_allowed(line):
    assert diary_lines(line) == []


def test_docs_say_what_the_software_does():
    files = doc_files()
    assert any(p.name == "README.md" for p in files)
    hits = _report(files)
    assert not hits, "text that tells how the work was done:\n" + "\n".join(hits)


def test_code_says_what_it_does():
    files = code_files()
    assert len(files) > 100
    hits = _report(files)
    assert not hits, "code that tells how the work was done:\n" + "\n".join(hits)
