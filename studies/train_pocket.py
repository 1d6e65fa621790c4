"""Build the "pocket" model family from scratch: corpus, tokenizer, four tiny Qwen3 models, evaluation, model cards.

The pocket family is a set of tiny causal language models that share one tokenizer and (except ``pocket-x``) one
KV-cache layout (2 KV heads x head_dim 32) while differing in depth and width. They exist so that cross-model
KV-cache transfer can be measured offline, on real models that actually use their context.

Corpus
    The reStructuredText sources of the Python 3.11 documentation as shipped by Debian's ``python3.11-doc`` package
    (PSF-2.0). The script fetches the package with ``apt-get download python3.11-doc`` (this needs an apt mirror,
    nothing else) unless ``--deb PATH`` points at an already downloaded ``.deb``. Documents (files) are split
    deterministically by a seeded shuffle into held-out (~5 % of characters), calibration (~5 %) and train (rest).
    The held-out and calibration splits are written as JSON Lines (``{"text", "source"}``) to ``<out>/data``; the
    train split is never shipped, it is regenerated from the ``.deb``.

Usage::

    python -m studies.train_pocket --out /tmp/pocket
    python studies/train_pocket.py --out /tmp/pocket --models pocket-l \
        --tokenizer hf_kvbridge/pocket/models/pocket-s --eval-every 500

The script only uses torch, tokenizers and transformers; it imports nothing else from ``hf_kvbridge`` so it runs
both as a module and as a plain file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import random
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEB_PACKAGE = "python3.11-doc"
SOURCES_SUBDIR = "usr/share/doc/python3.11/html/_sources"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
SPLIT_SEED = 1234
SPLIT_FRACTION = 0.05  # fraction of corpus characters for each of held-out and calibration
MAX_SHIPPED_CHARS = 1_500_000  # cap for each shipped split (uncompressed text)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class PocketSpec:
    """Architecture and training recipe of one pocket model."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    seed: int
    steps: int
    batch_size: int
    lr: float


POCKET_SPECS: dict[str, PocketSpec] = {
    spec.name: spec
    for spec in (
        PocketSpec("pocket-s", 3, 128, 4, 2, 32, 384, seed=11, steps=1500, batch_size=8, lr=3e-3),
        PocketSpec("pocket-m", 6, 192, 6, 2, 32, 512, seed=22, steps=1500, batch_size=8, lr=2.5e-3),
        PocketSpec("pocket-l", 8, 256, 8, 2, 32, 704, seed=33, steps=3000, batch_size=8, lr=2e-3),
        PocketSpec("pocket-x", 2, 128, 8, 4, 16, 384, seed=44, steps=1500, batch_size=8, lr=3e-3),
    )
}


# ----------------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------------


def fetch_deb(workdir: Path) -> Path:
    """Download the ``python3.11-doc`` package into ``workdir`` with ``apt-get download`` and return its path."""
    logger.info("downloading %s with apt-get (run 'apt-get update' first if this fails)", DEB_PACKAGE)
    subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=workdir, check=True)
    debs = sorted(workdir.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        raise FileNotFoundError(f"apt-get download produced no {DEB_PACKAGE}_*.deb in {workdir}")
    return debs[-1]


def deb_version(deb: Path) -> str:
    """Return the Debian version string of a ``.deb`` file."""
    out = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def extract_documents(deb: Path, workdir: Path) -> list[dict[str, str]]:
    """Unpack ``deb`` and return its ``*.rst.txt`` documents as ``{"text", "source"}`` dicts, sorted by source."""
    root = workdir / "extracted"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    sources = root / SOURCES_SUBDIR
    files = sorted(sources.rglob("*.rst.txt"))
    if not files:
        raise FileNotFoundError(f"no *.rst.txt under {sources}; the package layout changed")
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8").strip()
        if text:
            docs.append({"text": text, "source": path.relative_to(sources).as_posix()})
    logger.info("extracted %d documents, %d characters", len(docs), sum(len(d["text"]) for d in docs))
    return docs


def split_documents(docs: list[dict[str, str]], seed: int = SPLIT_SEED) -> dict[str, list[dict[str, str]]]:
    """Split documents (whole files) into held-out, calibration and train.

    Documents are shuffled with ``random.Random(seed)``; held-out takes documents from the front until it holds
    ``SPLIT_FRACTION`` of all characters, then calibration does the same, and the rest is train. A document that
    would push a shipped split past ``MAX_SHIPPED_CHARS`` is skipped for that split (it then falls to the next one),
    so the shipped splits stay below the cap.
    """
    order = sorted(docs, key=lambda d: d["source"])
    random.Random(seed).shuffle(order)
    target = SPLIT_FRACTION * sum(len(d["text"]) for d in order)
    splits: dict[str, list[dict[str, str]]] = {"heldout": [], "calibration": [], "train": []}
    remaining = order
    for name in ("heldout", "calibration"):
        size, rest = 0, []
        for doc in remaining:
            if size < target and size + len(doc["text"]) <= MAX_SHIPPED_CHARS:
                splits[name].append(doc)
                size += len(doc["text"])
            else:
                rest.append(doc)
        remaining = rest
    splits["train"] = remaining
    for name, part in splits.items():
        logger.info("split %-11s %4d docs %9d chars", name, len(part), sum(len(d["text"]) for d in part))
    return splits


def write_jsonl_gz(docs: list[dict[str, str]], path: Path) -> None:
    """Write documents as gzip-compressed JSON Lines (byte-reproducible: fixed mtime, no file name in header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(payload)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str]):  # -> transformers.PreTrainedTokenizerFast
    """Train a byte-level BPE (vocab 4096) on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    logger.info("tokenizer trained: vocab %d", len(fast))
    return fast


def save_tokenizer(tokenizer, folder: Path) -> None:
    """Save the tokenizer so that ``AutoTokenizer.from_pretrained(folder)`` works offline.

    The chat template goes into ``tokenizer_config.json`` (not a separate ``chat_template.jinja``), the class is
    recorded as ``PreTrainedTokenizerFast`` (loadable by transformers 4.x and 5.x) and a ``special_tokens_map.json``
    is written for older readers.
    """
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # loading arguments of a `--tokenizer` folder, not settings
        config.pop(key, None)
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END]}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def load_tokenizer(folder: Path):  # -> transformers.PreTrainedTokenizerFast
    """Load a pocket tokenizer saved by :func:`save_tokenizer` (``--tokenizer``) and check that it is one."""
    from transformers import PreTrainedTokenizerFast

    if not (folder / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {folder}: no tokenizer.json in that folder")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    if len(tokenizer) != VOCAB_SIZE or tokenizer.eos_token != EOS:
        raise SystemExit(
            f"--tokenizer {folder}: vocabulary {len(tokenizer)} with EOS {tokenizer.eos_token!r} is not a pocket "
            f"tokenizer (vocabulary {VOCAB_SIZE}, EOS {EOS!r})"
        )
    logger.info("tokenizer loaded from %s: vocab %d", folder, len(tokenizer))
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Tokenize documents and concatenate them, each followed by EOS. Returns ``[n_tokens]`` int64."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def build_config(spec: PocketSpec, tokenizer):  # -> transformers.Qwen3Config
    """Return the ``Qwen3Config`` of a pocket model (full attention, RoPE theta 10000, tied embeddings)."""
    from transformers import Qwen3Config

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        layer_types=["full_attention"] * spec.num_hidden_layers,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def lr_at(step: int, spec: PocketSpec, warmup: int) -> float:
    """Linear warmup then cosine decay to 10 % of the peak learning rate."""
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.steps - warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train_model(
    spec: PocketSpec,
    tokenizer,
    train_ids: torch.Tensor,
    use_bf16: bool = True,
    heldout_ids: torch.Tensor | None = None,
    eval_every: int = 0,
):
    """Train one pocket model from scratch on random 512-token windows of ``train_ids``; return it (fp32, eval).

    With ``eval_every`` > 0 and ``heldout_ids``, log the held-out perplexity of the first 32 windows every
    ``eval_every`` steps (monitoring only: it uses no random numbers, so the trained weights do not change).
    """
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(build_config(spec, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "%s: %d parameters, %d steps x %d x %d tokens", spec.name, n_params, spec.steps, spec.batch_size, SEQ_LEN
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(spec.seed)
    warmup = max(1, spec.steps // 20)
    model.train()
    t0 = time.perf_counter()
    for step in range(spec.steps):
        starts = torch.randint(0, train_ids.numel() - SEQ_LEN, (spec.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == spec.steps - 1:
            logger.info(
                "%s step %4d/%d loss %.3f lr %.2e (%.1fs)",
                spec.name,
                step,
                spec.steps,
                loss.item(),
                lr_at(step, spec, warmup),
                time.perf_counter() - t0,
            )
        if eval_every > 0 and heldout_ids is not None and (step + 1) % eval_every == 0 and step + 1 < spec.steps:
            model.eval()
            probe = evaluate(model, heldout_ids[: 32 * SEQ_LEN])
            logger.info("%s step %4d held-out ppl (32 windows) %.2f", spec.name, step + 1, probe["heldout_ppl"])
            model.train()
    model.eval()
    return model


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Held-out metrics over non-overlapping 512-token windows of ``ids``.

    Returns the perplexity over all predicted tokens and the mean NLL of tokens predicted at window positions
    < 16 (almost no context) and >= 256 (long context); ``nll_pos_lt16 - nll_pos_ge256`` > 0 means that the
    model uses its context.
    """
    n_windows = ids.numel() // SEQ_LEN
    windows = ids[: n_windows * SEQ_LEN].view(n_windows, SEQ_LEN)  # [N, T]
    nll_sum = torch.zeros(SEQ_LEN - 1, dtype=torch.float64)  # per target position 1..T-1
    for i in range(0, n_windows, batch_size):
        batch = windows[i : i + batch_size]  # [b, T]
        logits = model(input_ids=batch).logits.float()  # [b, T, V]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none"
        )  # [b, T-1]; column j predicts the token at position j+1 from positions 0..j
        nll_sum += nll.sum(0).double()
    per_pos = nll_sum / n_windows  # [T-1]
    mean_nll = per_pos.mean().item()
    return {
        "heldout_tokens": n_windows * (SEQ_LEN - 1),
        "heldout_nll": mean_nll,
        "heldout_ppl": math.exp(mean_nll),
        "nll_pos_lt16": per_pos[:15].mean().item(),
        "nll_pos_ge256": per_pos[255:].mean().item(),
    }


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy continuation of ``prompt`` (used as a smoke test and in the model cards)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# Model cards and results
# ----------------------------------------------------------------------------------------------------------------


def model_card(spec: PocketSpec, info: dict, provenance: dict) -> str:
    """Return the README.md (model card) of one pocket model."""
    m = info["metrics"]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- qwen3
- tiny
- hf-kvbridge
- kv-cache
---

# {spec.name}

A tiny Qwen3-architecture causal LM of the *pocket family* shipped with `hf_kvbridge` to test cross-model
KV-cache transfer offline. It is trained from scratch on a CPU (time below) and is **not** useful for anything
else: it produces Python-documentation-flavoured text.

| | |
|---|---|
| layers / hidden / intermediate | {spec.num_hidden_layers} / {spec.hidden_size} / {spec.intermediate_size} |
| attention heads / KV heads / head_dim | {spec.num_attention_heads} / {spec.num_key_value_heads} / {spec.head_dim} |
| vocabulary | {VOCAB_SIZE} (byte-level BPE shared by the whole family) |
| RoPE | default, theta 10000; full attention; tied embeddings |
| parameters | {info["parameters"]:,} |
| weights | {info["weights_bytes"]:,} bytes (fp16 safetensors) |
| training | {spec.steps} steps x {spec.batch_size} x {SEQ_LEN} tokens, AdamW, cosine, lr {spec.lr}, seed {spec.seed} |
| training time | {info["train_seconds"]:.0f} s on {info["threads"]} CPU threads |

## Held-out evaluation

Non-overlapping {SEQ_LEN}-token windows of the held-out split ({m["heldout_tokens"]:,} predicted tokens;
documents never seen in training or calibration):

| metric | value |
|---|---|
| perplexity | {m["heldout_ppl"]:.2f} |
| mean NLL, target positions < 16 | {m["nll_pos_lt16"]:.3f} |
| mean NLL, target positions >= 256 | {m["nll_pos_ge256"]:.3f} |

The NLL of tokens with at least 256 tokens of context is lower than that of tokens with fewer than 16, so the
model uses its context. Greedy continuation (40 new tokens) of the prompt ``{info["sample_prompt"]}``:

```rst
{info["sample_prompt"]}{info["sample"]}
```

## Data and licence

Trained on the reStructuredText sources of the Python 3.11 documentation from Debian's
`{provenance["package"]}` {provenance["version"]} (PSF-2.0), split by document; see \
`hf_kvbridge/pocket/data/README.md`.
Code and weights: Apache-2.0. Training data: PSF-2.0 (Python Software Foundation License Version 2).
Reproduce with `python -m studies.train_pocket --out DIR --models {spec.name}`.
"""


DATA_README = """# pocket corpus splits

Text used by the pocket model family (`hf_kvbridge.pocket`).

* Source: the reStructuredText sources (`{sources}/**/*.rst.txt`) of the Python 3.11 documentation, as shipped in
  the Debian package `{package}` version `{version}` (`apt-get download {package}`).
* Licence: PSF-2.0 (Python Software Foundation License Version 2); Copyright (c) 2001-2023 Python Software
  Foundation. The full licence text is part of the package (`usr/share/doc/{package}/copyright`) and of the
  documentation itself (`license.rst.txt`).
* Split: by document (file), seeded shuffle (seed {seed}); held-out and calibration each take documents until they
  hold ~{pct:.0f} % of the corpus characters; the rest is train. No model was trained on either shipped split, and
  calibration code must never use `heldout`.
* Format: gzip-compressed JSON Lines, one document per line: `{{"text": ..., "source": path relative to _sources}}`.

| split | documents | characters | shipped |
|---|---|---|---|
{rows}
"""


def write_data(splits: dict[str, list[dict[str, str]]], out: Path, provenance: dict) -> None:
    """Write the shipped splits and their README into ``out/data``."""
    data = out / "data"
    write_jsonl_gz(splits["calibration"], data / "calibration.jsonl.gz")
    write_jsonl_gz(splits["heldout"], data / "heldout.jsonl.gz")
    rows = "\n".join(
        f"| {name} | {len(docs)} | {sum(len(d['text']) for d in docs):,} | "
        f"{'`' + name + '.jsonl.gz`' if name != 'train' else 'no (regenerated by train.py)'} |"
        for name, docs in splits.items()
    )
    (data / "README.md").write_text(
        DATA_README.format(sources=SOURCES_SUBDIR, seed=SPLIT_SEED, pct=100 * SPLIT_FRACTION, rows=rows, **provenance),
        encoding="utf-8",
    )


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (gets data/, models/, results.json)")
    parser.add_argument("--models", default=",".join(POCKET_SPECS), help="comma-separated subset of models")
    parser.add_argument("--deb", type=Path, default=None, help="use this python3.11-doc .deb instead of apt-get")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply every step count (for smoke tests)")
    parser.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="log held-out perplexity on 32 windows every N steps (0: never)"
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="reuse the tokenizer saved in this folder (e.g. a shipped pocket model) instead of training one, so "
        "that retrained models stay compatible with the members that are not retrained",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the corpus splits, the tokenizer and the requested pocket models; evaluate and document them."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(POCKET_SPECS))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; available: {sorted(POCKET_SPECS)}")
    if args.eval_every < 0:
        raise SystemExit(f"--eval-every {args.eval_every}: must be 0 (never) or a positive number of steps")
    # Check a reused tokenizer before the download and the split, which it would otherwise follow by minutes.
    shipped_tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="pocket-") as tmp:
        workdir = Path(tmp)
        deb = args.deb.resolve() if args.deb else fetch_deb(workdir)
        provenance = {"package": DEB_PACKAGE, "version": deb_version(deb)}
        docs = extract_documents(deb, workdir)
    splits = split_documents(docs)
    write_data(splits, out, provenance)

    train_texts = [d["text"] for d in splits["train"]]
    tokenizer = shipped_tokenizer if shipped_tokenizer is not None else train_tokenizer(train_texts)
    train_ids = encode_stream(tokenizer, train_texts)  # [n_train_tokens]
    heldout_ids = encode_stream(tokenizer, [d["text"] for d in splits["heldout"]])  # [n_heldout_tokens]
    logger.info("train tokens %d, held-out tokens %d", train_ids.numel(), heldout_ids.numel())

    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["corpus"] = {
        **provenance,
        "split_seed": SPLIT_SEED,
        "train_tokens": train_ids.numel(),
        "heldout_tokens": heldout_ids.numel(),
        **{f"{k}_documents": len(v) for k, v in splits.items()},
    }
    results.setdefault("models", {})
    prompt = "The :mod:`json` module"
    for name in names:
        spec = POCKET_SPECS[name]
        if args.steps_scale != 1.0:
            spec = PocketSpec(**{**asdict(spec), "steps": max(2, round(spec.steps * args.steps_scale))})
        t0 = time.perf_counter()
        model = train_model(
            spec, tokenizer, train_ids, use_bf16=not args.no_bf16, heldout_ids=heldout_ids, eval_every=args.eval_every
        )
        train_seconds = time.perf_counter() - t0
        model = model.half().float()  # evaluate exactly the weights that are shipped (fp16), computed in fp32
        metrics = evaluate(model, heldout_ids)
        logger.info("%s held-out: %s", name, json.dumps(metrics))
        folder = out / "models" / name
        if folder.exists():
            shutil.rmtree(folder)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.half().save_pretrained(folder, safe_serialization=True)
        save_tokenizer(tokenizer, folder)
        model.float()
        info = {
            "spec": asdict(spec),
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights_bytes": (folder / "model.safetensors").stat().st_size,
            "train_seconds": round(train_seconds, 1),
            "threads": args.threads,
            "metrics": metrics,
            "sample_prompt": prompt,
            "sample": sample_text(model, tokenizer, prompt),
        }
        (folder / "README.md").write_text(model_card(spec, info, provenance), encoding="utf-8")
        results["models"][name] = info
        results_path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    logger.info("done in %.0f s; results in %s", time.perf_counter() - t_start, results_path)


if __name__ == "__main__":
    main()
