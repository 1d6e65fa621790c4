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
from hf_kvbridge import pocket
from hf_kvbridge.card import read_eval_table
from hf_kvbridge.constants import EVAL_MODES
from hf_kvbridge.integrations.lm_eval import KVBridgeLM, rolling_chunks
from hf_kvbridge.tools.task_retention import format_table, retention_rows
from hf_kvbridge.utils.cache import output_cache
from kvbridge_cli import main as cli_main
from tests.conftest import CORPUS
from tests.utils.test_layout import linear_pair  # noqa: F401  (fixture: a pair whose KV layouts differ)

ROOT = Path(__file__).resolve().parents[2]
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
    return TaskManager(include_path=str(POCKET_TASKS), include_defaults=False)


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
    bridge.bridge.transfer_counts.clear()
    got, want = bridge.generate_until(requests), target.generate_until(requests)
    # every prompt was prefilled by the source and mapped (none fell back to the target's own prefill), and the
    # identity pair then generates exactly the target's own text
    assert bridge.bridge.transfer_counts == {"transferred": len(contexts)}
    assert bridge.bridge.last_transfer["mapped_tokens"] > 0
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
        task_manager=TaskManager(include_path=str(POCKET_TASKS), include_defaults=False),
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
    assert "[1/6] mode source" in captured.err and "[3/6] mode bridge" in captured.err  # every mode is labelled
    assert "[6/6] mode random_cache: control" in captured.err  # the controls run by default
    payload = json.loads(out.read_text())
    rows = {(r["task"], r["metric"]): r for r in payload["rows"]}
    row = rows[("kvbridge_pocket_cloze", "acc")]
    assert row["chance"] == pytest.approx(0.25)  # 4 choices per document, read from the task's docs
    manager = TaskManager(include_path=str(POCKET_TASKS), include_defaults=False)
    for mode in EVAL_MODES:  # each column is that mode's own lm-eval run
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
    assert set(payload["lm_eval_results"]) == set(EVAL_MODES)
    assert set(row["control_retention"]) == {"zero_cache", "random_cache"} and "controls_flag" in row
    # the gap recovered on accuracy, paired over the documents: a figure with its interval, or n/a and why
    assert {"gap_recovered", "gap_recovered_ci", "gap_recovered_reason", "source_target_gap"} <= set(row)
    assert row["source_target_gap"] is not None, row  # lm-eval's per-document scores were found and paired
    if row["gap_recovered"] is None:
        assert row["gap_recovered_reason"], row
    else:
        gap = (row["bridge"] - row["source"]) / (row["target"] - row["source"])
        assert row["gap_recovered"] == pytest.approx(gap) and row["gap_recovered_ci"][0] < gap
    assert "gap recovered [95% CI]" in payload["table"].splitlines()[0]
    assert all("samples" not in run for run in payload["lm_eval_results"].values())  # logged for the pairing only
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
    # lm-eval 0.4 reads no model entry points (it registers through `import hf_kvbridge`): none is declared
    assert "kvbridge" not in {ep.name for ep in entry_points(group="lm_eval.models")}
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


def test_no_context_and_control_modes_score_what_they_say(checkpoints):
    """Oracles on the identity bridge: `no_context` is the target on the context's last `hold_back` tokens only;
    `zero_cache` is the target on an all-zero cache of the mapped prefix; `random_cache` is neither."""
    bridge = KVBridgeLM(pretrained=checkpoints["identity"], mode="bridge", device="cpu").bridge
    lms = {mode: KVBridgeLM(pretrained=bridge, mode=mode, batch_size=2) for mode in EVAL_MODES}
    assert lms["no_context"].model is bridge.target and lms["zero_cache"].model is bridge
    context, continuation = list(range(5, 25)), [30, 31, 32]
    requests = [(None, context, continuation), (None, context[:12], continuation)]
    scores = {mode: [lp for lp, _ in lm._loglikelihood_tokens(requests)] for mode, lm in lms.items()}
    keep = bridge.config.hold_back
    want = [lp for lp, _ in lms["target"]._loglikelihood_tokens([(None, c[-keep:], cont) for _, c, cont in requests])]
    assert scores["no_context"] == pytest.approx(want, abs=1e-5)
    for i, (_, ctx, cont) in enumerate(requests):
        ids = torch.tensor([ctx + cont])
        split = len(ctx) - keep
        cache = output_cache(bridge.target(ids[:, :split], use_cache=True))
        for layer in cache.layers:
            layer.keys, layer.values = torch.zeros_like(layer.keys), torch.zeros_like(layer.values)
        with torch.no_grad():
            logits = bridge.target(ids[:, split:-1], cache=cache).logits[0, -len(cont) :]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(cont)[:, None]).sum()
        assert scores["zero_cache"][i] == pytest.approx(float(expected), abs=1e-4)
    assert scores["bridge"] == pytest.approx(scores["target"], abs=1e-4)  # identity: the bridge is the target
    for control in ("zero_cache", "random_cache"):
        assert min(abs(a - b) for a, b in zip(scores[control], scores["bridge"])) > 1e-3
    request = [Instance("generate_until", {}, ("The quick brown fox", {"until": ["\n\n"], "max_gen_toks": 5}), 0)]
    for mode in ("no_context", "zero_cache", "random_cache"):
        (text,) = lms[mode].generate_until(request)
        assert isinstance(text, str) and len(lms[mode].tok_encode(text)) <= 5
    tail = lms["no_context"].tok_decode(lms["no_context"].tok_encode("The quick brown fox")[-keep:])
    assert lms["no_context"].generate_until(request) == lms["target"].generate_until(
        [Instance("generate_until", {}, (tail, {"until": ["\n\n"], "max_gen_toks": 5}), 0)]
    )


@pytest.fixture(scope="module")
def pocket_bridge():
    """pocket-m → pocket-s, calibrated small: a real bridge on a pair whose target uses its context."""
    return hf_kvbridge.calibrate(
        "pocket/pocket-m", "pocket/pocket-s", pocket.data_path("calibration"), num_sequences=16, seq_len=256, top_k=6
    )


CONTROL_EVAL = {"limit": 4, "batch_size": 4, "bootstrap_iters": 0, "rolling_stride": 64}
# source is left out to save a run: the controls need target, bridge and no_context
CONTROL_MODES_RUN = ("target", "bridge", "no_context", "zero_cache", "random_cache")


@pytest.mark.slow
def test_controls_pass_a_real_bridge_and_flag_a_broken_one(pocket_bridge, task_manager, tmp_path, capfd, monkeypatch):
    """Rolling perplexity of held-out pocket text (chunks of 64 tokens): the real bridge keeps most of the context's
    benefit (measured on the retrained family: 0.69 on bits per byte; zero cache −0.22, random cache −0.53) and is not
    flagged; the same bridge with its mapper weights zeroed is flagged in `kvbridge eval`'s table, warning and JSON,
    and its lm-eval `mode=` results are the zero cache's."""
    from hf_kvbridge.tools.task_retention import evaluate_modes

    good = evaluate_modes(
        pocket_bridge, ["kvbridge_pocket_ppl"], modes=CONTROL_MODES_RUN, include_path=str(POCKET_TASKS), **CONTROL_EVAL
    )
    assert good["rows"] and not good["warnings"]
    for row in good["rows"]:
        assert row["controls_basis"] == "context_benefit" and row["controls_flag"] is False, row
        assert row["context_benefit_retention"] > 0.5
        assert max(row["control_retention"].values()) < row["context_benefit_retention"] - 0.2, row

    broken = tmp_path / "broken"
    for name, tensor in pocket_bridge.mapper.state_dict().items():
        if name != "key_norm_gain":  # the map's weights (zero gains are refused on load: test_key_norm.py)
            tensor.zero_()
    pocket_bridge.save_pretrained(broken)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "broken.json"
    args = ["eval", str(broken), "--tasks", "kvbridge_pocket_ppl", "--include-path", str(POCKET_TASKS)]
    args += ["--limit", "4", "--batch-size", "4", "--bootstrap-iters", "0", "--rolling-stride", "64"]
    args += ["--device", "cpu", "--modes", ",".join(CONTROL_MODES_RUN), "--output", str(out)]
    assert cli_main(args) == 0
    captured = capfd.readouterr()
    assert "⚠ control within 0.1" in captured.out
    assert "warning: kvbridge_pocket_ppl bits_per_byte: the bridge's context-benefit retention" in captured.err
    payload = json.loads(out.read_text())
    assert all(row["controls_flag"] is True for row in payload["rows"])
    assert "kvbridge_pocket_ppl bits_per_byte" in payload["controls_flagged"] and payload["control_margin"] == 0.1
    # lm-eval's own run of a control mode gives the table's number; a zeroed mapper maps to the zero cache
    run = lm_eval.simple_evaluate(
        model="kvbridge",
        model_args=f"pretrained={broken},mode=zero_cache,rolling_stride=64",
        tasks=["kvbridge_pocket_ppl"],
        limit=4,
        batch_size=4,
        device="cpu",
        bootstrap_iters=0,
        task_manager=task_manager,
    )
    row = {r["metric"]: r for r in payload["rows"]}["bits_per_byte"]
    assert run["config"]["kvbridge_mode"] == "zero_cache"
    assert run["results"]["kvbridge_pocket_ppl"]["bits_per_byte,none"] == pytest.approx(row["zero_cache"])
    assert row["bridge"] == pytest.approx(row["zero_cache"])


def test_a_pair_with_different_kv_layouts_scores_like_its_target(linear_pair, tokenizer, task_manager, tmp_path):  # noqa: F811
    """Source 2 KV heads × 16, target 3 × 8 with another RoPE, the target's K/V an exact linear function of the
    source's: through lm-eval (loaded from a saved checkpoint by path, as a user would) the bridge scores what the
    target scores itself."""
    for name, model in zip(("source", "target"), linear_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    bridge = hf_kvbridge.calibrate(
        str(tmp_path / "source"), str(tmp_path / "target"), CORPUS, num_sequences=16, seq_len=32, ridge_lambda=1e-9
    )
    assert (bridge.config.source_fingerprint["num_kv_heads"], bridge.config.target_fingerprint["num_kv_heads"]) == (
        2,
        3,
    )
    bridge.save_pretrained(tmp_path / "bridge")
    target = _run(tmp_path / "bridge", "target", task_manager, limit=2)
    bridged = _run(tmp_path / "bridge", "bridge", task_manager, limit=2)
    for task in ("kvbridge_pocket_cloze", "kvbridge_pocket_ppl"):
        torch.testing.assert_close(_loglikelihoods(bridged, task), _loglikelihoods(target, task), atol=1e-3, rtol=1e-5)


def test_eval_indexes_lm_evals_stock_tasks_only_when_the_tasks_need_them(monkeypatch):
    """`kvbridge eval --include-path` builds a manager of the include path alone when its tasks name nothing else
    (indexing the stock tasks costs ~17 s each time), and the full one when a group lists a stock task."""
    import lm_eval.tasks

    from hf_kvbridge.tools.task_retention import task_manager_for

    built = []

    class Recording(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            built.append(include_defaults)
            super().__init__(include_path=include_path, include_defaults=False, **kwargs)  # fast either way

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    pocket = task_manager_for(["kvbridge_pocket_cloze", "kvbridge_pocket"], str(POCKET_TASKS))
    assert built == [False] and "kvbridge_pocket_ppl" in pocket.all_tasks
    built.clear()
    task_manager_for(["kvbridge_paper"], str(ROOT / "eval_tasks" / "paper"))  # lists arc_challenge, hellaswag, ...
    assert built == [False, True]
    built.clear()
    task_manager_for(["kvbridge_pocket_cloze", "hellaswag"], str(POCKET_TASKS))
    assert built == [False, True]
    built.clear()
    task_manager_for(["hellaswag"])
    assert built == [True]
