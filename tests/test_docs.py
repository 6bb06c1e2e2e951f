"""README and docs point only at files that are in the repository: every relative link, and every
path of a repository file named in backticks (docs/tuning.md, the history, may name files that
have since moved, so only its links are checked)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "hetplan" / "topologies" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PATH = re.compile(r"`((?:hetplan|benchmarks|tests|docs|examples)/[\w./-]+\.(?:py|md|json|png))")


def missing_in(doc: Path) -> list[str]:
    text = doc.read_text()
    out = [f"link {t}" for t in LINK.findall(text)
           if "://" not in t and not (doc.parent / t).exists()]
    if doc.name != "tuning.md":
        out += [f"path {p}" for p in PATH.findall(text) if not (ROOT / p).exists() and not re.search(r"<|[A-Z]{3,}", p)]   # <host>, NAME: patterns
    return out


def test_docs_point_only_at_files_that_exist():
    bad = {str(d.relative_to(ROOT)): m for d in DOCS if (m := missing_in(d))}
    assert bad == {}


def test_the_check_sees_a_missing_file(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see [the map](nowhere.md) and `hetplan/planner/sim/nowhere.py`")
    assert missing_in(doc) == ["link nowhere.md", "path hetplan/planner/sim/nowhere.py"]


def test_the_readme_is_short_and_opens_with_the_question_and_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    assert max(map(len, lines[:12])) <= 100   # the first screen fits a 100-column terminal
    assert lines[0] == "# hetplan" and lines[2].startswith("What is the fastest way")
    assert "hetplan demo" in lines[5] and "pytest" in lines[6]
