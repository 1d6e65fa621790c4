"""The bridge as one model in lm-evaluation-harness: `KVBridgeLM`, registered as `kvbridge`.

```bash
kvbridge-lm-eval --model kvbridge --model_args pretrained=my-bridge,mode=bridge --tasks arc_challenge
```

`mode` picks the path, so one harness run style gives every number of a retention table:

- `bridge`: the source prefills each request's context except its last `hold_back` tokens; the target scores the
  held-back tokens and the continuation on the mapped cache (generation: `KVBridgeForCausalLM.generate`);
- `target`, `source`: the plain model, exactly as lm-eval's `HFLM` scores it;
- `no_context`: the target alone on the continuation after only the context's last `hold_back` tokens, the ones it
  computes itself in bridge mode: the bridge's path with nothing mapped, the floor of a context-benefit retention
  (a rolling document's first chunk keeps its prefix token);
- `zero_cache`, `random_cache` (controls, `hf_kvbridge.controls`): the bridge's path with the mapped cache replaced by
  zeros, or by Gaussian K/V with the mapped cache's RMS per layer, row and head (seeded per batch, so its numbers
  depend on how requests are batched). A bridge whose retention these come close to transfers little.

Only `_loglikelihood_tokens` (bridge, control and no-context modes), `_model_generate` (control and no-context modes),
`loglikelihood_rolling` (all modes, see below) and the model loading differ from `HFLM`, in the way lm-eval's own
`SteeredModel(HFLM)` overrides only what it must.

**Rolling log-likelihood policy.** `HFLM` cuts a document into disjoint windows whose context is one token, so a
bridge would have nothing to prefill. Here, in *every* mode, a document is scored in chunks of `rolling_stride` tokens
(model argument, default 256); each chunk is conditioned on all the document's preceding tokens that fit in
`max_length` (the first chunk on the prefix token only). In bridge mode the source prefills each chunk's context
(minus `hold_back` tokens) and the target scores the rest, so the first chunk of every document is scored by the
target alone. For documents that fit in `max_length`, target and source numbers equal `HFLM`'s; longer documents
get a strided sliding window (more context than `HFLM`'s disjoint windows).

After `import hf_kvbridge.integrations.lm_eval`, `lm_eval.simple_evaluate(model="kvbridge",
model_args="pretrained=DIR,mode=bridge")` works.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedModel

from ..configuration import KVBridgeConfig
from ..constants import MAPPER_CHECKSUMS_KEY
from ..controls import CONTROL_MODES, control_cache
from ..errors import EvaluationError
from ..loading import load_model, read_config_dict, resolve_checkpoint, resolve_model_reference
from ..modeling import KVBridgeForCausalLM
from ..utils.cache import CACHE_KWARG, cache_kwargs
from ..utils.masks import positions_from_mask

logger = logging.getLogger(__name__)

# modes that run the bridge's prefill (and need the mapper); the others load only the model they score
BRIDGED_MODES = ("bridge", *CONTROL_MODES)
MODES = (*BRIDGED_MODES, "target", "source", "no_context")
DEFAULT_ROLLING_STRIDE = 256


def rolling_chunks(
    tokens: list[int], prefix_token: int, max_length: int, stride: int
) -> Iterator[tuple[list[int], list[int]]]:
    """`(context, continuation)` pairs covering `tokens` in chunks of `stride`, each with as much preceding context
    as fits in `max_length` (lm-eval scores `(context + continuation)[:-1]`, so `max_length + 1` tokens in all).

    The first chunk's context is `[prefix_token]`, so the first token is scored too.
    """
    if not 1 <= stride <= max_length:
        raise EvaluationError(
            f"rolling_stride must be in [1, max_length={max_length}], got {stride}; pass rolling_stride= within it"
        )
    sequence = [prefix_token, *tokens]
    for start in range(0, len(tokens), stride):
        continuation = tokens[start : start + stride]
        # tokens[start] is sequence[start + 1]: the context is sequence[:start + 1], left-truncated to fit
        first = max(0, start + 1 - (max_length + 1 - len(continuation)))
        yield sequence[first : start + 1], continuation


@register_model("kvbridge")
class KVBridgeLM(HFLM):
    r"""lm-eval's `HFLM` for a bridge checkpoint, scoring the bridge, its target or its source.

    Args:
        pretrained (`str` or [`KVBridgeForCausalLM`]): a bridge checkpoint (local folder or Hub id), or a loaded
            bridge (as `kvbridge eval` passes it, to load the models once for all three modes).
        mode (`str`, *optional*, defaults to `"bridge"`): `"bridge"`, `"target"`, `"source"`, `"no_context"`,
            `"zero_cache"` or `"random_cache"` (module docstring).
        revision (`str`, *optional*): revision of the bridge checkpoint on the Hub.
        tokenizer (`str`, *optional*): defaults to the target's (both models share it).
        device (`str`, *optional*): defaults to the device of a loaded bridge's models; for a checkpoint, `cuda` when
            available, else `cpu`.
        dtype (`str`, *optional*, defaults to `"auto"`): dtype of the two models.
        rolling_stride (`int`, *optional*, defaults to `256`): chunk size of `loglikelihood_rolling` (module doc).
        kwargs: the other `HFLM` arguments (`batch_size`, `max_length`, `softmax_dtype`, `add_bos_token`, ...).

    Example:

    ```python
    >>> import lm_eval, hf_kvbridge.integrations.lm_eval  # doctest: +SKIP
    >>> lm_eval.simple_evaluate(model="kvbridge", model_args="pretrained=my-bridge,mode=bridge",
    ...                         tasks=["hellaswag"])  # doctest: +SKIP
    ```
    """

    def __init__(
        self,
        pretrained: str | KVBridgeForCausalLM,
        mode: str = "bridge",
        revision: str | None = None,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str | torch.dtype | None = "auto",
        rolling_stride: int = DEFAULT_ROLLING_STRIDE,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise EvaluationError(f"mode must be one of {MODES}, got {mode!r}")
        for key in ("parallelize", "tp_plan", "peft", "delta", "autogptq", "gptqmodel", "gguf_file"):
            if kwargs.get(key):
                raise EvaluationError(
                    f"KVBridgeLM does not support {key}=; load the bridge's source and target as plain transformers "
                    "models (drop that model_args key)"
                )
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            # lm-eval's command line asks for "cuda" when --device is not given: on a machine without CUDA, take the
            # models' device instead of crashing in `.to("cuda")`
            logger.warning("device=%r requested but CUDA is not available: using the models' device", device)
            device = None
        if device is None and isinstance(pretrained, KVBridgeForCausalLM):
            device = str(pretrained.device)  # a loaded bridge stays where its models are
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # a device that exists
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        load_kwargs = {} if dtype in (None, "auto") else {"dtype": dtype}
        self.bridge: KVBridgeForCausalLM | None = None
        if isinstance(pretrained, KVBridgeForCausalLM):
            self.bridge, config = pretrained, pretrained.config
            name = config.name_or_path or "kvbridge"
        else:
            name = str(pretrained)
            if mode in BRIDGED_MODES:
                self.bridge = KVBridgeForCausalLM.from_pretrained(pretrained, revision=revision, **load_kwargs)
                config = self.bridge.config
            else:  # only the model that is scored
                config_dict = read_config_dict(resolve_checkpoint(pretrained, revision=revision))
                config_dict.pop(MAPPER_CHECKSUMS_KEY, None)
                config = KVBridgeConfig.from_dict(config_dict)
        if self.bridge is not None:
            if torch.device(device) != self.bridge.device:  # never move a bridge already on that device
                self.bridge.to(device)
            self.bridge.eval()
            model = self.bridge.source if mode == "source" else self.bridge.target
        else:
            role = "source" if mode == "source" else "target"
            ref, rev = getattr(config, f"{role}_name_or_path"), getattr(config, f"{role}_revision")
            model = load_model(ref, rev, **load_kwargs).to(device)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(
                resolve_model_reference(config.target_name_or_path), revision=config.target_revision
            )
        elif isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.mode, self.bridge_config, self.rolling_stride = mode, config, int(rolling_stride)
        fingerprints = [fp for fp in (config.source_fingerprint, config.target_fingerprint) if fp]
        # the same max_length in every mode, so the three runs truncate the same requests the same way
        self._pair_max_positions = min((fp["max_position_embeddings"] for fp in fingerprints), default=None)
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **kwargs)
        self.pretrained, self.revision = name, revision
        if mode in BRIDGED_MODES:
            self._model = self.bridge  # generate_until and batch-size detection go through the bridge
        if not isinstance(model, PreTrainedModel):  # pragma: no cover - load_model returns one
            raise EvaluationError(f"pretrained= must load a transformers model, got {type(model).__name__}")

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        if self._pair_max_positions:
            return self._pair_max_positions
        return super().max_length

    # -- log-likelihoods --------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        if self.mode == "no_context":  # only the tokens the target computes itself in bridge mode
            keep = self.bridge_config.hold_back
            requests = [(key, context[-keep:], continuation) for key, context, continuation in requests]
        if self.mode not in BRIDGED_MODES:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # No grouping of one-token continuations by `context + continuation[:-1]` (HFLM's logits cache): for the
        # bridge, where the context ends matters, so equal token sequences split differently are different requests.
        collator = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])))
        batch_size = override_bs or (self.batch_size if self.batch_size != "auto" else self._detect_batch_size())
        results = []
        pbar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc=f"Running loglikelihood requests ({self.mode})",
        )
        for chunk in collator.get_batched(n=batch_size):
            for (request_str, _, _), answer in zip(chunk, self._bridge_score(chunk)):
                results.append(answer)
                if request_str is not None:  # rolling windows are cached per document instead
                    self.cache_hook.add_partial("loglikelihood", request_str, answer)
                pbar.update(1)
        pbar.close()
        return collator.get_original(results)

    @torch.no_grad()
    def _bridge_score(self, chunk: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """`(sum of log-probabilities, is greedy)` of each request's continuation, with the bridge.

        Each row is `prefix | tail`: the prefix (context minus its last `hold_back` tokens, prefilled by the source)
        is left-padded to the longest prefix of the batch, so the mapped cache ends at one column for every row and
        per-row positions follow from the attention mask; the tail (held-back tokens + continuation[:-1], run by
        the target on the mapped cache) is right-padded. Padding never changes a row's numbers.
        """
        hold_back = self.bridge.config.hold_back
        rows = []
        for _, context, continuation in chunk:
            if not context or not continuation or len(continuation) > self.max_length:
                raise EvaluationError(
                    f"each request needs a non-empty context and a non-empty continuation of at most max_length="
                    f"{self.max_length} tokens, got {len(context)} context and {len(continuation)} continuation tokens"
                )
            whole = (context + continuation)[-(self.max_length + 1) :]  # left-truncated, as HFLM does
            inputs = whole[:-1]
            split = max(len(whole) - len(continuation) - hold_back, 0)
            rows.append((inputs[:split], inputs[split:], continuation))
        prefix_len = max(len(prefix) for prefix, _, _ in rows)
        tail_len = max(len(tail) for _, tail, _ in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), prefix_len + tail_len), pad, dtype=torch.long)  # (B, P + T)
        mask = torch.zeros_like(ids)
        for i, (prefix, tail, _) in enumerate(rows):
            ids[i, prefix_len - len(prefix) : prefix_len] = torch.tensor(prefix, dtype=torch.long)
            ids[i, prefix_len : prefix_len + len(tail)] = torch.tensor(tail, dtype=torch.long)
            mask[i, prefix_len - len(prefix) : prefix_len + len(tail)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = positions_from_mask(mask)  # (B, P + T): per-row positions, pads at 0
        with torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        ):
            # `bridge.prefill` + target on the mapped cache, as `bridge.forward` does; called directly because the
            # padded batch may be wider than max_length although no row's positions are
            # the source's logits are not scored: keep only the last position's (`source_logits=False`)
            cache = (
                self.bridge.prefill(ids[:, :prefix_len], mask[:, :prefix_len], source_logits=False)[0]
                if prefix_len
                else None
            )
            if cache is not None and self.mode in CONTROL_MODES:
                control_cache(cache, self.mode, mask[:, :prefix_len])
            logits = self.bridge.target(
                input_ids=ids[:, prefix_len:],
                attention_mask=mask,
                position_ids=positions[:, prefix_len:],
                **cache_kwargs(cache),
                use_cache=cache is not None,
            ).logits  # (B, T, V): the target's logits over the tails
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        answers = []
        for i, (_, tail, continuation) in enumerate(rows):
            row = logprobs[i, len(tail) - len(continuation) : len(tail)]  # (C, V): predictions of the continuation
            target = torch.tensor(continuation, dtype=torch.long, device=row.device)
            greedy = bool((row.argmax(-1) == target).all())
            answers.append((float(row.gather(-1, target[:, None]).sum()), greedy))
        return answers

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """`HFLM`'s generation, from a control cache of the context (control modes) or without the context."""
        if self.mode == "no_context":  # the last hold_back tokens only (left padding: the last columns are real)
            keep = min(self.bridge_config.hold_back, context.shape[1])
            mask = generation_kwargs.get("attention_mask")
            generation_kwargs["attention_mask"] = None if mask is None else mask[:, -keep:]
            out = super()._model_generate(
                context[:, -keep:], max_length - context.shape[1] + keep, stop, **generation_kwargs
            )
            return torch.cat([context, out[:, keep:]], dim=1)  # lm-eval cuts the context's width off the front
        if self.mode in CONTROL_MODES:
            mask = generation_kwargs.get("attention_mask")
            mask = torch.ones_like(context) if mask is None else mask
            split = context.shape[1] - self.bridge.config.hold_back
            if split > 0:  # as `bridge.generate` would prefill, then the control stands in for the mapped cache
                cache, _ = self.bridge.prefill(context[:, :split], mask[:, :split], source_logits=False)
                generation_kwargs[CACHE_KWARG] = control_cache(cache, self.mode, mask[:, :split])
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Per-document log-likelihood, scored in chunks of `rolling_stride` tokens (policy: module docstring)."""
        windows, counts = [], []
        for (string,) in tqdm([req.args for req in requests], disable=disable_tqdm or self.rank != 0):
            stride = min(self.rolling_stride, self.max_length)
            chunks = list(rolling_chunks(self.tok_encode(string), self.prefix_token_id, self.max_length, stride))
            windows.extend((None, context, continuation) for context, continuation in chunks)
            counts.append(len(chunks))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True) if windows else []
        totals, start = [], 0
        for req, count in zip(requests, counts):
            total = sum(logprob for logprob, _ in scores[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def get_model_info(self) -> dict:
        """What the results record about the model (no Hub look-ups: the bridge's ids and revisions are known)."""
        config = self.bridge_config
        model = self.bridge if self.bridge is not None else self._model
        return {
            "model_num_parameters": sum(p.numel() for p in model.parameters()),
            "model_dtype": str(self._model.dtype),
            "model_revision": self.revision,
            "model_sha": "",
            "kvbridge_mode": self.mode,
            "kvbridge_source": f"{config.source_name_or_path}@{config.source_revision or 'default'}",
            "kvbridge_target": f"{config.target_name_or_path}@{config.target_revision or 'default'}",
            "kvbridge_hold_back": config.hold_back,
            "kvbridge_rolling_stride": self.rolling_stride,
        }


def cli_evaluate() -> None:
    """`kvbridge-lm-eval`: lm-eval's own command line (same flags as `lm_eval`) with `kvbridge` registered."""
    from lm_eval.__main__ import cli_evaluate as lm_eval_cli

    lm_eval_cli()


# -- the offline pocket tasks' data (eval_tasks/pocket/) -------------------------------------------------------------
def _passages(text: str, words: int) -> list[list[str]]:
    tokens = text.split()
    return [tokens[i : i + words] for i in range(0, len(tokens) - words + 1, words)]


def build_pocket_task_data(
    out_dir: str | Path,
    *,
    heldout: str | Path | None = None,
    cloze_items: int = 256,
    context_words: int = 40,
    choice_words: int = 8,
    num_choices: int = 4,
    rolling_docs: int = 48,
    rolling_words: int = 160,
    seed: int = 0,
) -> dict[str, Path]:
    """Writes the JSONL data of the offline pocket tasks from the pocket family's held-out split (reproducible).

    - `cloze.jsonl`: `{"context", "choices", "label"}`: a `context_words` passage of a held-out document; the true
      next `choice_words` words against `num_choices - 1` equally long spans of *other* documents.
    - `rolling.jsonl`: `{"text"}`: `rolling_words`-word passages, for rolling perplexity.

    Words (whitespace-split) rather than tokens, so the data fits any tokenizer.
    """
    if heldout is None:
        from importlib import resources

        heldout = resources.files("hf_kvbridge").joinpath("pocket", "data", "heldout.jsonl.gz")
    with gzip.open(heldout, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    windows = [(d, w) for d, text in enumerate(docs) for w in _passages(text, context_words + choice_words)]
    rng.shuffle(windows)
    cloze = []
    for doc, words in windows[:cloze_items]:
        others = [w for d, w in rng.sample(windows, 4 * num_choices) if d != doc][: num_choices - 1]
        if len(others) < num_choices - 1:
            continue
        choices = [" ".join(words[context_words:])] + [" ".join(w[context_words:]) for w in others]
        order = list(range(num_choices))
        rng.shuffle(order)
        cloze.append(
            {
                "context": " ".join(words[:context_words]),
                "choices": [choices[k] for k in order],
                "label": order.index(0),
            }
        )
    passages = [" ".join(w) for text in docs for w in _passages(text, rolling_words)]
    rng.shuffle(passages)
    paths = {"cloze": out_dir / "cloze.jsonl", "rolling": out_dir / "rolling.jsonl"}
    for name, rows in (("cloze", cloze), ("rolling", [{"text": p} for p in passages[:rolling_docs]])):
        with open(paths[name], "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_kvbridge.integrations.lm_eval build-pocket-tasks [--out eval_tasks/pocket/data]`."""
    parser = argparse.ArgumentParser(prog="python -m hf_kvbridge.integrations.lm_eval")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-pocket-tasks", help="write the offline pocket tasks' JSONL from the held-out split")
    build.add_argument("--out", default="eval_tasks/pocket/data")
    build.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in build_pocket_task_data(args.out, seed=args.seed).items():
        print(f"{name}: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
