"""Every reference to the documentation resolves inside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for pattern in ("*.md", "octopipe_plugin/**/*.py", "tests/**/*.py", "benchmarks/*.py", "examples/**/*.py",
                             "scripts/*", "docs/*.md")
           for p in ROOT.glob(pattern) if p.is_file()]


def test_docs_references_name_files_that_exist():
    missing = []
    for path in SOURCES:
        for ref in set(re.findall(r"docs/[\w.-]+\.md", path.read_text(errors="replace"))):
            if not (ROOT / ref).is_file():
                missing.append(f"{path.relative_to(ROOT)} -> {ref}")
    assert not missing, missing


def test_nothing_points_outside_the_repository_for_the_formats_or_design():
    stale = [str(p.relative_to(ROOT)) for p in SOURCES if p.name != "test_docs.py"
             and re.search(r"\b(FORMATS|DESIGN)\.md\b", p.read_text(errors="replace"))]
    assert not stale, stale
