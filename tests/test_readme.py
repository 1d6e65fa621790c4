"""The README's offline walkthrough runs as written: its blocks marked `<!-- runs-offline -->` are extracted from the
README (not copied here) and executed in a fresh folder, offline."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- runs-offline -->"
BLOCK = re.compile(re.escape(MARKER) + r"\s*```(python|bash)\n(.*?)```", re.DOTALL)


def offline_blocks() -> list[tuple[str, str]]:
    """`(language, code)` of every README block marked to run offline, in order."""
    return BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_offline_python_and_cli_walkthroughs():
    blocks = offline_blocks()
    languages = [language for language, _ in blocks]
    assert "python" in languages and "bash" in languages
    assert len(blocks) == (ROOT / "README.md").read_text(encoding="utf-8").count(MARKER)  # no marker misses its block
    cli = "\n".join(code for language, code in blocks if language == "bash")
    for step in ("calibrate", "generate", "chat", "eval", "inspect"):
        assert f"kvbridge {step} " in cli


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    return subprocess.run(command, cwd=cwd, env=env, text=True, capture_output=True, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(offline_blocks())))
def test_readme_offline_block_runs(index, tmp_path):
    language, code = offline_blocks()[index]
    (tmp_path / "eval_tasks").symlink_to(ROOT / "eval_tasks")  # the walkthrough runs from the repository root
    if language == "python":
        result = _run([sys.executable, "-c", code], tmp_path)
    else:
        result = _run(["bash", "-e", "-o", "pipefail", "-c", code], tmp_path)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
