"""The size lines of tutel/rules/lines.py: one table, each line set once, each traced to a benchmark
script and a section of docs/performance.md, and docs/size-lines.md generated from it."""
import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tutel.rules import lines

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tutel"
PERFORMANCE = REPO / "docs" / "performance.md"
NAMES = [line.name for line in lines.LINES]


def _headings(text):
    return {match.group(1).strip() for match in re.finditer(r"^#{1,6} +(.+?) *#* *$", text, re.MULTILINE)}


def test_every_line_has_a_unique_name_a_positive_int_value_and_its_fields():
    assert len(NAMES) == len(set(NAMES))
    for line in lines.LINES:
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", line.name), line.name
        assert isinstance(line.value, int) and not isinstance(line.value, bool) and line.value > 0, line
        assert line.unit and line.decides.endswith(".") and line.benchmark and line.section, line


@pytest.mark.parametrize("name", NAMES)
def test_the_benchmark_that_measures_a_line_exists(name):
    script = lines.size_line(name).benchmark
    assert re.fullmatch(r"benchmarks/[A-Za-z0-9_]+\.py", script), script
    assert (REPO / script).is_file(), f"{name}: {script} does not exist"


@pytest.mark.parametrize("name", NAMES)
def test_the_section_that_reports_a_line_exists_in_performance_md(name):
    section = lines.size_line(name).section
    assert section in _headings(PERFORMANCE.read_text(encoding="utf-8")), \
        f"{name}: docs/performance.md has no heading {section!r}"


@pytest.mark.parametrize("name", NAMES)
def test_each_constant_is_its_rows_value(name):
    assert getattr(lines, name) == lines.size_line(name).value


def test_the_module_holds_no_size_constant_outside_the_table():
    constants = {name for name, value in vars(lines).items()
                 if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and isinstance(value, int)}
    assert constants == set(NAMES)


def test_the_lines_keep_their_values():
    """The values the code had before the table: moving a line is a decision, not an accident."""
    assert (lines.UPCAST_MIN_ROWS_PER_EXPERT, lines.TOKEN_LINEAR_MAX_ROWS, lines.PIECE_BYTES, lines.MIN_PIECE_ROWS,
            lines.DECODE_MAX_TOKENS, lines.DECODE_MAX_CHOICES) == (32, 16, 64 << 20, 4096, 32, 256)


def test_an_unknown_line_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match="PIECE_BYTES"):
        lines.size_line("NO_SUCH_LINE")


def _module_constants(source):
    """The names a module assigns at its top level (plain and annotated assignments, tuple targets)."""
    names = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def redefined_lines(sources):
    """'<module path>: <name>' for each top-level assignment, outside rules/lines.py, of a name that is
    a line's name once leading underscores are dropped (a private copy is a copy all the same)."""
    found = []
    for path, source in sorted(sources.items()):
        if path == "tutel/rules/lines.py":
            continue
        for name in sorted(_module_constants(source)):
            if name.lstrip("_") in NAMES:
                found.append(f"{path}: {name}")
    return found


def test_no_other_module_sets_a_line_again():
    sources = {path.relative_to(REPO).as_posix(): path.read_text(encoding="utf-8")
               for path in sorted(PACKAGE.rglob("*.py"))}
    assert redefined_lines(sources) == [], "import the line from tutel.rules.lines instead"


def test_the_check_finds_a_copy_public_private_or_annotated_and_allows_an_import():
    sources = {
        "tutel/rules/lines.py": "PIECE_BYTES = 1\n",
        "tutel/a.py": "PIECE_BYTES = 64 << 20\n",
        "tutel/b.py": "_MIN_PIECE_ROWS = 4096\n",
        "tutel/c.py": "DECODE_MAX_TOKENS: int = 32\n",
        "tutel/d.py": "from .rules.lines import PIECE_BYTES\n\ndef f():\n    TOKEN_LINEAR_MAX_ROWS = 3\n    return 3\n",
    }
    assert redefined_lines(sources) == ["tutel/a.py: PIECE_BYTES", "tutel/b.py: _MIN_PIECE_ROWS",
                                        "tutel/c.py: DECODE_MAX_TOKENS"]


def test_the_users_read_the_table():
    from tutel.ops import decode_experts, linear, precision
    assert precision.UPCAST_MIN_ROWS_PER_EXPERT is lines.UPCAST_MIN_ROWS_PER_EXPERT
    assert linear.TOKEN_LINEAR_MAX_ROWS is lines.TOKEN_LINEAR_MAX_ROWS
    assert decode_experts.DECODE_MAX_TOKENS is lines.DECODE_MAX_TOKENS
    assert decode_experts.DECODE_MAX_CHOICES is lines.DECODE_MAX_CHOICES


def test_heading_anchor_follows_githubs_rule():
    assert lines.heading_anchor("Against transformers' experts backends") == "against-transformers-experts-backends"
    assert lines.heading_anchor("On a GPU") == "on-a-gpu"
    assert lines.heading_anchor("Before and after a change (`benchmarks/compare_builds.py`)") == \
        "before-and-after-a-change-benchmarkscompare_buildspy"


def test_the_table_has_a_row_per_line_with_its_links():
    table = lines.lines_table()
    rows = [row for row in table.splitlines() if row.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == NAMES
    for line, row in zip(lines.LINES, rows):
        assert f"(../{line.benchmark})" in row and f"(performance.md#{lines.heading_anchor(line.section)})" in row
    assert "| 64 MiB | bytes |" in table


def test_the_size_lines_page_is_generated_from_the_table():
    result = subprocess.run([sys.executable, os.path.join(REPO, "docs", "generate_size_lines.py"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert lines.lines_table() in (REPO / "docs" / "size-lines.md").read_text(encoding="utf-8")
