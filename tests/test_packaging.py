"""The wheel and the sdist carry the card template and the pocket family (built offline with setuptools' backend)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
POCKET = ROOT / "hf_kvbridge" / "pocket"


def _pocket_files() -> list[str]:
    """Every shipped pocket file (models, data, results), relative to the repository root."""
    return sorted(str(p.relative_to(ROOT)) for p in POCKET.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = tmp_path_factory.mktemp("build")
    # the build backend writes build/ and *.egg-info next to pyproject.toml: build from a copy of the tree
    if not (ROOT / ".git").exists():
        pytest.skip("needs the source checkout (git) to know which files are part of the project")
    tree = build / "src"
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes(source.read_bytes())
    env = {"PIP_NO_INDEX": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        cwd=tree,
        check=True,
        env=env,
        timeout=600,
    )
    subprocess.run(
        [sys.executable, "-c", f"import setuptools.build_meta as b; b.build_sdist({str(out)!r})"],
        cwd=tree,
        check=True,
        env=env,
        timeout=600,
        capture_output=True,
    )
    return out


@pytest.mark.slow
def test_wheel_ships_the_card_template_and_the_pocket_family(dist):
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hf_kvbridge/model_cards/kvbridge.md" in names
    missing = [f for f in _pocket_files() if f not in names]
    assert missing == []
    assert any(n.startswith("hf_kvbridge/pocket/models/pocket-s/") and n.endswith(".safetensors") for n in names)
    assert "hf_kvbridge/pocket/data/calibration.jsonl.gz" in names
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_sdist_ships_the_card_template_and_the_pocket_family(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert "model_cards/kvbridge.md" in names
    assert [f for f in _pocket_files() if f not in names] == []
    assert {"pyproject.toml", "README.md"} <= names


@pytest.mark.slow
def test_wheel_ships_the_light_cli_and_the_benches_but_no_studies(dist):
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not any(n.startswith("studies/") for n in names)  # the studies run from a checkout
    light = ("__init__", "parser", "_light", "arguments", "settings_options", "bridge_commands", "tool_commands")
    assert {f"kvbridge_cli/{m}.py" for m in light} <= names
    assert {f"hf_kvbridge/tools/bench/{m}.py" for m in ("__init__", "mapper", "calibration", "vllm")} <= names
    # every package folder of the source tree is in the wheel (an explicit package list forgets new ones)
    packages = [p.parent for p in (ROOT / "hf_kvbridge").rglob("__init__.py") if "__pycache__" not in p.parts]
    missing = [
        str(p.relative_to(ROOT)) for p in packages if f"{p.relative_to(ROOT).as_posix()}/__init__.py" not in names
    ]
    assert missing == []
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvbridge = kvbridge_cli:main" in text
    assert "lm_eval.models" not in text  # lm-eval 0.4 reads no model entry points; import hf_kvbridge registers
