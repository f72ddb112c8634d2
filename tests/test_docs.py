"""The docs cannot rot: every Python snippet in README.md and docs/*.md runs, and every relative
link in them and in benchmarks/RESULTS.md (and its archive) points at a file (and heading) that
exists, the README stays a front page and its recommendation table's figures are the current
results page's.

Markers, as the first comment line inside a ```python block or as an HTML comment on the line
before its fence (invisible on the rendered page):

* ``# doc-test: skip (why)``: not run; the reason is required and shows in pytest's skip list
  (``pytest -rs tests/test_docs.py``);
* ``<!-- doc-test: torchrun 2 -->``: run as a script under ``torchrun --nproc-per-node 2``.

Every other snippet runs in a fresh namespace; all of them share one subprocess (one import of
torch), with the launch variables of an outer torchrun removed and a one-rank process group torn
down between snippets.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from flexdemo.tools.ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
LINKED = [*DOCS, RESULTS, *sorted((ROOT / "benchmarks" / "archive").glob("*.md"))]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "NODE_RANK")
MARKER = re.compile(r"^\s*(?:#|<!--)\s*doc-test:\s*(\w+)\s*(.*?)\s*(?:-->)?\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\w*)")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    mode: str  # "run", "skip" or "torchrun"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(text: str):
    """(fence line, language, body lines, line before the fence) of every fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        before = lines[start - 1] if start else ""
        yield start + 1, lang, body, before


def snippets(path: Path) -> list[Snippet]:
    out = []
    for line, lang, body, before in _blocks(path.read_text()):
        if lang != "python":
            continue
        code = textwrap.dedent("\n".join(body))
        first = next((b for b in body if b.strip()), "")
        m = MARKER.match(first) or MARKER.match(before)
        if m is None:
            out.append(Snippet(path, line, code, "run"))
            continue
        mode, arg = m.group(1), m.group(2)
        if mode not in ("skip", "torchrun"):
            raise AssertionError(f"{path.name}:{line}: unknown doc-test marker {mode!r}")
        reason = arg.strip("() ")
        if mode == "skip" and not reason:
            raise AssertionError(f"{path.name}:{line}: '# doc-test: skip' needs a reason, "
                                 "e.g. '# doc-test: skip (needs torchrun)'")
        out.append(Snippet(path, line, code, mode, reason))
    return out


ALL = [s for p in DOCS for s in snippets(p)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", FLEXDEMO_TIMEOUT="60", PYTHONWARNINGS="ignore")
    return env


RUNNER = r"""
import contextlib, io, json, sys, traceback
import torch.distributed as dist
results = {}
for where, code in json.load(sys.stdin):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        results[where] = None
    except BaseException:
        results[where] = buf.getvalue()[-2000:] + traceback.format_exc(limit=-8)
    if dist.is_initialized():
        dist.destroy_process_group()
print("DOC-TEST-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, str | None]:
    """Every runnable snippet, run once in one subprocess: where -> None or the traceback."""
    todo = [(s.where, s.code) for s in ALL if s.mode == "run"]
    cwd = tmp_path_factory.mktemp("snippets")
    r = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(todo), text=True,
                       capture_output=True, cwd=cwd, env=_env(), timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("DOC-TEST-RESULTS ")), None)
    assert line is not None, f"the snippet runner failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("snippet", ALL, ids=[s.where for s in ALL])
def test_snippet_runs(snippet: Snippet, ran):
    if snippet.mode == "skip":
        pytest.skip(f"{snippet.where}: {snippet.reason}")
    if snippet.mode == "torchrun":
        pytest.skip(f"{snippet.where}: run under torchrun by its own test")
    error = ran[snippet.where]
    assert error is None, f"{snippet.where} failed:\n{error}"


def test_most_snippets_run():
    """Skips are the exception: each is explained, and most snippets run."""
    skipped = [s for s in ALL if s.mode == "skip"]
    assert len(ALL) >= 10, f"found only {len(ALL)} python snippets"
    assert len(skipped) * 3 <= len(ALL), [f"{s.where}: {s.reason}" for s in skipped]


@pytest.mark.multiprocess
def test_readme_usage_exchanges_bytes_on_two_processes(tmp_path):
    """The README's usage example, as written, under torchrun with 2 processes on one machine:
    both ranks train and every step sends and receives bytes."""
    usage = [s for s in snippets(ROOT / "README.md") if s.mode == "torchrun"]
    assert len(usage) == 1, "README.md should have one usage snippet marked for torchrun"
    script = tmp_path / "train.py"
    script.write_text(usage[0].code)
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                        "--log-dir", str(logs), "--redirects", "1", str(script)],
                       capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outs = sorted(logs.rglob("stdout.log"))
    assert len(outs) == 2, outs
    for rank, out in enumerate(sorted(outs, key=lambda p: p.parent.name)):
        steps = re.findall(r"^rank (\d+) step (\d+) loss \S+ (\{.*\})$", out.read_text(), re.M)
        assert [int(s) for _, s, _ in steps] == list(range(5)), out.read_text()
        for r_, _, stats in steps:
            assert int(r_) == rank
            stats = ast.literal_eval(stats)
            assert stats["bytes_sent"] > 0 and stats["bytes_received"] > 0, stats
            assert stats["collectives"] >= 1, stats


# ---------------------------------------------------------------------- links
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # images too


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().split("\n"):
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_code:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks and code spans."""
    out = []
    in_code = False
    for i, line in enumerate(path.read_text().split("\n"), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            out.append((i, m.group(1)))
    return out


@pytest.mark.parametrize("path", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_relative_links_resolve(path: Path):
    assert path.exists(), path
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}:{line}: {target} (no such file)")
        elif ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{path.name}:{line}: {target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}:{line}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


def test_every_doc_page_is_linked_from_the_readme():
    targets = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md")}
    missing = [p.name for p in DOCS[1:] if p.resolve() not in targets]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len(RESULTS.read_text().splitlines()) <= 300


def recommendation_rows(text: str) -> list[list[str]]:
    """The cells of the README's recommendation table: the table under the heading that asks
    what to run (its header row names the bytes and the gap)."""
    lines = text.split("\n")
    start = next(i for i, x in enumerate(lines) if x.startswith("## What should I run"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the header


FIGURE = re.compile(r"[+-]?\d+(?:\.\d+)?%?")


def test_recommendation_figures_are_the_results_pages():
    """Every number in the README's recommendation table (bytes per parameter per step, gaps)
    appears in the current results page: the front page quotes it, it does not own a figure."""
    rows = recommendation_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 5, rows
    results = RESULTS.read_text()
    missing = [(row[0], fig) for row in rows for cell in row[2:4]
               for fig in FIGURE.findall(re.sub(r"`[^`]*`", "", cell)) if fig not in results]
    assert not missing, f"README figures not in benchmarks/RESULTS.md: {missing}"
