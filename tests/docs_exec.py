"""Run the code blocks of README.md and docs/*.md as a reader would (used by tests/test_docs_exec.py).

Every ```bash/```sh/```shell/```console and ```python block is run, in the order of its page,
unless the HTML comment on the line just above it says otherwise::

    <!-- doc-test: skip <why it cannot run here> -->           (alone in its comment)
    <!-- doc-test: background until "text" ["more text"] -->   a long-running command (a terminal of
                                                              its own): started, waited for until its
                                                              output holds every text, stopped when
                                                              the page is done
    <!-- doc-test: restart; background until "..." -->        stop the page's background commands first
    <!-- doc-test: expect "text" -->                          the output must hold the text
    <!-- doc-test: timeout 120 -->                            seconds (default 60)
    <!-- doc-test: file train.py; edit A => B; edit C => D -->  a python block the page tells the reader to
                                                              save (and edit): written, not run
    <!-- doc-test: setup agent-loop -->                       a python snippet that uses names the page
                                                              leaves to the reader: run after a prelude
                                                              (SETUPS) that defines them
    <!-- doc-test: requires lightning -->                     skipped when the module is not importable

Shell blocks of one page share a working directory (a temporary one, with the checkout's
``examples`` and ``ci`` linked in) and their exported variables, and run with ``set -eo
pipefail``: a failing command fails the page. Port 8899 (ClusterD's) is replaced by a free port
so that runs cannot collide. A foreground block must leave no process running (background jobs
of a pasted block included); a background block's processes are stopped when the page is done.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import free_port

ROOT = Path(__file__).resolve().parent.parent
SHELL_FENCES = {"bash", "sh", "shell", "console"}
RUN_FENCES = SHELL_FENCES | {"python"}
MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
DEFAULT_TIMEOUT_S = 60.0
FAKE_TORCH_NPU = ROOT / "tests" / "torch_job" / "fake_torch_npu"
CLUSTERD_PORT = "8899"

# Preludes for python snippets that use names the page leaves to the reader (a loader, a training
# step, a switch hook). They run a simulator in the snippet's process, with a MindIO stand-in
# (the snippets' agents run in pause mode external or dry-run), and point the agent's environment
# at it.
_SIM_PRELUDE = f"""
import os, sys
sys.path.insert(0, {str(FAKE_TORCH_NPU)!r})   # a torch_npu for the default switch hook's check
from nicswitch_agent.sim import SimJob, Simulator
_sim = Simulator(jobs=[SimJob(job_id="job-1", nodes={{"node-0": ["0", "1"], "node-1": ["0", "1"]}})], standin=True)
os.environ["NICSWITCH_SERVER"] = _sim.start()
os.environ["NICSWITCH_JOB_ID"] = "job-1"
os.environ.setdefault("NICSWITCH_PAUSE", "external")
"""
SETUPS = {
    "agent-loop": _SIM_PRELUDE + """
loader = range(5)
def train_step(batch): pass
""",
    "explicit-settings": _SIM_PRELUDE + """
def my_switch(order): return True
def ensure_ckpt(order): pass
def train(): pass
_server = os.environ["NICSWITCH_SERVER"]
""",
    "sim-env": _SIM_PRELUDE,
}


@dataclasses.dataclass
class Block:
    page: str  # "docs/x.md"
    line: int  # line of the opening fence
    lang: str
    code: str
    skip: str | None = None
    background: list[str] | None = None  # texts to wait for
    restart: bool = False
    expect: list[str] = dataclasses.field(default_factory=list)
    timeout_s: float = DEFAULT_TIMEOUT_S
    file: str | None = None
    edits: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    setup: str | None = None
    requires: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_marker(text: str, block: Block) -> None:
    """Apply the directives of one ``doc-test:`` comment to ``block``."""
    if text.startswith("skip"):  # the rest is the reason, semicolons and all
        block.skip = text[4:].strip()
        if not block.skip:
            raise ValueError(f"{block.where}: `skip` needs a reason")
        return
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        word, _, rest = part.partition(" ")
        rest = rest.strip()
        if word == "background":
            words = shlex.split(rest)
            if not words or words[0] != "until" or len(words) < 2:
                raise ValueError(f'{block.where}: write `background until "text"`')
            block.background = words[1:]
        elif word == "restart":
            block.restart = True
        elif word == "expect":
            block.expect.extend(shlex.split(rest))
        elif word == "timeout":
            block.timeout_s = float(rest)
        elif word == "file":
            block.file = rest
        elif word == "edit":
            old, sep, new = rest.partition(" => ")
            if not sep:
                raise ValueError(f"{block.where}: write `edit OLD => NEW`")
            block.edits.append((old, new))
        elif word == "setup":
            if rest not in SETUPS:
                raise ValueError(f"{block.where}: unknown setup {rest!r} (known: {sorted(SETUPS)})")
            block.setup = rest
        elif word == "requires":
            block.requires = rest
        else:
            raise ValueError(f"{block.where}: unknown doc-test directive {word!r}")


def page_blocks(path: Path) -> list[Block]:
    """The runnable-language blocks of a page, with their directives."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        lang = fence[3:].strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
        if lang in RUN_FENCES:
            block = Block(page, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n")
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(above)
            if marker:
                parse_marker(marker.group(1), block)
            blocks.append(block)
        i = end + 1
    return blocks


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# -- running ------------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[str]:
    """Command lines of the live processes of process group ``pgid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            try:
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            found.append(cmd.strip())
    return found


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, then SIGKILL what is left after a few seconds."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if process.poll() is not None and not group_members(process.pid):
                return
            time.sleep(0.05)


class PageRun:
    """One page's blocks, in order, in one working directory."""

    def __init__(self, page: str, workdir: Path) -> None:
        self.page = page
        self.workdir = workdir
        self.port = str(free_port())
        self.state = workdir / ".doc-test-env"
        self.state.write_text("")
        self.backgrounds: list[tuple[Block, subprocess.Popen[bytes], Path]] = []
        self.ran: list[str] = []
        self.skipped: list[str] = []
        for name in ("examples", "ci"):
            (workdir / name).symlink_to(ROOT / name)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("NICSWITCH_") and k not in ("MINDX_SERVER_IP", "MINDX_TASK_ID",
                                                                "LOCAL_PROXY_ENABLE", "TTP_PORT",
                                                                "TASKD_PROCESS_ENABLE", "WORLD_SIZE", "RANK")}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH", "")] if p)
        env["PYTHONUNBUFFERED"] = "1"
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # torch's reverse-DNS stalls on loaded machines
        self.env = env

    def code(self, block: Block) -> str:
        return re.sub(rf"\b{CLUSTERD_PORT}\b", self.port, block.code)

    def run(self, block: Block) -> None:
        if block.skip is not None:
            self.skipped.append(f"{block.where}: {block.skip}")
            return
        if block.requires and importlib.util.find_spec(block.requires) is None:
            self.skipped.append(f"{block.where}: needs {block.requires}")
            return
        if block.restart:
            self.stop_backgrounds()
        if block.lang == "python":
            self.run_python(block)
        elif block.background is not None:
            self.start_background(block)
        else:
            self.run_shell(block)
        self.ran.append(block.where)

    def shell_script(self, block: Block) -> str:
        return (f"set -a; . {shlex.quote(str(self.state))}; set +a\nset -eo pipefail\n{self.code(block)}\n"
                f"export -p > {shlex.quote(str(self.state))}\n")

    def run_python(self, block: Block) -> None:
        code = self.code(block)
        if block.file is not None:
            for old, new in block.edits:
                if old not in code:
                    raise AssertionError(f"{block.where}: the edit {old!r} => {new!r} finds nothing to edit")
                code = code.replace(old, new)
            (self.workdir / block.file).write_text(code)
            return
        program = code
        if block.setup:  # the snippet runs in the prelude's namespace; the simulator stops after it
            program = (SETUPS[block.setup] + f"\ntry:\n    exec(compile({code!r}, {block.where!r}, 'exec'))\n"
                       "finally:\n    _sim.stop()\n")
        self.check(block, subprocess.run([sys.executable, "-c", program], cwd=self.workdir, env=self.env,
                                         capture_output=True, timeout=block.timeout_s, check=False))

    def run_shell(self, block: Block) -> None:
        log = self.workdir / f".block-{block.line}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(["bash", "-c", self.shell_script(block)], cwd=self.workdir, env=self.env,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                process.wait(block.timeout_s)
            except subprocess.TimeoutExpired:
                stop_group(process)
                raise AssertionError(f"{block.where}: still running after {block.timeout_s:g} s:\n"
                                     f"{tail(log)}") from None
            deadline = time.monotonic() + 10  # a job the block started may take a moment to exit
            while (left := group_members(process.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if left:
                stop_group(process)
                raise AssertionError(f"{block.where}: the block left processes running: {left}\n{tail(log)}")
        self.check(block, subprocess.CompletedProcess(process.args, process.returncode, log.read_bytes(), b""))

    def start_background(self, block: Block) -> None:
        log = self.workdir / f".block-{block.line}.log"
        out = log.open("wb")
        script = f"set -a; . {shlex.quote(str(self.state))}; set +a\nset -eo pipefail\n{self.code(block)}\n"
        # Variables it exports belong to its terminal, but the page's later blocks are told to run in
        # a terminal of their own: record them for those, as a reader would set them there too.
        exports = [line for line in self.code(block).splitlines() if line.startswith("export ")]
        if exports:
            subprocess.run(["bash", "-c", self.shell_script(Block(block.page, block.line, "bash",
                                                                      "\n".join(exports) + "\n"))],
                           cwd=self.workdir, env=self.env, check=True)
        process = subprocess.Popen(["bash", "-c", script], cwd=self.workdir, env=self.env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.backgrounds.append((block, process, log))
        assert block.background is not None
        deadline = time.monotonic() + block.timeout_s
        while True:
            text = log.read_text(errors="replace")
            if all(t in text for t in block.background):
                return
            if process.poll() is not None:
                raise AssertionError(f"{block.where}: ended (exit {process.returncode}) before printing "
                                     f"{block.background}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{block.where}: no {block.background} within {block.timeout_s:g} s:\n"
                                     f"{tail(log)}")
            time.sleep(0.02)

    def check(self, block: Block, result: subprocess.CompletedProcess[bytes]) -> None:
        output = (result.stdout or b"").decode(errors="replace") + (result.stderr or b"").decode(errors="replace")
        background = "".join(f"\n--- {b.where} (background):\n{tail(log)}" for b, _, log in self.backgrounds)
        if result.returncode != 0:
            raise AssertionError(f"{block.where}: exit code {result.returncode}:\n{output[-4000:]}{background}")
        missing = [t for t in block.expect if t not in output]
        if missing:
            raise AssertionError(f"{block.where}: the output lacks {missing}:\n{output[-4000:]}{background}")

    def stop_backgrounds(self) -> None:
        while self.backgrounds:
            _, process, _ = self.backgrounds.pop()
            stop_group(process)


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def run_page(page: Path, workdir: Path) -> PageRun:
    """Run every block of ``page`` in ``workdir``; the finished run lists what ran and what was skipped."""
    run = PageRun(page.relative_to(ROOT).as_posix(), workdir)
    try:
        for block in page_blocks(page):
            run.run(block)
    finally:
        run.stop_backgrounds()
    return run
