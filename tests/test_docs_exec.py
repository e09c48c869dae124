"""The docs run as written (issue 11 §7).

Every shell and python block of README.md and docs/*.md runs, in page order, against the
simulator (tests/docs_exec.py says how, and which `<!-- doc-test: ... -->` comment above a block
changes that); a block that cannot run here says why in the page's source. So a command, a flag,
an output line the text promises, or a snippet that drifts from the code fails here.

Also: the repository cites only its own pages for the facts about ClusterD and torch's Store
(docs/clusterd.md, docs/torch-store.md), and every install command in the docs works from a checkout.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_exec import MARKER, ROOT, RUN_FENCES, doc_pages, page_blocks, run_page

PAGES = doc_pages()


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    run = run_page(page, tmp_path)
    for line in run.skipped:
        print("skipped", line)


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_every_marker_sits_on_a_block(page: Path) -> None:
    """A `doc-test` comment must be the line above a shell or python block (else it silently does nothing)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if "doc-test" not in line:
            continue
        assert MARKER.match(line.strip()), f"{rel(page)}:{number}: malformed marker {line!r}"
        following = next((x.strip() for x in lines[number:] if x.strip()), "")
        assert following.startswith("```") and following[3:].strip() in RUN_FENCES, (
            f"{rel(page)}:{number}: the marker is not right above a shell or python block")
    page_blocks(page)  # every directive parses


def test_the_pages_run_the_readers_main_paths() -> None:
    """The README's Operators block, the demo, the simulator rehearsal: run, not skipped."""
    blocks = {b.where: b for p in PAGES for b in page_blocks(p)}
    readme = [b for b in blocks.values() if b.page == "README.md" and b.skip is None and b.lang == "bash"]
    assert any("nicswitch-agent switch" in b.code for b in readme), "README's Operators block is not run"
    assert any("torchrun" in b.code and "examples/ddp_train.py" in b.code for b in readme)
    quick = [b for b in blocks.values() if b.page == "docs/quickstart.md" and b.skip is None]
    assert any(b.file == "train.py" for b in quick)
    assert any("train.py" in b.code and b.background for b in quick), "quickstart's job is not run"


# -- citations: the repository stands alone -------------------------------------------------------

EXTERNAL = re.compile(r"clusterd-(protocol|observed|switch-api)|torch-store-notes|field-notes|PRODUCT\.md"
                      r"|\b(reference|observed(-2)?) §|\[[PO][12]? §")
CITATION = re.compile(r"(?:docs/)?(clusterd|torch-store)\.md#([\w-]+)")
CITING = [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
          *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "examples").glob("*.py")), *PAGES]


def heading_anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    anchors = set()
    for match in re.finditer(r"^#{1,6}\s+(.*)$", text, re.MULTILINE):
        title = re.sub(r"[`*_]", "", match.group(1).strip().lower())
        anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_nothing_cites_notes_outside_the_repository() -> None:
    found = []
    for path in CITING:
        if path.name == "test_docs_exec.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if EXTERNAL.search(line):
                found.append(f"{rel(path)}:{number}: {line.strip()}")
    assert not found, "cite docs/clusterd.md or docs/torch-store.md instead:\n" + "\n".join(found)


def test_every_citation_names_a_section_that_exists() -> None:
    anchors = {name: heading_anchors(ROOT / "docs" / f"{name}.md") for name in ("clusterd", "torch-store")}
    cited, broken = 0, []
    for path in CITING:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for page, anchor in CITATION.findall(line):
                cited += 1
                if anchor not in anchors[page]:
                    broken.append(f"{rel(path)}:{number}: {page}.md#{anchor}")
    assert cited >= 100, cited
    assert not broken, "no such section:\n" + "\n".join(broken)


# -- installs that work from a checkout ------------------------------------------------------------


def test_install_commands_work_from_a_checkout() -> None:
    """nicswitch-agent is not on the package index: the docs install `.` (or `-e .`) with extras
    pyproject.toml defines, and constraint files the repository has."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+)\s*=", section, re.MULTILINE))
    assert {"torch", "lightning", "hf", "test"} <= extras, extras
    problems = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pip install\s+(-\S+\s+)*'?nicswitch-agent", line):
                problems.append(f"{rel(page)}:{number}: installs from the package index: {line.strip()}")
            for group in re.findall(r"pip install[^`\n]*?'?(?:-e\s+)?\.\[([\w,]+)\]", line):
                problems += [f"{rel(page)}:{number}: no extra {name!r}" for name in group.split(",")
                             if name not in extras]
            for constraint in re.findall(r"-c\s+(\S+)", line) if "pip install" in line else []:
                if not (ROOT / constraint).is_file():
                    problems.append(f"{rel(page)}:{number}: no constraints file {constraint}")
    assert not problems, "\n".join(problems)


def test_install_hints_in_messages_work_from_a_checkout() -> None:
    """The hints in error messages and docstrings (torch missing, an extra missing) say what the
    docs say: install the extra from the checkout, not a `nicswitch-agent` the package index lacks."""
    problems = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"pip install\s+(-\S+\s+)*'?nicswitch-agent", line):
                problems.append(f"{rel(path)}:{number}: names the package index: {line.strip()}")
    assert not problems, "\n".join(problems)
