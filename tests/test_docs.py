"""The README and docs/ say what is true: the experiment-file reference is what the models say, every
shell block pastes into a fresh shell, the cheap blocks run and print what the docs promise, and
every relative link leads somewhere.

Markers (docs/internals.md, "The docs' commands"): a fenced block whose info string is `bash
runnable` must run when pasted at the repository root; an HTML comment `<!-- doc-test: ... -->` on
the line before one makes this test run it (`exit=N`, default 0; `expect="text"`, a line of its
output must contain the text; `timeout=S`, default 120 s), in order, per document, each block in a fresh `bash`, in a temporary
copy of the repository whose `.dagster_home` is what `make demo` sets up before it trains.
"""

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dagster_rl.core.experiment_reference import reference
from tests import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REFERENCE = REPO / "docs" / "experiment-file.md"
BLOCK_TIMEOUT_S = 120  # one block; the whole marked set takes ~40-60 s on 2 shared cores
DOC_TEST = re.compile(r"^<!--\s*doc-test:(?P<args>.*?)-->\s*$")
ARG = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')
# a Dagster command at a command position (line start, after ; && || | $( or `env` assignments)
BARE = re.compile(r"(?:^|[;&|(]\s*|^\s*(?:\w+=\S+\s+)+)(dagster(?:-rl|-daemon|-webserver)?)(?=\s|$)", re.M)
NEEDS_HOME = re.compile(r"\.venv/bin/dagster(?:-rl|-daemon|-webserver)?\b(?!.*(?:--help|\bserve\b|\bsandbox\b))")
SETS_HOME = re.compile(r'^export DAGSTER_HOME=("?)(\$PWD|/)', re.M)


@dataclass
class Block:
    doc: Path
    line: int
    info: str
    text: str
    test: dict[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the doc-test marker on the line before each."""
    out, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info, start = lines[i][3:].strip(), i
            marker = DOC_TEST.match(lines[i - 1]) if i else None
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            test = {m[1]: m[2] if m[2] is not None else m[3] for m in ARG.finditer(marker["args"])} if marker else None
            out.append(Block(doc, start + 1, info, "\n".join(body) + "\n", test))
        i += 1
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
SHELL = [b for b in ALL_BLOCKS if b.info.split()[:1] == ["bash"]]


def test_experiment_reference_is_current():
    assert REFERENCE.exists(), "docs/experiment-file.md is missing: run `make docs`"
    assert REFERENCE.read_text() == reference(), "docs/experiment-file.md differs from the models: run `make docs`"


def test_reference_documents_every_field_and_fork_of():
    text = reference()
    from dagster_rl.tasks.lm.experiment import LMExperiment
    from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment

    for model in (LMExperiment, SecretSearchExperiment):
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} is not in the reference"
    assert "| `fork_of` | str \\| null | null | matches" in text
    assert "shares its parent's artifact cache" in text
    assert "| `rank` | int | `8` | >= 1, <= 16,384 |" in text  # bounds read from the model


def test_docs_have_runnable_blocks_and_doc_tests():
    """The markers this file relies on are there: a test that finds no block would pass on anything."""
    runnable = [b for b in SHELL if "runnable" in b.info.split()]
    tested = [b for b in ALL_BLOCKS if b.test is not None]
    assert len(runnable) >= 10, [b.where for b in runnable]
    assert {b.doc.name for b in tested} >= {"README.md", "experiment-file.md", "operating-runs.md", "vllm.md"}
    for b in tested:
        assert "runnable" in b.info.split(), f"{b.where}: a doc-test marker on a block not marked `bash runnable`"


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_shell_block_pastes_into_a_fresh_shell(block: Block):
    """`.venv/bin/...`, never a bare `dagster`/`dagster-rl` (not on PATH); a block that reads the
    instance sets an absolute DAGSTER_HOME itself (Dagster refuses a relative one)."""
    code = "\n".join(
        line.split(" #")[0] for line in block.text.splitlines() if not line.lstrip().startswith("#")
    )  # comments may name commands
    bare = BARE.findall(code)
    assert not bare, f"{block.where}: bare {bare[0]!r}: write .venv/bin/{bare[0]} (it is not on PATH)"
    if NEEDS_HOME.search(code):
        assert SETS_HOME.search(code), (
            f'{block.where}: runs a Dagster command without `export DAGSTER_HOME="$PWD/.dagster_home"` (absolute) in the block'
        )


def _copy_of_repo(tmp_path: Path, with_home: bool) -> Path:
    """The repository as a fresh clone would have it after `make demo`'s set-up: its files linked,
    `experiments/` copied (blocks add files to it), and, for blocks that use it, `.dagster_home` made
    by the Makefile's own rule (the instance config and `dagster instance migrate`), with nothing trained."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name in (".dagster_home", "experiments", ".git") or entry.name.startswith(".pytest"):
            continue
        (root / entry.name).symlink_to(entry)
    shutil.copytree(REPO / "experiments", root / "experiments")
    if not with_home:
        return root
    made = subprocess.run(
        ["make", "-s", f"{root}/.dagster_home/dagster.yaml"],
        cwd=root,
        env=_fresh_env(root),
        timeout=120,
        capture_output=True,
        text=True,
    )  # the Makefile's DAGSTER_HOME is $(CURDIR)/.dagster_home
    assert made.returncode == 0, made.stdout + made.stderr
    return root


def _fresh_env(root: Path) -> dict[str, str]:
    """A new terminal's environment: no DAGSTER_HOME, no venv on PATH. The code location reads the
    copy's experiments (the installed package points at the repository's own folder)."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "ATEN_CPU_CAPABILITY")}
    env["DAGSTER_RL_EXPERIMENTS"] = str(root / "experiments")
    env.pop("DAGSTER_HOME", None)
    return env


TESTED_DOCS = sorted({b.doc for b in ALL_BLOCKS if b.test is not None})


@pytest.mark.parametrize("doc", TESTED_DOCS, ids=lambda d: d.name)
def test_marked_blocks_run(doc: Path, tmp_path: Path):
    tested = [b for b in blocks(doc) if b.test is not None]
    root = _copy_of_repo(tmp_path, with_home=any("DAGSTER_HOME" in b.text for b in tested))
    took = []
    for block in tested:
        started = time.monotonic()
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=root,
            env=_fresh_env(root),
            capture_output=True,
            text=True,
            timeout=float(block.test.get("timeout", BLOCK_TIMEOUT_S)),  # a marker's timeout=S: a longer block
        )
        took.append(f"{block.where} {time.monotonic() - started:.1f} s")
        output = result.stdout + result.stderr
        expected_exit = int(block.test.get("exit", "0"))
        assert result.returncode == expected_exit, f"{block.where}: exit {result.returncode}, expected {expected_exit}:\n{output}"
        if "expect" in block.test:
            assert any(block.test["expect"] in line for line in output.splitlines()), (
                f"{block.where}: no line of its output contains {block.test['expect']!r}:\n{output}"
            )
    print("\n".join(took))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    out, in_code = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6} (.*)$", line)):
            out.add(_slug(m[1]))
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_lead_somewhere():
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no file {path})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)


def test_slug_is_githubs():
    assert _slug("Forks: `fork_of`") == "forks-fork_of"
    assert _slug("1. The UI: a backfill") == "1-the-ui-a-backfill"
    assert _slug("Rollouts on a real vLLM") == "rollouts-on-a-real-vllm"
