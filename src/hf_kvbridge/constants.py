"""File names and version numbers shared by saving, loading and the Hub (one place, as in peft)."""

CONFIG_NAME = "config.json"
MAPPER_WEIGHTS_NAME = "mapper.safetensors"
MAPPER_WEIGHTS_INDEX_NAME = "mapper.safetensors.index.json"
MODEL_CARD_NAME = "README.md"

# Bumped whenever the meaning of a saved file changes; loading refuses newer formats.
FORMAT_VERSION = 1

# The default calibration corpus of the paper (streamed; needs the Hub).
DEFAULT_CALIBRATION_DATA = "HuggingFaceFW/fineweb-edu"

HEAD_MODES = ("all_heads", "same_head")

# Decoder families whose attention uses the rotate-half RoPE convention and full (global) attention.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
