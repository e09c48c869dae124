"""The user docs stay in step with the code and the README with CI.

- docs/configuration.md names every AgentConfig field and its NICSWITCH_* variable;
- docs/protocol.md names every method path the transport knows;
- the README's first code block is exactly the demo command and the test command, and the
  test command is what .ci/run runs, verbatim.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nicswitch_agent import transport
from nicswitch_agent.config import ENV_PREFIX, AgentConfig

ROOT = Path(__file__).resolve().parent.parent
DEMO_COMMAND = "python3 -m pip install . && nicswitch-agent demo"
FIELDS = [f.name for f in dataclasses.fields(AgentConfig)]


def read(relative: str) -> str:
    return (ROOT / relative).read_text(encoding="utf-8")


def first_fenced_block(markdown: str) -> list[str]:
    """Non-blank lines of the first ``` block."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", markdown, re.DOTALL | re.MULTILINE)
    assert match, "README.md has no fenced code block"
    return [line.strip() for line in match.group(1).splitlines() if line.strip()]


def test_fields_are_found() -> None:
    assert "server" in FIELDS and "job_id" in FIELDS


@pytest.mark.parametrize("name", FIELDS)
def test_configuration_doc_names_every_setting(name: str) -> None:
    doc = read("docs/configuration.md")
    assert f"`{name}`" in doc, f"docs/configuration.md does not mention `{name}`"
    env = ENV_PREFIX + name.upper()
    assert env in doc, f"docs/configuration.md does not mention {env}"


@pytest.mark.parametrize("path", [m.path for m in transport.METHODS])
def test_protocol_doc_names_every_method_path(path: str) -> None:
    assert path in read("docs/protocol.md"), f"docs/protocol.md does not mention {path}"


def test_readme_first_block_is_demo_then_ci_test_command() -> None:
    lines = first_fenced_block(read("README.md"))
    assert len(lines) == 2, f"README's first code block should hold exactly two commands, got {lines}"
    demo, test_command = lines
    assert demo == DEMO_COMMAND
    assert "pytest" in test_command, f"second command does not run the tests: {test_command!r}"
    ci_commands = [
        line.strip() for line in read(".ci/run").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert test_command in ci_commands, (
        f".ci/run does not run the README's test command verbatim: {test_command!r}"
    )
