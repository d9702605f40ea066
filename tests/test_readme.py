"""The README and the reference pages show commands that work as written.

Every line of their ```bash blocks is read. Lines that need no server or cluster and finish in
seconds run: the heredocs that write example files (whose lines must then be accepted by pdserve's
own readers and schemas) and `--help` lines. For the rest (serve, bench, ray, make, ...) every
`pdserve <command> --flag` must be listed by that command's `--help`, every `python -m` target
must exist, and every `make` target must be in the Makefile. Every repository path the pages name,
in a command or in prose, must exist, and every flag the prose names must be one pdserve has.
No Ray, no network, no model: a few `--help` runs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "docs/HTTP_API.md",
    "docs/BATCH.md",
    "docs/CONFIGURATION.md",
    "docs/METRICS.md",
    "docs/DEPLOYMENT.md",
    "docs/BENCHMARKING.md",
    "docs/BENCHMARKS.md",
]
# Flags of other tools that the pages' prose names (pip, ray, vLLM): not pdserve's to check.
FOREIGN_FLAGS = {
    "--no-deps",
    "--working-dir",
    "--address",
    "--head",
    "--generate",
    "--gpu-memory-utilization",
}
# The project's packages: `python -m` of anything else (a server, a tool) is not ours to check.
PACKAGES = ("scheduler", "workers", "deploy", "benchmarks", "tests")
# What the pages name that lives in the repository: its packages' paths and its root files.
REPO_PATH = re.compile(
    r"(?<![\w./~-])"
    r"((?:scheduler|workers|deploy|benchmarks|tests|docs)/[\w./*-]*[\w/*]"
    r"|cluster\.yaml|Makefile|pyproject\.toml|README\.md)"
    r"(?![\w-])"
)
PYTHON_M = re.compile(r"python3? -m ([\w.]+)")
SPAN = re.compile(r"`([^`\n]+)`")
SHELL_OPERATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class Line:
    """One command line of a ```bash block: continuations joined, with its heredoc's text."""

    page: str
    number: int  # of the line's first row in the page
    text: str
    heredoc: str | None = None  # the text a `<<'END'` feeds the command
    heredoc_end: str = ""  # that END

    def script(self) -> str:
        """The line as a shell would read it, heredoc included."""
        if self.heredoc is None:
            return self.text
        return f"{self.text}\n{self.heredoc}{self.heredoc_end}\n"

    def where(self) -> str:
        return f"{self.page}:{self.number}: `{self.text.strip()[:80]}`"


def bash_lines(page: str) -> list[Line]:
    rows = (ROOT / page).read_text(encoding="utf-8").splitlines()
    lines: list[Line] = []
    i = 0
    in_bash = False
    while i < len(rows):
        row = rows[i]
        if row.startswith("```"):
            in_bash = not in_bash and row.strip() == "```bash"
            i += 1
            continue
        if not in_bash or not row.strip() or row.lstrip().startswith("#"):
            i += 1
            continue
        start = i
        text = row
        while text.rstrip().endswith("\\") and i + 1 < len(rows):
            i += 1
            text = text.rstrip()[:-1] + " " + rows[i].strip()
        line = Line(page, start + 1, text)
        marker = re.search(r"<<-?\s*'?(\w+)'?", text)
        if marker:
            end = rows.index(marker.group(1), i + 1)
            heredoc = "\n".join(rows[i + 1 : end]) + "\n"
            line = Line(page, start + 1, text, heredoc, marker.group(1))
            i = end
        lines.append(line)
        i += 1
    return lines


def prose(page: str) -> Iterator[tuple[int, str]]:
    """The page's rows outside code blocks, numbered."""
    fenced = False
    for number, row in enumerate((ROOT / page).read_text(encoding="utf-8").splitlines(), 1):
        if row.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, row


def commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line: comments dropped, split at &&, ;, |, and the
    command after `--` of `ray job submit` taken apart as one of its own."""
    if "<<" in text:
        text = text[: text.index("<<")]
    tokens = shlex.split(text, comments=True)
    found: list[list[str]] = [[]]
    for token in tokens:
        if token in SHELL_OPERATORS:
            found.append([])
        else:
            found[-1].append(token)
    simple = []
    for argv in found:
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
            argv = argv[1:]  # VAR=value before a command
        if argv[:1] == ["ray"] and "--" in argv:
            cut = argv.index("--")
            simple += [argv[:cut], argv[cut + 1 :]]
        elif argv:
            simple.append(argv)
    return simple


# --- what the tools say they take -------------------------------------------------------------


def run_here(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


@functools.cache
def help_text(*command: str) -> str:
    """`pdserve <command> --help` (or a module's), run once per command."""
    if command[:1] == ("-m",):
        argv = [sys.executable, *command, "--help"]
    else:
        argv = [sys.executable, "-m", "deploy.cli", *command, "--help"]
    result = run_here(argv)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stderr[-2000:]}"
    return result.stdout


def usage_flags(help_output: str) -> set[str]:
    """The options an argparse usage block lists (not flags its descriptions mention)."""
    usage = help_output.split("\n\n")[0]
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", usage))


@functools.cache
def subcommands() -> set[str]:
    usage = help_text().split("\n\n")[0]
    return set(re.search(r"\{([\w,-]+)\}", usage).group(1).split(","))


@functools.cache
def every_pdserve_flag() -> set[str]:
    flags = usage_flags(help_text())
    for sub in subcommands():
        flags |= usage_flags(help_text(sub))
    return flags


@functools.cache
def module_flags(page: str) -> set[str]:
    """The options of the project's modules that the page's bash blocks run with flags."""
    flags: set[str] = set()
    for line in bash_lines(page):
        for argv in commands(line.text):
            if not (Path(argv[0]).name.startswith("python") and "-m" in argv):
                continue
            module = argv[argv.index("-m") + 1]
            ours = module.split(".")[0] in PACKAGES and importlib.util.find_spec(module)
            if ours and any(a.startswith("--") for a in argv[argv.index("-m") + 2 :]):
                flags |= usage_flags(help_text("-m", module))
    return flags


@functools.cache
def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([\w-]+):", makefile, flags=re.M))


# --- the checks ------------------------------------------------------------------------------


def pdserve_problems(argv: list[str], where: str) -> list[str]:
    """argv starts after `pdserve`: global options, the command, its flags."""
    problems = []
    args = list(argv)
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag not in usage_flags(help_text()) | {"--help"}:
            problems.append(f"{where}: `pdserve {flag}`: not an option of pdserve")
    if not args:
        return problems
    sub = args.pop(0)
    if sub.startswith("<"):  # a placeholder such as <command>
        known = every_pdserve_flag()
    elif sub not in subcommands():
        return problems + [f"{where}: `pdserve {sub}`: no such command (pdserve --help)"]
    else:
        known = usage_flags(help_text(sub))
    for arg in args:
        flag = arg.split("=")[0]
        if flag.startswith("--") and flag not in known | {"--help"}:
            problems.append(f"{where}: `pdserve {sub} {flag}`: no such flag (pdserve {sub} --help)")
    return problems


def module_problems(argv: list[str], where: str) -> list[str]:
    """`python -m module ...`: the module exists and takes the flags used."""
    module = argv[argv.index("-m") + 1]
    if module.split(".")[0] not in PACKAGES:
        return []
    if importlib.util.find_spec(module) is None:
        return [f"{where}: `python -m {module}`: no such module"]
    flags = [a.split("=")[0] for a in argv[argv.index("-m") + 2 :] if a.startswith("--")]
    if not flags:
        return []
    known = usage_flags(help_text("-m", module)) | {"--help"}
    return [f"{where}: `python -m {module} {f}`: no such flag" for f in flags if f not in known]


def path_problems(text: str, where: str) -> list[str]:
    missing = []
    for path in REPO_PATH.findall(text):
        path = path.rstrip("/.")
        if not any(ROOT.glob(path)):
            missing.append(f"{where}: `{path}`: no such file in the repository")
    return missing


@functools.cache
def body_schemas() -> dict[str, type]:
    """The request body each endpoint validates (pdserve's HTTP contract)."""
    from deploy.serving.responses.request import ResponsesBody
    from deploy.serving.schemas import ChatBody, CompletionBody

    return {
        "/v1/chat/completions": ChatBody,
        "/v1/completions": CompletionBody,
        "/v1/responses": ResponsesBody,
    }


def body_problems(url: str, body: dict, where: str) -> list[str]:
    path = "/v1/" + url.split("/v1/", 1)[1] if "/v1/" in url else url
    schema = body_schemas().get(path)
    if schema is None:
        return []
    try:
        schema.model_validate(body)
    except Exception as e:  # pydantic's ValidationError, or the schema's own ValueError
        return [f"{where}: the {path} body is refused: {e}"]
    return []


def written_file_problems(path: Path, where: str) -> list[str]:
    """A JSONL file an example writes: `pdserve generate` must accept every line."""
    from deploy.batch import read_lines
    from deploy.openai_batch import is_openai_batch, read_batch

    try:
        if not is_openai_batch(path):
            read_lines(path)
            return []
        problems = []
        for line in read_batch(path):
            problems += body_problems(line.url, line.body, f"{where} ({line.custom_id})")
        return problems
    except Exception as e:
        return [f"{where}: pdserve generate would refuse {path.name}: {e}"]


def curl_problems(argv: list[str], where: str) -> list[str]:
    url = next((a for a in argv if a.startswith("http")), "")
    if "-d" not in argv:
        return []
    raw = argv[argv.index("-d") + 1]
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        return [f"{where}: the -d body is not JSON: {e}"]
    return body_problems(url, body, where)


def line_problems(line: Line, workdir: Path) -> list[str]:
    where = line.where()
    problems = path_problems(line.text, where)
    for argv in commands(line.text):
        name = Path(argv[0]).name
        if name == "pdserve":
            if "--help" in argv:
                result = run_here(argv=[sys.executable, "-m", "deploy.cli", *argv[1:]])
                if result.returncode != 0:
                    problems.append(f"{where}: exits {result.returncode}: {result.stderr[-500:]}")
            problems += pdserve_problems(argv[1:], where)
        elif name.startswith("python") and "-m" in argv:
            problems += module_problems(argv, where)
        elif name.startswith("python") and argv[1:] == ["-"] and line.heredoc is not None:
            try:
                compile(line.heredoc, where, "exec")
            except SyntaxError as e:
                problems.append(f"{where}: the Python it feeds does not parse: {e}")
        elif name == "make":
            problems += [
                f"{where}: `make {t}`: no such target in the Makefile"
                for t in argv[1:]
                if not t.startswith("-") and t not in make_targets()
            ]
        elif name == "cat" and ">" in argv and line.heredoc is not None:
            target = workdir / argv[argv.index(">") + 1]
            result = run_here(["bash", "-c", line.script()], cwd=workdir)
            if result.returncode != 0:
                problems.append(f"{where}: exits {result.returncode}: {result.stderr[-500:]}")
            else:
                problems += written_file_problems(target, where)
        elif name == "curl":
            problems += curl_problems(argv, where)
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_bash_blocks_work_as_written(page, tmp_path):
    lines = bash_lines(page)
    assert lines or page != "README.md", "the README's ```bash blocks were not found"
    problems = [p for line in lines for p in line_problems(line, tmp_path)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_prose_names_what_exists(page):
    """Paths, `python -m` modules, `pdserve ...` commands and flags named outside code blocks."""
    problems = []
    known = every_pdserve_flag() | FOREIGN_FLAGS | module_flags(page)
    for number, row in prose(page):
        where = f"{page}:{number}"
        problems += path_problems(row, where)
        for module in PYTHON_M.findall(row):
            if module.split(".")[0] in PACKAGES and importlib.util.find_spec(module) is None:
                problems.append(f"{where}: `python -m {module}`: no such module")
        for span in SPAN.findall(row):
            words = span.split()
            if words[0] == "pdserve":
                problems += pdserve_problems(words[1:], f"{where}: `{span}`")
            elif words[0].startswith("--"):
                for word in words:
                    flag = word.split("=")[0]
                    if flag.startswith("--") and flag not in known:
                        problems.append(f"{where}: `{flag}`: not a flag of a command the page runs")
    assert not problems, "\n".join(problems)


def test_readme_is_a_guide():
    """Under 300 lines, with the two commands a newcomer needs, linking every reference page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
    assert "make serve" in readme and "make test" in readme
    unlinked = [page for page in PAGES[1:] if f"({page})" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"
