"""Tiny real transformers models and a tiny real tokenizer, built in code (nothing is downloaded)."""

from __future__ import annotations

import os
import signal
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# under pytest-xdist (`-n 2`, the README's test command) each worker gets one core: one torch thread, here and in the
# commands the tests start (they inherit the environment), so two workers do not oversubscribe two cores
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

torch.set_num_threads(1 if WORKERS > 1 else 2)

VOCAB = 128
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "A key and a value are cached for every token so that decoding does not repeat work.",
    "Small models answer easy questions; large models take over when the questions get hard.",
    "Rotary position embeddings rotate pairs of dimensions by an angle that grows with position.",
    "Ridge regression adds a multiple of the identity to the covariance before solving.",
] * 4


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test stops with SIGINT. A background job of a non-interactive shell
    (`pytest ... &`) ignores SIGINT, and Python installs no KeyboardInterrupt handler when it starts with SIGINT
    ignored; a terminal user's Ctrl-C is never ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def make_tokenizer(corpus: list[str] = CORPUS, vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in a fraction of a second on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<pad>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:0],
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def qwen3(
    layers: int = 2,
    hidden: int = 32,
    kv_heads: int = 2,
    head_dim: int = 16,
    vocab: int = VOCAB,
    theta: float = 10000.0,
    seed: int = 0,
    **kw,
) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=True,
        **kw,
    )
    return Qwen3ForCausalLM(config).eval()


def llama(
    layers: int = 2, hidden: int = 32, seed: int = 0, kv_heads: int = 2, head_dim: int = 16, **kw
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=VOCAB,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
        **kw,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def windows() -> torch.Tensor:
    """Random token windows: enough tokens for every tiny mapper below."""
    return torch.randint(0, VOCAB, (24, 48), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def saved_pair(tmp_path_factory, tokenizer):
    """A small (2-layer) and a large (3-layer) Qwen3 saved as local folders with the shared tokenizer."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in (("small", qwen3(layers=2, seed=1)), ("large", qwen3(layers=3, hidden=48, seed=2))):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


# the slowest test files, slowest first (seconds on 2 cores, `pytest --durations`, 2026-12-02): under
# `-n 2 --dist loadfile` each worker takes the next whole file, so starting with the long ones keeps the two busy to
# the end instead of leaving one idle while the other runs a long file last
SLOW_FILES = (
    "test_readme.py",
    "test_lm_eval.py",
    "test_recompute_study.py",
    "test_tune_search.py",
    "test_calibration_scale.py",
    "test_evaluation.py",
    "test_pocket.py",
    "test_correlation_study.py",
    "test_budget.py",
    "test_startup.py",
    "test_layer_recompute.py",
    "test_cli_errors.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order


def slowed(fn, seconds):
    """`fn`, each call delayed by `seconds` (a stage made slower by a known amount, for timing tests)."""

    def run(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return run
