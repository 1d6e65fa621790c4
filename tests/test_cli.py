"""The `kvbridge` command line, run in-process on local folders."""

import json

from hf_kvbridge.cli.main import main
from tests.conftest import CORPUS


def test_calibrate_then_generate(saved_pair, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text(" ".join(CORPUS))
    out = tmp_path / "bridge"
    code = main(
        [
            "calibrate",
            saved_pair["small"],
            saved_pair["large"],
            "--data",
            str(data),
            "--out",
            str(out),
            "--top-k",
            "2",
            "--num-sequences",
            "12",
            "--seq-len",
            "32",
            "--head-mode",
            "same_head",
            "--kv-mode",
            "separate",
        ]
    )
    assert code == 0
    assert "held-out R²" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["head_mode"], config["kv_mode"]) == ("same_head", "separate")
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json"}  # the shared tokenizer travels with the bridge
    assert {p.name for p in out.iterdir()} == {"config.json", "mapper.safetensors", "README.md", *tokenizer_files}
    assert main(["generate", str(out), "The quick brown", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The quick brown")
    # a second calibrate into the same folder refuses before doing any work
    assert main(["calibrate", saved_pair["small"], saved_pair["large"], "--data", str(data), "--out", str(out)]) == 2


def test_help_imports_no_tool():
    """Building the parser (`kvbridge --help`) imports none of the studies, demo, bench or evaluation tools."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom kvbridge_cli import build_parser\nbuild_parser().format_help()\n"
        "print(sorted(m for m in sys.modules if m.startswith('hf_kvbridge.tools')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
