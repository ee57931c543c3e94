"""The docs stay true to the code: every path, test, module and command they name exists and parses.

- docs/cli.md is what docs/gen_cli.py renders from the typer app;
- every file path, test file, test function and dotted module named in docs/, README.md or CHANGELOG.md
  exists (and a dotted name's attribute too);
- every command shown parses with the real parser (pagelab's typer app, the bench modules' argparse,
  the Makefile's targets): a renamed or removed option fails here; the quick tour also runs
  (tests/cli/test_readme_tour.py), and docs/getting-started.md shows the same tour;
- every image in docs/images is shown somewhere, every page is in mkdocs.yml's nav, and docs/ stays small.
(`mkdocs build --strict`, run by `make test`, checks the links between pages and their anchors.)
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("pagelab", "simulator", "traces", "viz", "gpu_backend", "cli", "bench")
TOP_DIRS = (*PACKAGES, "tests", "docs")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md", "CHANGELOG.md", "mkdocs.yml")
MAX_DOCS_BYTES = 120_000
GENERATED = DOCS / "cli.md"
CHANGELOG = ROOT / "CHANGELOG.md"
SHELL_LANGS = ("bash", "sh", "shell", "console")


def pages() -> list[Path]:
    """The Markdown a reader reads: docs/*.md, README.md and CHANGELOG.md."""
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md", CHANGELOG]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)


def code_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)


def code_text(path: Path) -> list[str]:
    """Every piece of code a page shows: block bodies and inline spans."""
    text = _text(path)
    return [body for _, body in fenced_blocks(text)] + code_spans(text)


# ---------------------------------------------------------------- names: paths, tests, modules
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:\.[a-z]+)?$")  # NAME, RUN_DIR, NAME.json
KNOWN_CAPS = {"README.md", "CHANGELOG.md", "SOURCES.md", "Makefile"}


def _tokens(code: str) -> list[str]:
    return [t.strip(".,:;()[]{}'\"") for t in re.split(r"[\s,;()\[\]{}'\"=`|<>]+", code) if t]


def named_paths(code: str) -> list[str]:
    """Repository paths in `code`: TOP_DIR/... or a top-level file; placeholders and globs left out."""
    out = []
    for token in _tokens(code):
        token = token.split("::")[0].split("#")[0]
        first = token.split("/")[0]
        if not (first in TOP_FILES or (first in TOP_DIRS and "/" in token)):
            continue
        if re.search(r"[*?$]", token):
            continue
        if any(PLACEHOLDER.match(part) and part not in KNOWN_CAPS for part in token.split("/")):
            continue
        out.append(token.rstrip("/"))
    return out


def named_test_files(code: str) -> list[str]:
    """Test files named without their folder (`test_engine.py`)."""
    return [t for t in _tokens(code) if re.fullmatch(r"test_\w+\.py", t)]


def named_test_functions(code: str) -> list[str]:
    """Test functions named in `code` (`test_replay_equals_simulation`, or `path.py::test_name`)."""
    names = []
    for token in _tokens(code):
        name = token.split("::")[-1]
        if re.fullmatch(r"test_[a-z0-9_]+", name) and not name.endswith("_"):
            names.append(name)
    return names


def named_modules(code: str) -> list[str]:
    """Dotted names that start with a project package (`bench.calibration`, `traces.load_trace`)."""
    packages = "|".join(PACKAGES)
    pattern = rf"(?<![\w./-])((?:{packages})(?:\.[A-Za-z_]\w*)+)(?![\w/-])"
    return [m for m in re.findall(pattern, code) if not re.search(r"\.(py|md|json|png|parquet)$", m)]


def all_named(kind) -> list[tuple[str, str]]:
    """(page, name) for every name of one kind on the pages that describe the code as it is (the
    changelog also names what was renamed)."""
    return sorted({(str(p.relative_to(ROOT)), name) for p in pages() if p not in (GENERATED, CHANGELOG)
                   for code in code_text(p) for name in kind(code)})


def test_named_paths_exist():
    named = all_named(named_paths)
    assert len(named) > 40
    missing = [f"{page}: {path}" for page, path in named if not (ROOT / path).exists()]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_paths_in_the_commands_help_exist():
    named = {path for code in code_text(GENERATED) for path in named_paths(code)}
    assert named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"paths the commands' help names that do not exist: {missing}"


def test_named_test_files_and_functions_exist():
    test_files = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    files = all_named(named_test_files)
    missing = [f"{page}: {name}" for page, name in files if name not in test_files]
    sources = "\n".join(_text(p) for p in (ROOT / "tests").rglob("*.py"))
    defined = set(re.findall(r"^\s*def (test_\w+)", sources, re.M))
    functions = all_named(named_test_functions)
    assert functions
    missing += [f"{page}: {name}" for page, name in functions if name not in defined]
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(missing)


def _module_file(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(dotted: str) -> str | None:
    """None when `dotted` is a module or a module's attribute chain; else what is missing."""
    parts = dotted.split(".")
    cut = max(c for c in range(1, len(parts) + 1) if _module_file(parts[:c]))
    obj = importlib.import_module(".".join(parts[:cut]))
    for i, attr in enumerate(parts[cut:]):
        if not hasattr(obj, attr):
            return f"{'.'.join(parts[:cut + i])} has no {attr}"
        obj = getattr(obj, attr)
    return None


def test_named_modules_exist():
    named = all_named(named_modules)
    assert len(named) > 10
    missing = [f"{page}: {name}: {problem}" for page, name in named if (problem := _resolve(name))]
    assert not missing, "modules named in the docs that do not exist:\n" + "\n".join(missing)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (what mkdocs links to)."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_resolve():
    readme = _text(ROOT / "README.md")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    bad = []
    for link in links:
        if re.match(r"\w+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            bad.append(link)
        elif anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", _text(target), re.M)
            if anchor not in {slug(h) for h in headings}:
                bad.append(link)
    assert not bad, f"README links to what does not exist: {bad}"


def test_every_image_is_shown_and_exists():
    shown = {m for p in pages() for m in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", _text(p))}
    files = {p.relative_to(ROOT).as_posix() for p in (DOCS / "images").iterdir()}
    used = {("docs/" + s.removeprefix("../docs/")) if s.startswith("images/") else s for s in shown}
    assert files <= used, f"images no page shows: {sorted(files - used)}"
    assert {u for u in used if u.startswith("docs/")} <= files, f"images shown but missing: {used - files}"


def test_docs_stay_small():
    size = sum(len(p.read_bytes()) for p in DOCS.glob("*.md"))
    assert size <= MAX_DOCS_BYTES, f"docs/*.md hold {size:,} bytes (at most {MAX_DOCS_BYTES:,})"


def test_every_page_is_in_the_nav():
    config = yaml.safe_load(_text(ROOT / "mkdocs.yml"))

    def files(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (files(value) if isinstance(value, list) else [value])

    assert sorted(files(config["nav"])) == sorted(p.name for p in DOCS.glob("*.md"))


# ---------------------------------------------------------------- the CLI reference
def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    rendered = _gen_cli().render()
    assert "### `pagelab simulate`" in rendered and "#### `pagelab trace gen`" in rendered
    assert _text(GENERATED) == rendered, "docs/cli.md is out of date: run `python docs/gen_cli.py`"


# ---------------------------------------------------------------- commands
def shell_commands(text: str) -> list[str]:
    """Each command of the page's shell blocks (continuations joined, comments dropped) and each inline
    span that is a command."""
    out = []
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        pending = ""
        for raw in body.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if line and not line.startswith("#"):
                out.append(line)
    out += [s for s in code_spans(text) if re.match(r"(pagelab|make) |python -m bench\.", s)]
    return out


def inline_commands(text: str) -> set[str]:
    """The commands of `text` that are inline spans (prose may name a command with some of its options)."""
    return {s for s in code_spans(text) if re.match(r"(pagelab|make) |python -m bench\.", s)}


def all_commands() -> list[tuple[str, str]]:
    return sorted({(str(p.relative_to(ROOT)), c) for p in pages() if p != GENERATED
                   for c in shell_commands(_text(p))})


INLINE = {c for p in pages() if p != GENERATED for c in inline_commands(_text(p))}


def _leaf(args: list[str]):
    """(command, context, arguments left) of `pagelab ARGS`: the command path resolved, options unparsed."""
    import typer.main

    from cli.commands import app

    command = typer.main.get_command(app)
    ctx = command.make_context("pagelab", [], resilient_parsing=True)
    while hasattr(command, "resolve_command") and args and not args[0].startswith("-"):
        name, command, rest = command.resolve_command(ctx, args)
        if command is None:
            raise LookupError(f"No such command {args[0]!r} in `{ctx.command_path}`")
        ctx, args = command.make_context(name, [], parent=ctx, resilient_parsing=True), rest
    return command, ctx, args


def _parse_pagelab(args: list[str], mention: bool = False) -> None:
    """Parse `pagelab ARGS` with the app's own parser down to the leaf command, running nothing. A
    `mention` (a command named in prose, perhaps without its arguments) may leave arguments and option
    values out, but every option it names must exist."""
    from typer._click.exceptions import BadOptionUsage, MissingParameter
    from typer.exceptions import Exit

    from cli.commands import spread_goodput

    args = spread_goodput(args)
    command, ctx, rest = _leaf(list(args))
    if hasattr(command, "resolve_command") and not rest:
        return  # a group named on its own (`pagelab bench`)
    try:
        command.make_context(ctx.info_name, list(rest), parent=ctx.parent)
        assert not hasattr(command, "resolve_command"), f"pagelab {' '.join(args)}: a group takes a command"
    except Exit as exc:  # -h / --version: the parser answered
        assert exc.exit_code == 0
    except (MissingParameter, BadOptionUsage):
        if not mention:
            raise
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [a.split("=")[0] for a in rest if a.startswith("-") and a.split("=")[0] not in known]
        assert not unknown, f"pagelab {' '.join(args)}: no such option {unknown}"


class _Parsed(Exception):
    """Raised by the trapped argparse once the arguments are parsed: nothing runs."""


def _parse_module(module: str, args: list[str], monkeypatch) -> None:
    """Parse `python -m MODULE ARGS` with the module's own argparse parser, running nothing."""
    parse = argparse.ArgumentParser.parse_args

    def trap(self, argv=None, namespace=None):
        raise _Parsed(parse(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", trap)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(_Parsed):
        importlib.import_module(module).main()


def _check_make(args: list[str]) -> None:
    makefile = _text(ROOT / "Makefile")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for arg in args:
        if "=" in arg:
            assert re.search(rf"\$\({re.escape(arg.split('=')[0])}\)", makefile), f"make variable {arg}"
        else:
            assert arg in targets, f"no make target {arg!r}"


def _check_pytest(args: list[str]) -> None:
    markers = re.findall(r'^\s*"(\w+):', _text(ROOT / "pyproject.toml"), re.M)
    for i, arg in enumerate(args):
        if i and args[i - 1] == "-m":
            assert set(re.findall(r"\w+", arg)) - {"not", "and", "or"} <= set(markers), f"marker {arg}"
        elif not arg.startswith("-"):
            assert (ROOT / arg.split("::")[0]).exists(), f"no test path {arg}"


ALLOWED_COMMANDS = (". .venv/bin/activate", "mkdocs ", "python3 -m pip install", "pip install")


@pytest.mark.parametrize(("page", "command"), all_commands())
def test_command_parses(page, command, monkeypatch):
    argv = shlex.split(command, comments=True)
    argv = argv[2:] if argv[:2] == ["/usr/bin/time", "-v"] else argv
    if argv and argv[0].endswith("python") or argv[:1] == ["python3"]:
        argv = ["python", *argv[1:]]
    if command.startswith(ALLOWED_COMMANDS):
        return
    if argv[0] == "pagelab":
        _parse_pagelab(argv[1:], mention=command in INLINE)
    elif argv[:3] == ["python", "-m", "pytest"]:
        _check_pytest(argv[3:])
    elif argv[:2] == ["python", "-m"]:
        _parse_module(argv[2], argv[3:], monkeypatch)
    elif argv[0] == "python":
        assert (ROOT / argv[1]).is_file(), f"no script {argv[1]}"
    elif argv[0] == "make":
        _check_make(argv[1:])
    else:
        pytest.fail(f"{page}: a command of a kind this test cannot check: {command}")


def test_commands_are_found():
    commands = [c for _, c in all_commands()]
    assert sum(c.startswith("pagelab ") for c in commands) > 30
    assert any(c.startswith("python -m bench.calibration") for c in commands)
    assert any(c.startswith("make ") for c in commands)


def test_a_renamed_option_fails_to_parse(monkeypatch):
    with pytest.raises(Exception, match="No such option"):
        _parse_pagelab(["simulate", "azure-conv", "--kv-memory", "2"])
    with pytest.raises(Exception, match="(?i)no such option"):
        _parse_pagelab(["sweep", "--plots"], mention=True)
    _parse_pagelab(["sweep", "--plot"], mention=True)  # a mention may leave the arguments out
    with pytest.raises(Exception, match="No such command"):
        _parse_pagelab(["simulates", "azure-conv"])
    with pytest.raises(SystemExit):
        _parse_module("bench.calibration", ["--profiles", "x.json"], monkeypatch)
    with pytest.raises(AssertionError):
        _check_make(["profiles"])


def test_getting_started_shows_the_readme_tour():
    spec = importlib.util.spec_from_file_location("tour", ROOT / "tests" / "cli" / "test_readme_tour.py")
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    readme = tour.tour_commands(_text(ROOT / "README.md"))
    assert tour.tour_commands(_text(DOCS / "getting-started.md")) == readme
