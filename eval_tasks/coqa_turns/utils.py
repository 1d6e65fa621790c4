"""Per-turn CoQA: one request per turn of every story (up to `MAX_TURNS`), scored with SQuAD-style EM/F1.

The prompt is the stock task's (story, then "Q: …\n\nA: …" pairs, the current answer left open). The scoring is
written here: lm-eval's stock `coqa` utilities import `transformers.data.metrics`, which transformers 5 removed.
"""

import collections
import re
import string

MAX_TURNS = 10
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def _first(field: dict, turns: int) -> dict:
    return {"input_text": list(field["input_text"][:turns])}


def turns(dataset):
    """Each story becomes one document per turn i ≤ MAX_TURNS: questions and answers cut after turn i, `turn` = i."""

    def expand(batch):
        out = {"story": [], "questions": [], "answers": [], "additional_answers": [], "turn": []}
        for row in range(len(batch["story"])):
            questions, answers = batch["questions"][row], batch["answers"][row]
            extra = batch.get("additional_answers", [None] * len(batch["story"]))[row] or {}
            for turn in range(1, min(len(questions["input_text"]), MAX_TURNS) + 1):
                out["story"].append(batch["story"][row])
                out["questions"].append(_first(questions, turn))
                out["answers"].append(_first(answers, turn))
                out["additional_answers"].append({key: _first(value, turn) for key, value in extra.items()})
                out["turn"].append(turn)
        return out

    return dataset.map(expand, batched=True, remove_columns=dataset.column_names)


def doc_to_text(doc) -> str:
    """The story and the conversation so far; the last question's answer is left for the model."""
    questions, answers = doc["questions"]["input_text"], doc["answers"]["input_text"]
    parts = [doc["story"] + "\n\n"]
    for i, question in enumerate(questions):
        answer = f"A: {answers[i]}\n\n" if i < len(questions) - 1 else "A:"
        parts.append(f"Q: {question}\n\n{answer}")
    return "".join(parts)


def doc_to_target(doc) -> list[str]:
    """The gold answer of the last turn, then the distinct alternative answers for it."""
    turn = len(doc["questions"]["input_text"])
    golds = [doc["answers"]["input_text"][turn - 1]]
    for extra in (doc.get("additional_answers") or {}).values():
        alternative = extra["input_text"][turn - 1]
        if alternative.lower() not in (g.lower() for g in golds):
            golds.append(alternative)
    return golds


def _normalise(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(gold: str, prediction: str) -> float:
    gold_tokens, pred_tokens = _normalise(gold).split(), _normalise(prediction).split()
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    common = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _exact(gold: str, prediction: str) -> float:
    return float(_normalise(gold) == _normalise(prediction))


def scores(golds: list[str], prediction: str) -> dict[str, float]:
    """CoQA's EM/F1: with several golds, the mean over leave-one-out maxima (as the official script does)."""
    if len(golds) == 1:
        return {"em": _exact(golds[0], prediction), "f1": _f1(golds[0], prediction)}
    em = f1 = 0.0
    for i in range(len(golds)):
        rest = golds[:i] + golds[i + 1 :]
        em += max(_exact(g, prediction) for g in rest)
        f1 += max(_f1(g, prediction) for g in rest)
    return {"em": em / len(golds), "f1": f1 / len(golds)}


def process_results(doc, results):
    """EM/F1 of the first line of the answer, plus the F1 under this document's turn (`f1_turn_03`, ...)."""
    result = scores(doc_to_target(doc), results[0].strip().split("\n")[0])
    result[f"f1_turn_{doc['turn']:02d}"] = result["f1"]
    return result
