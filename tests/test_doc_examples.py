"""Every command and Python snippet of README.md and docs/*.md that can run offline runs here.

The fenced ``bash``, ``console`` and ``python`` blocks are extracted; each command (a line, with its
``\\`` continuations; in a ``console`` block, the lines after ``$``) and each Python block runs unless
:data:`SKIPS` names it, with the reason. So a new doc example runs by default, and an example that
crashes (as `swarm config check --help` once did) fails here. Commands run with ``bash`` in a scratch
directory that links the repository's ``configs/``, ``scripts/`` and ``.venv/``, with ``.venv/bin``
first on the PATH and HOME and SWARM_HOME in that directory; ``run.yaml``, the docs' name for "your
run config", is a copy of ``configs/gpt-125m.yaml``. A command passes when it exits with its
:data:`EXIT_STATUS` (0 unless listed) and prints no traceback.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|console|python)[ \t]*\n(.*?)^```", re.M | re.S)
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Skip:
    """Examples containing ``text`` are not run, because ``why``."""

    text: str
    why: str


SKIPS = (
    # need a live swarm, or the network
    Skip("--initial-peers", "needs a live swarm to talk to"),
    Skip("swarm join ", "trains in a live swarm until stopped"),
    Skip("swarm bootstrap ", "serves a public swarm until stopped"),
    Skip("scripts/join.sh", "joins a live swarm"),
    Skip("scripts/gpu_prepare.sh", "downloads wheels from the package registries"),
    Skip("scripts/gpu_check.sh", "needs a CUDA GPU; tests/test_gpu_check.py runs its dry run"),
    Skip("git clone", "needs the network"),
    Skip("swarm data prepare", "streams a dataset from the Hugging Face hub"),
    # long
    Skip("swarm local ", "trains a local swarm for minutes (tests/test_cli.py runs short ones)"),
    Skip("scripts/demo.sh", "trains a local swarm for minutes"),
    Skip("scripts/test.sh", "runs the whole suite, this file included"),
    Skip(".venv/bin/python -m scripts.", "a benchmark or probe: minutes each (docs/benchmarks.md)"),
    Skip("python -m scripts.", "a benchmark or probe: minutes each (docs/benchmarks.md)"),
    Skip("for i in", "repeats a benchmark"),
    # need root or a trained model
    Skip("sudo ", "needs root: the soak runs peers in network namespaces"),
    Skip("python -m testbed", "needs root: network namespaces"),
    Skip("from testbed import NetLab", "needs root: network namespaces"),
    Skip("swarm export --checkpoint", "needs a trained peer's checkpoint (tests/test_export.py makes one)"),
    Skip("swarm generate ", "needs an exported model or a checkpoint (tests/test_export.py)"),
    Skip('from_pretrained("exported/")', "needs an exported model (tests/test_export_transformers.py)"),
    Skip('load_exported("exported/")', "needs an exported model (tests/test_export.py)"),
    # sketches: they name objects a program would have (a DHT, tensors, records), not runnable alone
    Skip("...send frames...", "a sketch of the codec calls around a network send"),
    Skip("GossipAverager(", "a sketch: needs a running DHT and partners"),
    Skip("HistoryWriter(", "a sketch: needs a peer's membership record"),
    Skip("spool_state(", "a sketch: needs a model's tensors and donors"),
    # changes the user's own setup
    Skip("ln -s ", "links into the user's ~/.local/bin"),
    Skip("swarm monitor plot", "needs the history a peer or monitor wrote during a run"),
)

EXIT_STATUS = {
    "--host-memory 12GiB": 1,  # the doc's example of a peer that does not fit
    "SWARM_TRAIN__LR=-1": 2,  # the doc's example of config errors
}


@dataclass(frozen=True)
class Example:
    """One command or Python block, and where the doc has it."""

    doc: str
    line: int
    kind: str  # "bash" or "python"
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _commands(block: str, console: bool) -> list[tuple[int, str]]:
    """``(line offset, command)`` of a shell block: continuation lines joined, comments and output
    (lines after a command in a ``console`` block, ``#`` lines in a ``bash`` one) left out."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    for offset, raw in enumerate(block.splitlines()):
        line = raw.rstrip()
        if not pending:
            if console and not line.startswith("$ "):
                continue
            line = line[2:] if console else line
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = offset
        pending.append(line.rstrip("\\").rstrip())
        if not line.endswith("\\"):
            commands.append((start, _without_comment(" ".join(part.strip() for part in pending))))
            pending = []
    return commands


def _without_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for index, char in enumerate(command):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and index and command[index - 1] == " ":
            return command[:index].rstrip()
    return command


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        name = str(doc.relative_to(REPO))
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the block's first line
            kind, block = match.group(1), match.group(2)
            if kind == "python":
                found.append(Example(name, line, "python", block))
                continue
            for offset, command in _commands(block, console=kind == "console"):
                found.append(Example(name, line + offset, "bash", command))
    return found


def _skip_reason(example: Example) -> str | None:
    return next((skip.why for skip in SKIPS if skip.text in example.text), None)


EXAMPLES = examples()


def test_the_extraction_finds_the_docs_examples() -> None:
    """A broken extraction would run nothing and pass: the known examples must be found and run."""
    by_id = {example.id: example for example in EXAMPLES}
    assert len(EXAMPLES) > 40, len(EXAMPLES)
    texts = [example.text for example in EXAMPLES if _skip_reason(example) is None]
    assert "swarm config check configs/gpt-125m.yaml" in texts
    assert any(text.startswith("SWARM_TRAIN__LR=-1 swarm config check run.yaml --set") for text in texts)
    assert any("from swarm.config import load_config" in text for text in texts)
    multiline = [e for e in by_id.values() if e.text.startswith("swarm bootstrap --config configs/gpt-125m")]
    assert multiline and all("--serve-state" in e.text or "--public-name" in e.text for e in multiline)
    assert all("#" not in text.split("'")[0].split('"')[0] for text in texts), "a comment was run"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("doc-examples")
    for name in ("configs", "scripts", ".venv"):
        (directory / name).symlink_to(REPO / name)
    shutil.copy(REPO / "configs" / "gpt-125m.yaml", directory / "run.yaml")
    (directory / "home").mkdir()
    return directory


SHELL_SYNTAX = re.compile(r"[|&;<>$`(){}*?]")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _swarm_argv(command: str) -> tuple[dict[str, str], list[str]] | None:
    """``(environment assignments, arguments)`` of a plain ``[VAR=value ...] swarm ARGS`` command,
    which runs in this process (no interpreter start-up per command); None for anything else."""
    if SHELL_SYNTAX.search(command):
        return None
    words = shlex.split(command)
    assignments = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        assignments[name] = value
    if not words or words[0] not in ("swarm", ".venv/bin/swarm"):
        return None
    return assignments, words[1:]


def _environment(workdir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWARM_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        HOME=str(workdir / "home"),
        SWARM_HOME=str(workdir / "home" / ".swarm"),
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    return env


def _run_swarm(assignments: dict[str, str], args: list[str], workdir: Path) -> tuple[int, str]:
    from typer.testing import CliRunner

    from peers.cli import app

    home = str(workdir / "home")
    args = [home + arg[1:] if arg.startswith("~/") else arg for arg in args]
    cleared = {key: None for key in os.environ if key.startswith("SWARM_")}
    env = {**cleared, "HOME": home, "SWARM_HOME": f"{home}/.swarm", **assignments}
    result = CliRunner().invoke(app, args, env=env)
    crash = result.exception if not isinstance(result.exception, SystemExit) else None
    trace = "".join(traceback.format_exception(crash)) if crash is not None else ""
    return result.exit_code, result.output + trace


def _run_shell(command: str, workdir: Path) -> tuple[int, str]:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=workdir,
        env=_environment(workdir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.id)
def test_the_doc_example_runs(example: Example, workdir: Path, monkeypatch, capsys) -> None:
    reason = _skip_reason(example)
    if reason is not None:
        pytest.skip(reason)
    if example.kind == "python":  # in this process, from the repository (snippets name its configs)
        monkeypatch.chdir(REPO)
        for key in [key for key in os.environ if key.startswith("SWARM_")]:
            monkeypatch.delenv(key)
        exec(compile(example.text, example.id, "exec"), {"__name__": "__doc_example__"})
        return
    monkeypatch.chdir(workdir)
    plain = _swarm_argv(example.text)
    status, output = _run_swarm(*plain, workdir) if plain else _run_shell(example.text, workdir)
    expected = next((status for text, status in EXIT_STATUS.items() if text in example.text), 0)
    assert status == expected, f"{example.id}: {example.text}\nexit {status}\n{output}"
    assert "Traceback" not in output, f"{example.id}: {example.text}\n{output}"
