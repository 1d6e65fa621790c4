"""Every code block of README.md and docs/*.md runs as written, offline, on the pocket family.

Blocks are extracted from the pages (not copied here). Each `python` or `bash` block must be marked
`<!-- runs-offline -->` (run by this suite), `<!-- runs-offline: vllm -->` (run by `.ci/vllm.sh`, in the venv that
has vLLM) or, for the README's two set-up commands, `<!-- set-up -->` (the test command is what `.ci/run` runs,
checked here); a page's blocks run in order in one fresh folder, so a later block may use what an earlier one saved.
Anything else fenced (diagrams, formulas, sample output) is `text`.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"<!-- (?:runs-offline(?:: (\w+))?|(set-up)) -->\s*$")
RUNNABLE = ("python", "bash")


def page_blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """`(language, code, requirement)` of every fenced block of `page`, in order; `requirement` is `None` for a
    block this suite runs, `"vllm"` for one `.ci/vllm.sh` runs, `"set-up"` for a set-up command, `"text"` for a
    block that is not code and `"unmarked"` for a runnable block without a marker."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        language, code = match.group(1), match.group(2)
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        if language not in RUNNABLE:
            requirement = "text"
        elif marker is None:
            requirement = "unmarked"
        else:
            requirement = marker.group(2) or marker.group(1)
        blocks.append((language, code, requirement))
    return blocks


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_runnable_block_is_marked():
    for page in PAGES:
        for language, code, requirement in page_blocks(page):
            assert requirement != "unmarked", f"{_name(page)}: a {language} block is not marked to run:\n{code[:300]}"
            assert language, f"{_name(page)}: a fenced block has no language (use text for non-code):\n{code[:300]}"
        text = page.read_text(encoding="utf-8")
        marked = sum(1 for _, _, requirement in page_blocks(page) if requirement not in ("text", "unmarked"))
        markers = text.count("<!-- runs-offline") + text.count("<!-- set-up -->")
        assert marked == markers, f"{_name(page)}: a marker is not followed by its block"
        if page.name != "README.md":
            assert "<!-- set-up -->" not in text, f"{_name(page)}: set-up commands belong in the README"


def test_set_up_commands_are_what_ci_runs():
    setup = [code.strip() for _, code, requirement in page_blocks(ROOT / "README.md") if requirement == "set-up"]
    assert len(setup) == 2
    main_job, tests = setup
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert tests in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    venv_and_torch = "python3 -m venv .venv && . .venv/bin/activate && pip install"
    assert main_job.startswith(venv_and_torch) and "torch==2.13.0" in main_job
    assert main_job.endswith("HF_HUB_OFFLINE=1 kvbridge demo")


def test_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    blocks = page_blocks(ROOT / "README.md")
    assert {"python", "bash"} <= {language for language, _, requirement in blocks if requirement is None}
    cli = "\n".join(code for language, code, _ in blocks if language == "bash")
    for step in ("calibrate", "generate", "chat", "eval", "inspect", "bench"):
        assert f"kvbridge {step} " in cli
    for link in re.findall(r"\]\(((?:docs|studies|hf_kvbridge|eval_tasks)/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def _run_page(page: Path, requirement: str | None, tmp_path: Path) -> None:
    blocks = [(language, code) for language, code, req in page_blocks(page) if req == requirement]
    (tmp_path / "eval_tasks").symlink_to(ROOT / "eval_tasks")  # the pages run from the repository root
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    for index, (language, code) in enumerate(blocks):
        if language == "python":
            command = [sys.executable, "-c", code]
        else:
            command = ["bash", "-e", "-o", "pipefail", "-c", code]
        result = subprocess.run(command, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=1200)
        where = f"{_name(page)}, {language} block {index + 1} of {len(blocks)}"
        assert result.returncode == 0, f"{where}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, f"{where}\n{result.stderr[-3000:]}"


def _pages_with(requirement: str | None) -> list[Path]:
    return [page for page in PAGES if any(req == requirement for _, _, req in page_blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with(None), ids=_name)
def test_page_blocks_run(page, tmp_path):
    _run_page(page, None, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM blocks run in .ci/vllm.sh's venv")
@pytest.mark.parametrize("page", _pages_with("vllm"), ids=_name)
def test_page_vllm_blocks_run(page, tmp_path):
    _run_page(page, "vllm", tmp_path)


# ---- commands named in the text parse as written ------------------------------------------------------------------

_PARSE_ONLY = """
import argparse, json, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit("parsed")
argparse.ArgumentParser.parse_args = parse_and_stop
for words in json.loads(sys.argv[1]):
    sys.argv = [words[2], *words[3:]]
    try:
        runpy.run_module(words[2], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        print(json.dumps([" ".join(words), stop.code == "parsed"]), flush=True)
"""


def named_commands(page: Path) -> list[str]:
    """Every `kvbridge ...` and `python -m studies.X ...` command of `page`, in inline code or in a block, without
    placeholders (an all-capitals word such as DIR or SOURCE, or `...`) and with `[optional parts]` left out: each must
    parse as written. A bare reference (`kvbridge eval`, `kvbridge calibrate --top-k`) lacks the required arguments and
    is passed over."""
    text = page.read_text(encoding="utf-8")
    spans = [code for _, code in FENCE.findall(text)]
    spans += re.findall(r"`([^`]+)`", FENCE.sub("", text).replace("\n", " "))
    commands = []
    for span in spans:
        for line in span.replace("\\\n", " ").splitlines():
            match = re.search(r"(?:^|\s)((?:kvbridge|python -m studies\.\w+)\s.*?)(?:\s+#.*)?$", line)
            if not match:
                continue
            command = re.sub(r"\[[^\]]*\]", " ", match.group(1))  # [--optional parts] of a usage line
            command = re.split(r"\s*(?:&&|\||;|&)\s*", command)[0].strip()
            words = command.split()
            if "..." in command or any(re.fullmatch(r"[A-Z][A-Z_:]*", word) for word in words):
                continue
            if words[0] == "kvbridge" and len(words) > 1 and not words[1].startswith("-"):
                commands.append(command)
            elif words[0] == "python":
                commands.append(command)
    return commands


@pytest.mark.parametrize("page", [*PAGES, ROOT / "studies" / "README.md"], ids=_name)
def test_named_commands_parse(page):
    import contextlib
    import io
    import shlex

    from kvbridge_cli.parser import build_parser

    commands = named_commands(page)
    assert commands, f"{_name(page)} names no command"
    studies = []
    for command in commands:
        words = shlex.split(command)
        if words[0] != "kvbridge":
            studies.append(words)
        elif words[1] != "serve":  # everything after serve's bridge goes to vLLM's own parser
            errors = io.StringIO()
            try:
                with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                    build_parser().parse_args(words[1:])
            except SystemExit as stop:
                said = errors.getvalue()
                reference = any(why in said for why in ("arguments are required", "expected one argument"))
                if stop.code != 0 and not reference:
                    pytest.fail(f"{_name(page)}: `{command}` does not parse: {said.strip()[-300:]}")
            except Exception as error:  # an option's type refusing its value
                pytest.fail(f"{_name(page)}: `{command}` does not parse: {error}")
    if studies:  # one process parses them all (each study imports the package)
        result = subprocess.run(
            [sys.executable, "-c", _PARSE_ONLY, json.dumps(studies)],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=300,
        )
        parsed = dict(json.loads(line) for line in result.stdout.splitlines() if line.startswith("["))
        for words in studies:
            assert parsed.get(" ".join(words)), (
                f"{_name(page)}: `{' '.join(words)}` does not parse\n{result.stderr[-2000:]}"
            )
