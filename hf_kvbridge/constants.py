"""File names and version numbers shared by saving, loading and the Hub (one place, as in peft)."""

CONFIG_NAME = "config.json"
MAPPER_WEIGHTS_NAME = "mapper.safetensors"
MAPPER_WEIGHTS_INDEX_NAME = "mapper.safetensors.index.json"
# the residual map of layer recompute (`hf_kvbridge.transfer.layer_recompute`), beside the K/V mapper when calibrated
RESIDUAL_WEIGHTS_NAME = "residual.safetensors"
MODEL_CARD_NAME = "README.md"
# the shared tokenizer a checkpoint carries (so `AutoTokenizer.from_pretrained(bridge_dir)` works): whatever of these
# `tokenizer.save_pretrained` writes
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# shards of a large mapper: mapper-00001-of-00003.safetensors, ... (listed in MAPPER_WEIGHTS_INDEX_NAME)
MAPPER_SHARD_PATTERN = "mapper{suffix}.safetensors"
DEFAULT_MAX_SHARD_SIZE = "2GB"
# config.json key holding {weight file name: sha256 hex digest}, verified on load
MAPPER_CHECKSUMS_KEY = "mapper_sha256"
LIBRARY_NAME = "hf-kvbridge"
# kwargs that AutoModelForCausalLM.from_pretrained forwards and that have no meaning for the bridge itself
AUTO_LOAD_KWARGS = (
    "trust_remote_code",
    "adapter_kwargs",
    "code_revision",
    "_from_auto",
    "_commit_hash",
    "subfolder",
    "proxies",
    "user_agent",
    "_from_pipeline",
)

# Bumped whenever the meaning of a saved file changes; loading refuses newer formats. A checkpoint records the
# oldest version that can read it: K/V-only bridges stay at `KV_FORMAT_VERSION` (every reader loads them), a bridge
# whose mapper reads the source's hidden states (`hf_kvbridge.utils.source_features`) needs
# `HIDDEN_FEATURES_FORMAT_VERSION`, which readers of version 1 refuse instead of loading it as a K/V-only bridge.
KV_FORMAT_VERSION = 1
HIDDEN_FEATURES_FORMAT_VERSION = 2
# a mapper whose keys are put back on the target's key-norm sphere (`config.key_norm`, `utils.key_norm`): readers of
# versions 1-2 would map without it and serve keys of the wrong lengths
KEY_NORM_FORMAT_VERSION = 3
FORMAT_VERSION = KEY_NORM_FORMAT_VERSION  # the newest this version reads

# The default calibration corpus of the paper (streamed; needs the Hub).
DEFAULT_CALIBRATION_DATA = "HuggingFaceFW/fineweb-edu"

HEAD_MODES = ("all_heads", "same_head")
# "joint": keys and values of the selected layers → keys and values; "separate": keys from keys, values from values
KV_MODES = ("joint", "separate")
# whether mapped keys are put back on the target's key-norm sphere (`utils.key_norm`): "auto" where the target has one
KEY_NORM_MODES = ("auto", "on", "off")
# the mapping engine's schedules (`hf_kvbridge.mappers.engine`): "auto" picks by device, whole layers on CUDA,
# cache-sized chunks elsewhere
SCHEDULES = ("auto", "chunked", "layers")

# The mapper types of `hf_kvbridge.mappers.MAPPER_REGISTRY` and the `mapper_kwargs` each one's fit accepts, named here
# so that the settings (and the command line built from them) can offer and check them without importing the mappers;
# each registry entry reads its keywords from here (`MapperType.kwargs`), and tests/cli/test_cli.py checks the names
# agree.
MAPPER_KWARGS = {
    "ridge": (),
    "ridge_attention_weighted": ("weighting",),
    "mlp": ("hidden", "loss", "epochs", "lr", "steps_per_batch", "weight_decay", "seed"),
    "low_rank": ("rank",),
}
MAPPER_TYPE_NAMES = tuple(MAPPER_KWARGS)
# the choices of two of them: the MLP mapper's training loss, and the token weights of ridge_attention_weighted
MLP_LOSSES = ("mse", "attention")
WEIGHTINGS = ("attention", "uniform")

# dtypes of the budgeted calibration statistics' Gram blocks
STATISTICS_DTYPES = ("float32", "float64")

# files `--data` reads as local text (anything else is a dataset name)
TEXT_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# A bidirectional checkpoint keeps its target→source mapper (config, weights) in this sub-folder.
REVERSE_FOLDER = "reverse"
# every file a checkpoint may hold (pushes upload these and nothing else), and what travels to and from the Hub: the
# checkpoint, and the reverse mapper of a bidirectional one
SHARD_GLOB = "mapper-*-of-*.safetensors"
WEIGHT_FILE_PATTERNS = [MAPPER_WEIGHTS_NAME, MAPPER_WEIGHTS_INDEX_NAME, SHARD_GLOB, RESIDUAL_WEIGHTS_NAME]
CHECKPOINT_FILE_PATTERNS = [CONFIG_NAME, MODEL_CARD_NAME, *WEIGHT_FILE_PATTERNS, *TOKENIZER_FILE_NAMES]
HUB_FILE_PATTERNS = [*CHECKPOINT_FILE_PATTERNS, f"{REVERSE_FOLDER}/*"]

# How selective recompute chooses the context tokens the target recomputes (see
# `hf_kvbridge.transfer.token_recompute`).
RECOMPUTE_POLICIES = ("tail", "random", "spread", "probe", "tail_probe")

# Caches that carry no information about the context, scored next to the bridge (see `hf_kvbridge.controls`).
CONTROL_MODES = ("zero_cache", "random_cache")

# Defaults of the tool commands, here so that the CLI's parser can name them without importing the tools.
EVAL_MODES = ("source", "target", "bridge", "no_context", *CONTROL_MODES)

STORE_ENCODINGS = ("source", "bfloat16", "fp8_e4m3")
"""How a KV store's chunks hold their K/V (`hf_kvbridge.integrations.kv_store.encodings`)."""
