"""The user docs stay in step with the code and the README with CI.

- docs/configuration.md names every AgentConfig field and its NICSWITCH_* variable;
- docs/protocol.md names every method path the transport knows;
- the README's first code block is exactly the demo command and the test command, and the
  test command is what .ci/run runs, verbatim;
- every `nicswitch-agent ...` / `python -m nicswitch_agent ...` command in a ```bash block of
  docs/*.md and the README, or in an inline code span of their prose, names a subcommand that
  exists, whose `--help` exits 0 and lists every `--flag` the doc uses (checked in a subprocess,
  one per distinct subcommand);
- docs/operations.md names every event kind constant of observability/events.py, its event table is rendered
  from events.EVENT_KINDS (checked against the events file of a real run), and it names every
  Prometheus metric.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nicswitch_agent.clusterd import channel as transport
from nicswitch_agent.config import ENV_PREFIX, AgentConfig
from nicswitch_agent.observability import events

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


# -- every command in the docs exists ------------------------------------------------------------
#
# Every shell command in a ```bash block of docs/*.md (and the README) that runs the command line
# (`nicswitch-agent ...` or `python -m nicswitch_agent ...`) is checked against the real CLI, in a
# subprocess: its subcommand is listed by `--help`, `<subcommand> --help` exits 0, and every
# `--flag` the doc uses appears in that help text. Help texts are cached, so the whole check runs
# one subprocess per distinct (module, subcommand).

DOC_FILES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
SHELL_FENCES = {"bash", "sh", "shell"}
CONTROL_OPERATORS = {"&&", "||", ";", "|", "&", ";;"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
CLI_MODULE = "nicswitch_agent"
LONG_FLAG = re.compile(r"^--[A-Za-z0-9][\w-]*")


@dataclasses.dataclass(frozen=True)
class DocCommand:
    where: str  # "docs/x.md:12"
    text: str
    module: str  # "nicswitch_agent", or a submodule run with -m (e.g. "nicswitch_agent.sim")
    pre_flags: tuple[str, ...]  # --flags before the subcommand
    subcommand: str | None
    flags: tuple[str, ...]  # --flags after the subcommand


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command line) in every ```bash/sh/shell block; continuations joined."""
    found: list[tuple[int, str]] = []
    inside, pending, pending_start = False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = line.strip()
        if not inside:
            inside = fence.startswith("```") and fence[3:].strip() in SHELL_FENCES
            continue
        if fence.startswith("```"):
            if pending:
                found.append((pending_start, pending))
            inside, pending = False, ""
            continue
        if not pending:
            pending_start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((pending_start, pending + line))
        pending = ""
    return found


def split_commands(line: str) -> list[list[str]]:
    """Shell words of each simple command on ``line`` (comments dropped, split at ; && || | &)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in CONTROL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def parse_cli(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) when ``words`` runs the command line, else None."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return None
    if words[0] == "nicswitch-agent":
        return CLI_MODULE, words[1:]
    program = Path(words[0]).name
    if re.fullmatch(r"python(3(\.\d+)?)?", program) and len(words) >= 3 and words[1] == "-m":
        module = words[2]
        if module == CLI_MODULE or module.startswith(CLI_MODULE + "."):
            return module, words[3:]
    return None


def flags_of(words: list[str]) -> tuple[str, ...]:
    return tuple(m.group(0) for w in words if (m := LONG_FLAG.match(w)))


INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LOG_LINE = re.compile(r"^nicswitch-agent (started|stopping|stopped)\b")  # the agent's log lines, quoted


def inline_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every inline code span in the prose that runs the command line."""
    found: list[tuple[int, str]] = []
    inside = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if inside:
            continue
        for span in INLINE_CODE.findall(line):
            if span.startswith(("nicswitch-agent ", "python -m nicswitch_agent", "python3 -m nicswitch_agent")) \
                    and not LOG_LINE.match(span):
                found.append((number, span))
    return found


def doc_commands() -> list[DocCommand]:
    found: list[DocCommand] = []
    for path in DOC_FILES:
        if not path.exists():
            continue
        relative = path.relative_to(ROOT).as_posix()
        for number, line in [*shell_lines(path), *inline_commands(path)]:
            for words in split_commands(line):
                parsed = parse_cli(words)
                if parsed is None:
                    continue
                module, args = parsed
                if "--" in args:  # what follows is another program's command line (a wrapped command)
                    args = args[:args.index("--")]
                pre: list[str] = []
                sub: str | None = None
                if module == CLI_MODULE:  # global options, then the subcommand, then its options
                    while args and args[0].startswith("-"):
                        pre.append(args.pop(0))
                    sub = args.pop(0) if args else None
                found.append(DocCommand(f"{relative}:{number}", line.strip(), module, flags_of(pre), sub,
                                        flags_of(args)))
    return found


def run_help(module: str, subcommand: str | None) -> tuple[int, str]:
    """(exit code, stdout + stderr) of ``python -m <module> [<subcommand>] --help``."""
    args = [sys.executable, "-m", module, *([subcommand] if subcommand else []), "--help"]
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)
    return result.returncode, result.stdout + result.stderr


@functools.lru_cache(maxsize=1)
def all_help_texts() -> dict[tuple[str, str | None], tuple[int, str]]:
    """Every help text the doc commands need, fetched once and in parallel (each is a cold start)."""
    wanted: set[tuple[str, str | None]] = {(c.module, None) for c in DOC_COMMANDS}
    wanted |= {(c.module, c.subcommand) for c in DOC_COMMANDS if c.subcommand is not None}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        futures = {key: pool.submit(run_help, *key) for key in wanted}
        return {key: future.result() for key, future in futures.items()}


def cli_help(module: str, subcommand: str | None) -> tuple[int, str]:
    return all_help_texts()[(module, subcommand)]


def has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


DOC_COMMANDS = doc_commands()


def test_docs_show_the_main_commands() -> None:
    used = {c.subcommand for c in DOC_COMMANDS if c.module == CLI_MODULE}
    assert {"demo", "sim", "switch", "watch"} <= used, f"docs use only {sorted(used, key=str)}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", DOC_COMMANDS, ids=[c.where for c in DOC_COMMANDS])
def test_doc_command_exists_with_its_flags(command: DocCommand) -> None:
    code, main_help = cli_help(command.module, None)
    assert code == 0, f"{command.where}: `python -m {command.module} --help` exited {code}:\n{main_help}"
    for flag in command.pre_flags:
        assert has_flag(main_help, flag), f"{command.where}: {flag} is not an option of {command.module}"
    if command.module == CLI_MODULE:
        assert command.subcommand is not None, f"{command.where}: no subcommand in {command.text!r}"
        assert re.search(rf"^\s+{re.escape(command.subcommand)}\s", main_help, re.MULTILINE), (
            f"{command.where}: `{command.subcommand}` is not listed by `nicswitch-agent --help`"
        )
        code, help_text = cli_help(command.module, command.subcommand)
        assert code == 0, f"{command.where}: `nicswitch-agent {command.subcommand} --help` exited {code}"
    else:
        help_text = main_help
    missing = [flag for flag in command.flags if not has_flag(help_text, flag)]
    assert not missing, f"{command.where}: {missing} not in the help of {command.subcommand or command.module}"


# -- the README says what happens -------------------------------------------------------------------


def test_readme_runs_of_the_ddp_example_wait_for_the_switch_they_describe() -> None:
    """examples/ddp_train.py trains its 300 steps in a few seconds: a README run that is to show a
    switch waits for one (--wait-for-switch), and the page then asks ClusterD for it."""
    readme = ROOT / "README.md"
    spans = [(n, span) for n, line in enumerate(read("README.md").splitlines(), 1)
             for span in INLINE_CODE.findall(line)]
    runs = [(n, text) for n, text in [*shell_lines(readme), *spans]
            if re.search(r"\b(torchrun|python3?)\b.*examples/ddp_train\.py", text)]
    assert runs, "README.md no longer runs examples/ddp_train.py"
    assert all("--wait-for-switch" in text for _, text in runs), runs
    first = min(n for n, text in shell_lines(readme) if "examples/ddp_train.py" in text)
    assert any("nicswitch-agent switch " in text and n > first for n, text in shell_lines(readme)), (
        "README.md runs the DDP example but asks for no switch after it")


def test_readme_says_what_a_switch_for_a_job_nobody_registered_gets() -> None:
    """The simulator, as ClusterD, refuses it at once (413); the README once said it waited 15 minutes."""
    from nicswitch_agent.ops.om import OmClient, SwitchInvalid, parse_nic_groups
    from nicswitch_agent.sim import SimJob, Simulator

    with Simulator(jobs=[SimJob(job_id="job-1", nodes={"node-0": ["0", "1"]})]) as sim, \
            OmClient(sim.address, rpc_timeout_s=10) as client, pytest.raises(SwitchInvalid) as refused:
        client.switch("job-1", parse_nic_groups([("node-0", "0,1", "standby")]))
    assert (refused.value.code, refused.value.info) == (413, "job:job-1 is not registered")
    flat = " ".join(read("README.md").split())
    assert "refuses the switch at once: `rejected (413, invalid request): job:job-1 is not registered`, exit code 4" \
        in flat


# -- links between the pages -----------------------------------------------------------------------

MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Pages whose anchors into other pages are checked too (a page's headings may be renamed by its owner).
ANCHOR_CHECKED = ("docs/index.md", "docs/quickstart.md", "docs/operations.md", "docs/protocol.md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
def test_doc_links_resolve(page: str) -> None:
    source = ROOT / page
    for target in MARKDOWN_LINK.findall(source.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        file_part, _, anchor = target.partition("#")
        linked = (source.parent / file_part).resolve() if file_part else source
        assert linked.exists(), f"{page}: link to {target} points to a missing file"
        if anchor and page in ANCHOR_CHECKED and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page}: no heading for #{anchor} in {linked.name}"


# -- the operations page and the code agree --------------------------------------------------------


def event_kind_constants() -> dict[str, str]:
    """Every event kind constant of nicswitch_agent.observability.events (NAME = "name")."""
    return {name: value for name, value in vars(events).items()
            if name.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z]+(_[a-z]+)*", value)}


def render_event_table() -> str:
    """docs/operations.md's event table, rendered from events.EVENT_KINDS."""
    rows = ["| `kind` | Emitted by | When | `detail` fields |", "|---|---|---|---|"]
    for kind in events.EVENT_KINDS.values():
        fields = "; ".join(f"`{name}`: {text}" for name, text in kind.fields)
        rows.append(f"| `{kind.kind}` | {kind.emitted_by} | {kind.when} | {fields} |")
    return "\n".join(rows)


def test_every_event_kind_constant_is_in_the_reference_and_in_the_operations_doc() -> None:
    constants = event_kind_constants()
    assert len(constants) >= 15, constants
    assert set(constants.values()) == set(events.EVENT_KINDS), "events.EVENT_KINDS misses or invents a kind"
    doc = read("docs/operations.md")
    missing = [kind for kind in constants.values() if f"`{kind}`" not in doc]
    assert not missing, f"docs/operations.md does not mention the event kind(s) {missing}"


def test_the_operations_event_table_is_rendered_from_the_code() -> None:
    table = render_event_table()
    assert table in read("docs/operations.md"), (
        "docs/operations.md's event table differs from events.EVENT_KINDS; replace it with:\n\n" + table
    )


@pytest.mark.timeout(60)
def test_a_real_jobs_events_file_matches_the_reference(tmp_path: Path) -> None:
    """The thread demo (4 ranks, two switches) with NICSWITCH_EVENTS_FILE: every line has the
    documented record fields, and every event's detail has exactly the documented fields."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NICSWITCH_")}
    env["NICSWITCH_EVENTS_FILE"] = str(tmp_path / "events-{rank}.jsonl")
    result = subprocess.run([sys.executable, "-m", "nicswitch_agent", "demo"], capture_output=True, text=True,
                            timeout=50, env=env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    files = sorted(tmp_path.glob("events-*.jsonl"))
    assert [f.name for f in files] == [f"events-{r}.jsonl" for r in range(4)]
    seen: dict[str, set[str]] = {}
    for path in files:
        rank = int(path.stem.split("-")[1])
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            assert set(record) == {"kind", "job_id", "rank", "seq", "wall", "time", "mono", "pid", "detail"}, record
            assert record["rank"] == rank and record["job_id"] == "demo-job"
            kind = events.EVENT_KINDS.get(record["kind"])
            assert kind is not None, f"undocumented event kind {record['kind']!r}"
            extra = set(record["detail"]) - {name for name, _ in kind.fields}
            assert not extra, f"{record['kind']} has undocumented detail field(s) {sorted(extra)}"
            seen.setdefault(record["kind"], set()).update(record["detail"])
    expected = {"agent_started", "list_received", "pause_requested", "parked", "guard_done", "member_result",
                "switch_done", "reply_sent", "resumed", "agent_stopped"}
    assert expected <= set(seen), sorted(seen)
    for name in seen:  # what a switch that works emits carries every documented field
        assert seen[name] == {field for field, _ in events.EVENT_KINDS[name].fields}, name


def test_the_operations_doc_names_every_prometheus_metric() -> None:
    pytest.importorskip("prometheus_client")
    from nicswitch_agent.observability.metrics import PrometheusMetrics

    doc = read("docs/operations.md")
    names = []
    for family in PrometheusMetrics().registry.collect():
        names.append(f"{family.name}_total" if family.type == "counter" else family.name)
    assert len(names) >= 12, names
    missing = [name for name in names if f"`{name}" not in doc]
    assert not missing, f"docs/operations.md does not name the metric(s) {missing}"


@pytest.mark.parametrize("page", ["README.md", "docs/operations.md"])
def test_under_the_launcher_the_switch_cue_is_the_registration_once_every_rank_joined(page: str) -> None:
    """Under ``nicswitch-agent launch`` the leader registers the job only once every rank has joined
    (ops/hosted_leader.py); a switch asked for before then is refused ('not registered'), never left hanging."""
    text = " ".join(read(page).split())
    assert re.search(r"[^.]*\bonly once every rank has joined\b[^.]*\.", text), f"{page} gives no launcher cue"
    assert "not registered" in text, f"{page} does not say what a switch asked for too early gets"
    assert "the leader makes itself known to ClusterD" in read("src/nicswitch_agent/ops/hosted_leader.py")
