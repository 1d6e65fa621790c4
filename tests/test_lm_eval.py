"""The bridge in lm-eval: real harness runs on the offline pocket tasks with tiny models.

Oracles: with the identity pair (source == target, ridge λ ≈ 0) the bridge scores every request as the target does;
batch size 4 gives the numbers of batch size 1.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

import hf_kvbridge
import hf_kvbridge.integrations.lm_eval  # noqa: F401  (registers "kvbridge")
from hf_kvbridge.card import read_eval_table
from hf_kvbridge.cli.main import main as cli_main
from hf_kvbridge.integrations.lm_eval import KVBridgeLM, rolling_chunks
from hf_kvbridge.tools.eval_cli import format_table, retention_rows
from tests.conftest import CORPUS

ROOT = Path(__file__).resolve().parents[1]
POCKET_TASKS = ROOT / "eval_tasks" / "pocket"
STRIDE = 96  # rolling chunks of 96 tiny-tokenizer tokens: several chunks per document, most with a source prefix


@pytest.fixture(scope="module")
def checkpoints(saved_pair, tmp_path_factory):
    """An identity bridge (small → small, λ ≈ 0) and a real small → large bridge, saved."""
    root = tmp_path_factory.mktemp("bridges")
    kw = {"num_sequences": 16, "seq_len": 32, "top_k": 2, "batch_size": 4}
    identity = hf_kvbridge.calibrate(saved_pair["small"], saved_pair["small"], CORPUS, ridge_lambda=1e-9, **kw)
    identity.save_pretrained(root / "identity")
    pair = hf_kvbridge.calibrate(saved_pair["small"], saved_pair["large"], CORPUS, **kw)
    pair.save_pretrained(root / "pair")
    return {"identity": str(root / "identity"), "pair": str(root / "pair")}


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(POCKET_TASKS))


def _run(path, mode, task_manager, batch_size=1, limit=4):
    return lm_eval.simple_evaluate(
        model="kvbridge",
        model_args=f"pretrained={path},mode={mode},rolling_stride={STRIDE}",
        tasks=["kvbridge_pocket"],
        limit=limit,
        batch_size=batch_size,
        device="cpu",
        task_manager=task_manager,
        bootstrap_iters=0,
        log_samples=True,
    )


def _loglikelihoods(results, task):
    """Per document (in order), every request's log-likelihood."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    out = []
    for sample in samples:
        for resp in sample["resps"]:
            value = resp[0]
            out.append(value[0] if isinstance(value, (list, tuple)) else value)
    return torch.tensor(out, dtype=torch.float64)


def test_rolling_chunks_cover_each_token_once_with_its_context():
    tokens = list(range(100, 150))
    chunks = list(rolling_chunks(tokens, prefix_token=7, max_length=20, stride=8))
    assert [t for _, cont in chunks for t in cont] == tokens
    assert chunks[0][0] == [7]
    for context, continuation in chunks:
        assert len(context) + len(continuation) <= 21  # lm-eval scores (context + continuation)[:-1]
        start = tokens.index(continuation[0])
        assert context == ([7] + tokens)[start + 1 - len(context) : start + 1]  # the tokens just before
    with pytest.raises(ValueError, match="rolling_stride"):
        list(rolling_chunks(tokens, 7, max_length=20, stride=21))


def test_identity_bridge_equals_target_and_batch_4_equals_batch_1(checkpoints, task_manager):
    target = _run(checkpoints["identity"], "target", task_manager)
    bridge = _run(checkpoints["identity"], "bridge", task_manager)
    bridge4 = _run(checkpoints["identity"], "bridge", task_manager, batch_size=4)
    for task in ("kvbridge_pocket_cloze", "kvbridge_pocket_ppl"):
        want = _loglikelihoods(target, task)
        assert len(want) == (16 if task == "kvbridge_pocket_cloze" else 4)
        torch.testing.assert_close(_loglikelihoods(bridge, task), want, atol=1e-4, rtol=1e-6)
        torch.testing.assert_close(_loglikelihoods(bridge4, task), _loglikelihoods(bridge, task), atol=1e-4, rtol=0)
    for metric in ("acc,none", "acc_norm,none"):
        cloze = "kvbridge_pocket_cloze"
        assert (
            bridge["results"][cloze][metric] == target["results"][cloze][metric] == bridge4["results"][cloze][metric]
        )
    ppl = "kvbridge_pocket_ppl"
    assert bridge["results"][ppl]["bits_per_byte,none"] == pytest.approx(target["results"][ppl]["bits_per_byte,none"])
    assert bridge["config"]["model"] == "kvbridge" and bridge["config"]["kvbridge_mode"] == "bridge"


def test_generate_until_goes_through_the_bridge(checkpoints):
    target = KVBridgeLM(pretrained=checkpoints["identity"], mode="target", device="cpu")
    bridge = KVBridgeLM(pretrained=checkpoints["identity"], mode="bridge", device="cpu", batch_size=2)
    assert bridge.model is bridge.bridge and target.bridge is None  # target mode loads only the target
    contexts = ["The quick brown fox jumps over", "A key and a value are cached", "Ridge"]
    requests = [
        Instance("generate_until", {}, (ctx, {"until": ["e"], "max_gen_toks": 12, "do_sample": False}), i)
        for i, ctx in enumerate(contexts)
    ]
    got, want = bridge.generate_until(requests), target.generate_until(requests)
    assert got == want and all("e" not in text for text in got)  # stopped at (and cut before) "e"
    long = [Instance("generate_until", {}, (contexts[0], {"until": ["\n\n\n"], "max_gen_toks": 6}), 0)]
    assert len(bridge.tok_encode(bridge.generate_until(long)[0])) <= 6


def test_console_script_runs_a_small_to_large_bridge(checkpoints, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = Path(sys.executable).parent / "kvbridge-lm-eval"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hf_kvbridge.integrations.lm_eval"]
    proc = subprocess.run(
        [
            *command,
            "--model",
            "kvbridge",
            "--model_args",
            f"pretrained={checkpoints['pair']},mode=bridge",
            "--tasks",
            "kvbridge_pocket_cloze",
            "--include_path",
            str(POCKET_TASKS),
            "--limit",
            "4",
            "--batch_size",
            "2",
            "--output_path",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    acc = results["results"]["kvbridge_pocket_cloze"]["acc,none"]
    assert results["n-samples"]["kvbridge_pocket_cloze"]["effective"] == 4
    # no --device on a machine without CUDA: the bridge picked one that exists; the numbers are the Python API's
    want = lm_eval.simple_evaluate(
        model="kvbridge",
        model_args=f"pretrained={checkpoints['pair']},mode=bridge",
        tasks=["kvbridge_pocket_cloze"],
        limit=4,
        batch_size=2,
        task_manager=TaskManager(include_path=str(POCKET_TASKS)),
    )
    assert acc == want["results"]["kvbridge_pocket_cloze"]["acc,none"]


def test_kvbridge_eval_table_json_and_card(checkpoints, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside any git clone: lm-eval's git call must stay quiet
    out = tmp_path / "retention.json"
    code = cli_main(
        [
            "eval",
            checkpoints["pair"],
            "--tasks",
            "kvbridge_pocket_cloze",
            "--include-path",
            str(POCKET_TASKS),
            "--limit",
            "4",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--output",
            str(out),
            "--write-card",
        ]
    )
    assert code == 0
    captured = capfd.readouterr()
    printed = captured.out
    assert "not a git repository" not in captured.err
    assert "[1/3] mode source" in captured.err and "[3/3] mode bridge" in captured.err  # every mode is labelled
    payload = json.loads(out.read_text())
    rows = {(r["task"], r["metric"]): r for r in payload["rows"]}
    row = rows[("kvbridge_pocket_cloze", "acc")]
    assert row["chance"] == pytest.approx(0.25)  # 4 choices per document, read from the task's docs
    manager = TaskManager(include_path=str(POCKET_TASKS))
    for mode in ("source", "target", "bridge"):  # each column is that mode's own lm-eval run
        run = lm_eval.simple_evaluate(
            model="kvbridge",
            model_args=f"pretrained={checkpoints['pair']},mode={mode}",
            tasks=["kvbridge_pocket_cloze"],
            limit=4,
            batch_size=4,
            device="cpu",
            task_manager=manager,
        )["results"]["kvbridge_pocket_cloze"]
        assert row[mode] == pytest.approx(run["acc,none"]) and row[f"{mode}_stderr"] == pytest.approx(
            run["acc_stderr,none"]
        )
    if row["target"]:
        assert row["retention"] == pytest.approx(row["bridge"] / row["target"])
    assert "| kvbridge_pocket_cloze | acc |" in printed and payload["table"] in printed
    assert set(payload["lm_eval_results"]) == {"source", "target", "bridge"}
    card = (Path(checkpoints["pair"]) / "README.md").read_text()
    card_table = read_eval_table(card)
    assert card_table.startswith(payload["table"]) and "(`--limit 4`), not the full tasks" in card_table


def test_retention_rows_directions_and_chance():
    def results(acc, ppl):
        return {
            "results": {
                "mc": {"acc,none": acc, "acc_stderr,none": 0.01, "alias": "mc"},
                "ppl": {"word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A"},
            },
            "higher_is_better": {"mc": {"acc": True}, "ppl": {"word_perplexity": False}},
        }

    by_mode = {"source": results(0.4, 30.0), "target": results(0.7, 10.0), "bridge": results(0.55, 12.5)}
    rows = {r["task"]: r for r in retention_rows(by_mode, {"mc": 0.25, "ppl": None})}
    assert rows["mc"]["retention"] == pytest.approx(0.55 / 0.7)
    assert rows["mc"]["chance_normalised_retention"] == pytest.approx((0.55 - 0.25) / (0.7 - 0.25))
    assert rows["ppl"]["retention"] == pytest.approx(10.0 / 12.5)  # lower is better: target / bridge
    assert rows["ppl"]["chance_normalised_retention"] is None and rows["ppl"]["target_stderr"] is None
    table = format_table(list(rows.values()))
    assert "0.5500 ± 0.0100" in table and "word_perplexity ↓" in table


def test_paper_group_parses_with_its_shots(monkeypatch):
    """The paper suite's group resolves against lm-eval's stock tasks (datasets are not loaded: no network)."""
    import lm_eval.tasks._factory as factory
    from lm_eval.api.task import ConfigurableTask

    class ConfigOnly(ConfigurableTask):
        def __init__(self, config):
            self.raw = dict(config)

        @property
        def task_name(self):
            return self.raw["task"]

    monkeypatch.setattr(factory, "ConfigurableTask", ConfigOnly)
    loaded = TaskManager(include_path=str(ROOT / "eval_tasks" / "paper")).load(["kvbridge_paper"])
    members = loaded["group_map"]["kvbridge_paper"]
    assert members == ["arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k_cot", "wikitext"]
    shots = {name.split("_")[0] if name.startswith("mmlu") else name: t.raw.get("num_fewshot") for name, t in
             loaded["tasks"].items()}  # fmt: skip
    assert shots["mmlu"] == 5 and shots["gsm8k_cot"] == 8
    assert loaded["tasks"]["wikitext"].raw["output_type"] == "loglikelihood_rolling"


def test_registration_and_entry_point():
    from lm_eval.api.registry import get_model

    assert get_model("kvbridge") is KVBridgeLM
    names = {ep.name: ep.value for ep in entry_points(group="lm_eval.models")}
    assert names.get("kvbridge") == "hf_kvbridge.integrations.lm_eval:KVBridgeLM"
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("kvbridge-lm-eval") == "hf_kvbridge.integrations.lm_eval:cli_evaluate"


def _coqa_story(text: str, turns: int) -> dict:
    words = text.split()
    return {
        "story": text,
        "questions": {"input_text": [f"what is word {i}?" for i in range(turns)]},
        "answers": {"input_text": [words[i % len(words)] for i in range(turns)]},
        "additional_answers": {"0": {"input_text": [words[(i + 1) % len(words)] for i in range(turns)]}},
    }


def test_per_turn_coqa_scores_every_turn(checkpoints, tmp_path):
    """The per-turn CoQA task on a local file in CoQA's format: one request per turn, F1 reported per turn, and
    the identity bridge scores every turn as the target does."""
    data = tmp_path / "coqa.jsonl"
    data.write_text("\n".join(json.dumps(_coqa_story(CORPUS[i], turns=3 + i)) for i in range(2)))
    (tmp_path / "local.yaml").write_text(
        f"include: {ROOT / 'eval_tasks' / 'coqa_turns' / 'kvbridge_coqa_turns.yaml'}\n"
        "task: kvbridge_coqa_turns_local\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {data}\n"
        "training_split: null\n"
        "generation_kwargs:\n  until: ['\\nQ:']\n  max_gen_toks: 6\n"
    )
    manager = TaskManager(include_path=[str(ROOT / "eval_tasks" / "coqa_turns"), str(tmp_path)])
    results = {}
    for mode in ("target", "bridge"):
        out = lm_eval.simple_evaluate(
            model="kvbridge",
            model_args=f"pretrained={checkpoints['identity']},mode={mode}",
            tasks=["kvbridge_coqa_turns_local"],
            task_manager=manager,
            device="cpu",
            bootstrap_iters=0,
            log_samples=True,
        )
        results[mode] = out
    samples = results["bridge"]["samples"]["kvbridge_coqa_turns_local"]
    assert len(samples) == 3 + 4  # one request per turn of each story
    assert sorted(s["doc"]["turn"] for s in samples) == [1, 1, 2, 2, 3, 3, 4]
    metrics = results["bridge"]["results"]["kvbridge_coqa_turns_local"]
    assert {"f1_turn_01,none", "f1_turn_04,none", "f1,none", "em,none"} <= set(metrics)
    assert "f1_turn_05,none" not in metrics  # no story has a fifth turn
    target = results["target"]["results"]["kvbridge_coqa_turns_local"]
    assert {k: v for k, v in metrics.items() if "turn" in k} == {k: v for k, v in target.items() if "turn" in k}
    bridge_out = [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
    target_samples = results["target"]["samples"]["kvbridge_coqa_turns_local"]
    assert bridge_out == [s["filtered_resps"] for s in sorted(target_samples, key=lambda s: s["doc_id"])]


def test_coqa_scoring_is_squad_style():
    import importlib.util

    spec = importlib.util.spec_from_file_location("coqa_turns_utils", ROOT / "eval_tasks" / "coqa_turns" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    assert utils.scores(["The cat."], "a cat") == {"em": 1.0, "f1": 1.0}  # case, punctuation and articles ignored
    assert utils.scores(["red fox"], "fox")["f1"] == pytest.approx(2 / 3)
    # several golds: the mean of leave-one-out maxima
    assert utils.scores(["red fox", "fox"], "fox") == {"em": 0.5, "f1": pytest.approx((1.0 + 2 / 3) / 2)}
    doc = _coqa_story("one two three", turns=2)
    assert utils.doc_to_text(doc).endswith("Q: what is word 0?\n\nA: one\n\nQ: what is word 1?\n\nA:")
    assert utils.doc_to_target(doc) == ["two", "three"]


def test_bridge_mode_asks_the_source_for_no_logits_it_throws_away(checkpoints, monkeypatch):
    lm = KVBridgeLM(pretrained=checkpoints["pair"], mode="bridge", device="cpu", batch_size=2)
    shapes = []
    forward = lm.bridge.source.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        shapes.append(tuple(out.logits.shape))
        return out

    monkeypatch.setattr(lm.bridge.source, "forward", spy)
    context, continuation = list(range(5, 25)), [30, 31, 32]
    lm._loglikelihood_tokens([(None, context, continuation), (None, context[:12], continuation)])
    assert shapes and all(shape[1] == 1 for shape in shapes)  # last position only, not (B, prefix, vocab)


def test_device_defaults_to_the_models_device(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine
    lm = KVBridgeLM(pretrained=checkpoints["identity"], mode="bridge")  # no device given
    assert lm.device == torch.device("cpu") and lm.bridge.device == torch.device("cpu")
    bridge = lm.bridge

    def refuse(*args, **kwargs):
        raise AssertionError("a loaded bridge is not moved when no device is given")

    monkeypatch.setattr(bridge, "to", refuse)
    again = KVBridgeLM(pretrained=bridge, mode="target")
    assert again.device == bridge.device and again.model is bridge.target
    # lm-eval's command line passes device="cuda" when --device is not given: not a crash on a CPU-only machine
    assert KVBridgeLM(pretrained=bridge, mode="bridge", device="cuda").device == torch.device("cpu")
