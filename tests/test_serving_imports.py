"""Serving loads no fitting code: a bridge of every registered mapper type (and a same-head one), calibrated and saved
here, is loaded in a fresh interpreter, generates and runs a handoff turn, and `sys.modules` holds no module of
`hf_kvbridge.fitting` (nor one of its old import paths) afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hf_kvbridge
from hf_kvbridge.fitting.mapper_fits import refit
from hf_kvbridge.mappers import MAPPER_REGISTRY
from tests.conftest import CORPUS

FIT_KWARGS = {
    "ridge_attention_weighted": {},
    "low_rank": {"rank": 4},
    "mlp": {"hidden": 8, "epochs": 1, "steps_per_batch": 1},
}
TEMPLATE = "{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}<eos>assistant:"

# in a fresh interpreter: load, generate, one handoff turn (the source answers, the target continues from the map)
SERVE = """
import json, sys
import torch
from transformers import AutoTokenizer
from hf_kvbridge.modeling import KVBridgeForCausalLM
from hf_kvbridge.transfer.session import HandoffSession

bridge = KVBridgeForCausalLM.from_pretrained(sys.argv[1])
ids = torch.arange(3, 19).unsqueeze(0)
out = bridge.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
tokenizer.chat_template = sys.argv[3]
session = HandoffSession(bridge, tokenizer)
session.add_user("the fox")
session.generate(model="source", max_new_tokens=2, do_sample=False)
session.add_user("a key")
turn = session.generate(model="target", max_new_tokens=2, do_sample=False)
fitting = sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[4:])))
print(json.dumps({"mapper": type(bridge.mapper).__name__, "new": out.shape[1] - ids.shape[1],
                  "mapped": turn.mapped_tokens, "fitting": fitting}))
"""
# the fitting side, under its new and its old import paths
FITTING = ("hf_kvbridge.fitting", *hf_kvbridge.MOVED_MODULES)


@pytest.fixture(scope="module")
def ridge_bridges(saved_pair):
    return {
        mode: hf_kvbridge.calibrate(
            saved_pair["small"],
            saved_pair["large"],
            CORPUS,
            num_sequences=16,
            seq_len=32,
            top_k=2,
            batch_size=4,
            head_mode=mode,
            keep_statistics=True,
        )
        for mode in ("all_heads", "same_head")
    }


CASES = [(name, "all_heads") for name in MAPPER_REGISTRY] + [("ridge", "same_head")]


@pytest.mark.parametrize(("mapper_type", "head_mode"), CASES, ids=[f"{t}-{h}" for t, h in CASES])
def test_serving_a_bridge_loads_no_fitting_module(ridge_bridges, saved_pair, tmp_path, mapper_type, head_mode):
    bridge = ridge_bridges[head_mode]
    if mapper_type != "ridge":
        windows = torch.randint(0, 128, (8, 24), generator=torch.Generator().manual_seed(0))
        bridge = refit(bridge, mapper_type, windows=windows, batch_size=4, **FIT_KWARGS[mapper_type])
    assert bridge.config.mapper_type == mapper_type
    bridge.save_pretrained(tmp_path / "bridge")
    argv = [str(tmp_path / "bridge"), saved_pair["large"], TEMPLATE, *FITTING]
    out = subprocess.run([sys.executable, "-c", SERVE, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["new"] == 3 and result["mapped"] > 0
    assert result["mapper"] == MAPPER_REGISTRY[mapper_type].mapper_class.__name__
    assert result["fitting"] == [], f"serving a {mapper_type} bridge loaded fitting code: {result['fitting']}"
