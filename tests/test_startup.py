"""Start-up cost: what `import hf_kvbridge` and the `kvbridge` command load, checked in fresh interpreters.

`import hf_kvbridge` loads the core (torch, transformers) and nothing of the tools, integrations, CLI or their
dependencies; `kvbridge --help`, `kvbridge CMD --help` and argument mistakes import neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# run the command, then (at exit, after argparse's SystemExit too) write the loaded module names to a file
CLI_PROBE = """
import atexit, json, os, sys
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
from kvbridge_cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MODULES_OUT": str(tmp_path / "mods.json")}


def _modules_after(code: str, tmp_path: Path) -> set[str]:
    probe = (
        f"{code}\nimport json, os, sys\nopen(os.environ['MODULES_OUT'], 'w').write(json.dumps(sorted(sys.modules)))"
    )
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_env(tmp_path), check=True, timeout=300)
    return set(json.loads((tmp_path / "mods.json").read_text()))


def _cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", CLI_PROBE, *args], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    return proc, set(json.loads((tmp_path / "mods.json").read_text()))


def _heavy(modules: set[str]) -> list[str]:
    roots = {"torch", "transformers", "hf_kvbridge", "numpy", "lm_eval", "vllm", "datasets"}
    return sorted(m for m in modules if m.split(".")[0] in roots)


def test_import_loads_the_core_only(tmp_path):
    loaded = _modules_after("import hf_kvbridge", tmp_path)
    assert {"torch", "transformers", "hf_kvbridge.configuration", "hf_kvbridge.errors"} <= loaded
    # the modeling stack (transformers' `PreTrainedModel`, with scipy and accelerate), the bridge class and the
    # calibration code load on first use; tools, integrations and their dependencies only where they are used
    never = [
        "transformers.modeling_utils",
        "hf_kvbridge.modeling",
        "hf_kvbridge.fitting.calibration",
        "hf_kvbridge.tools",
    ]
    never += ["hf_kvbridge.integrations", "hf_kvbridge.cli", "kvbridge_cli", "vllm", "datasets", "matplotlib"]
    assert [m for m in never if m in loaded] == []
    assert {m.split(".")[0] for m in loaded} & {"lm_eval", "scipy", "accelerate"} == set()


def test_the_public_names_load_on_first_use(tmp_path):
    code = """
import sys
import hf_kvbridge
assert "hf_kvbridge.fitting.calibration" not in sys.modules
from hf_kvbridge import calibrate, KVBridgeForCausalLM
from hf_kvbridge.fitting.calibration.calibrate import calibrate as direct
from hf_kvbridge.modeling import KVBridgeForCausalLM as cls
assert calibrate is direct and KVBridgeForCausalLM is cls and hf_kvbridge.KVStatistics.__name__ == "KVStatistics"
assert set(hf_kvbridge.__all__) <= set(dir(hf_kvbridge))
try:
    hf_kvbridge.no_such_name
except AttributeError as err:
    assert "no_such_name" in str(err)
else:
    raise AssertionError("no AttributeError")
"""
    _modules_after(code, tmp_path)


def test_auto_classes_load_a_saved_bridge_after_import(tmp_path, saved_pair):
    from hf_kvbridge import calibrate

    texts = [f"document {i}: " + "the bridge maps a cache, the target decodes from it. " * 20 for i in range(8)]
    bridge = calibrate(saved_pair["small"], saved_pair["large"], texts, num_sequences=8, seq_len=32, top_k=1)
    bridge.save_pretrained(tmp_path / "b")
    code = f"""
import sys
import hf_kvbridge
from transformers import AutoConfig, AutoModelForCausalLM
assert type(AutoConfig.for_model("kvbridge")).__name__ == "KVBridgeConfig"
assert "hf_kvbridge.modeling" not in sys.modules
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "b")!r})
assert type(model) is hf_kvbridge.KVBridgeForCausalLM, type(model)
# once imported, the modeling module has put the class itself in the Auto table
assert AutoModelForCausalLM._model_mapping[hf_kvbridge.KVBridgeConfig] is hf_kvbridge.KVBridgeForCausalLM
"""
    _modules_after(code, tmp_path)


def test_lm_eval_finds_the_bridge_after_importing_the_integration(tmp_path):
    code = """
import sys
import hf_kvbridge.integrations.lm_eval
from lm_eval.api.registry import get_model
assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still found
assert get_model("kvbridge").__name__ == "KVBridgeLM"
"""
    _modules_after(code, tmp_path)


@pytest.mark.parametrize(
    "args, status, needle",
    [
        (["--help"], 0, "calibrate"),
        (["calibrate", "--help"], 0, "--statistics-device"),
        (["bench", "vllm", "--help"], 0, "--shapes"),
        (["calibrate", "a", "b", "--out", "o", "--top-k", "0"], 2, "--top-k"),
        (["calibrate", "a", "b", "--out", "o", "--heldout-fraction", "1.5"], 2, "heldout_fraction"),
        (["calibrate", "a", "b", "--out", "o", "--data", "./no/such.jsonl"], 2, "does not exist"),
        (["nosuchcommand"], 2, "invalid choice"),
        # the options and checks read from the tools' standard-library modules (`kvbridge_cli._light`)
        (["tune", "--help"], 0, "--recompute-layers"),
        (["demo", "--help"], 0, "--quick"),
        (["bench", "mapper", "--help"], 0, "256,1024,4096"),
        (["tune", "a", "b", "--eval-data", "pocket", "--out", "o"], 2, "--min-retention"),
        (["calibrate", "a", "b", "--out", "docs"], 2, "is not empty"),
        (["eval", "b", "--tasks", "t", "--modes", "bridge,nope"], 2, "unknown modes ['nope']"),
    ],
)
def test_cli_answers_help_and_mistakes_without_torch(tmp_path, args, status, needle):
    proc, loaded = _cli(tmp_path, *args)
    assert proc.returncode == status, proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert _heavy(loaded) == []


def test_a_command_imports_only_its_own_module():
    """`kvbridge calibrate` loads the calibration command's module, not the benchmarks', lm-eval's or vLLM's
    (`kvbridge_cli.COMMANDS` names each command's module; `command_function` imports it when the command runs)."""
    code = (
        "import sys\n"
        "from kvbridge_cli import COMMANDS, command_function\n"
        "assert callable(command_function('calibrate'))\n"
        "loaded = [m for m in ('hf_kvbridge.cli.bench', 'hf_kvbridge.cli.evaluate', 'hf_kvbridge.cli.tune',\n"
        "          'hf_kvbridge.integrations.vllm', 'lm_eval') if m in sys.modules]\n"
        "assert all(callable(command_function(name)) for name in COMMANDS)\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_settings_validate_without_torch():
    """`CalibrationSettings` validates every value, the memory budget and the mapper type's keywords included,
    with the standard library alone (read as the light entry reads it), and refuses a bad one there."""
    code = (
        "import sys\n"
        "from kvbridge_cli._light import core\n"
        "settings = core('settings')\n"
        "settings.CalibrationSettings(statistics_memory='1.5GB', mapper_type='low_rank', mapper_kwargs={'rank': 4})\n"
        "try:\n"
        "    settings.CalibrationSettings(mapper_type='mlp', mapper_kwargs={'rank': 4})\n"
        "except ValueError as err:\n"
        "    print('refused:', err)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    refused, torch_loaded = out.stdout.strip().splitlines()
    assert "mapper_type 'mlp' takes mapper_kwargs" in refused and "not ['rank']" in refused
    assert torch_loaded == "False"
