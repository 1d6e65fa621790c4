"""Every error hf_kvbridge raises on purpose, in one place.

Each names what is wrong and what to do about it. They derive from `KVBridgeError` (catch that for "anything the
bridge refused") and from the builtin a caller would expect (`ValueError` for bad input, `OSError` for files), so
code written against the builtins keeps working.
"""

import sys
import warnings
from typing import Any


class KVBridgeError(Exception):
    """Base class of hf_kvbridge's own errors."""


class ConfigurationError(KVBridgeError, ValueError):
    """A `KVBridgeConfig` or `CalibrationSettings` value is out of range, of the wrong kind, or contradicts another."""


class InvalidInputError(KVBridgeError, ValueError):
    """A call's arguments cannot be used: tensor shapes, batch sizes, token ids or options that do not fit the call."""


class MapperError(KVBridgeError, ValueError):
    """A mapper cannot be built, fitted or applied: an unknown `mapper_type`, weights of the wrong shape, a bad fit."""


class ServingConfigError(KVBridgeError, ValueError):
    """A serving engine (vLLM) or KV store is configured in a way the connector refuses at start-up."""


class EvaluationError(KVBridgeError, ValueError):
    """An evaluation (lm-eval, `kvbridge eval`) was asked for something the bridge cannot score."""


class KVLayoutError(KVBridgeError, ValueError):
    """The source and target (or a model and a saved mapper) do not share a KV layout the bridge can map."""


class CalibrationDataError(KVBridgeError, ValueError):
    """Calibration data is missing, empty or unreadable."""


class StatisticsError(KVBridgeError, ValueError):
    """Statistics are unusable: non-finite values, too few tokens, or mismatched layouts."""


class StatisticsMemoryError(StatisticsError, MemoryError):
    """The calibration statistics do not fit the memory budget (`statistics_memory`); raised before any work."""


class MapperFileError(KVBridgeError, OSError):
    """A mapper weights file is missing, truncated, corrupt or does not fit the config."""


class CheckpointFileError(KVBridgeError, OSError):
    """A bridge checkpoint's own files cannot be read or written: an unreadable `config.json`, a folder in the way."""


class CheckpointExistsError(CheckpointFileError, FileExistsError):
    """`save_pretrained` was pointed at a file, or at a non-empty folder without `overwrite=True`."""


class CheckpointNotFoundError(KVBridgeError, FileNotFoundError):
    """A bridge checkpoint is neither a local folder nor a repository reachable on the Hub."""


class ContextLengthError(KVBridgeError, ValueError):
    """A prompt, generation or benchmark length runs past the models' maximum positions.

    Raise it through `ContextLengthError.check`, the one length check the library, the CLI and the tools share.

    Example:

    ```python
    >>> ContextLengthError.check("the prompt", 3000, 2048, "shorten it")
    Traceback (most recent call last):
    ...
    hf_kvbridge.errors.ContextLengthError: the prompt is 3,000 tokens but the models take at most 2,048 positions; shorten it
    ```
    """  # noqa: E501 (a doctest's expected output is one line)

    @classmethod
    def check(cls, what: str, tokens: int, limit: int | None, hint: str) -> None:
        """Raises if `tokens` (the length of `what`) exceeds `limit` positions; a `limit` of `None` means unknown."""
        if limit is not None and tokens > limit:
            raise cls(f"{what} is {tokens:,} tokens but the models take at most {limit:,} positions; {hint}")


class MissingDependencyError(KVBridgeError, ImportError):
    """An optional dependency (vLLM) is not installed; the message says what to install."""


class MovedError(KVBridgeError, ImportError):
    """A name that moved to the fitting side (`hf_kvbridge.fitting`), read from its old runtime module before the
    fitting side was imported; the message names its new module."""


def moved_name(module: str, name: str, moves: dict[str, str]):
    """What the module `__getattr__` of a runtime module whose fitting names moved returns: `name` from its new module
    `moves[name]` once the fitting side is imported (the runtime never imports it), a `MovedError` naming that module
    before."""
    new = moves.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    if new in sys.modules:
        return getattr(sys.modules[new], name)
    raise MovedError(f"{module}.{name} moved to {new}.{name} (the fitting side): import it from there")


def moved_names(module: str, names, new: str):
    """The module `__getattr__` of `module`, whose `names` moved to module `new` (`moved_name` for each).

    Example:

    ```python
    >>> __getattr__ = moved_names("old.place", ("fit",), "new.place")
    >>> try:
    ...     __getattr__("fit")
    ... except MovedError as error:
    ...     print(error)
    old.place.fit moved to new.place.fit (the fitting side): import it from there
    ```
    """
    moves = dict.fromkeys(names, new)

    def __getattr__(name: str):
        return moved_name(module, name, moves)

    return __getattr__


def renamed_name(module: str, name: str, renames: dict[str, Any]):
    """The module `__getattr__` of a module whose public names were renamed (one release): `renames[name]` (the
    object under its new name) with a `DeprecationWarning` naming it, else the usual `AttributeError`."""
    if name not in renames:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = renames[name]
    warnings.warn(
        f"{module}.{name} is renamed {module}.{new.__name__}: use the new name", DeprecationWarning, stacklevel=3
    )
    return new


def unknown_mapper_type(name: str, known) -> MapperError:
    """The error for a `mapper_type` no registry entry names, listing the `known` ones."""
    return MapperError(
        f"unknown mapper_type {name!r}; this hf_kvbridge knows {', '.join(known)}: use one of them, or upgrade "
        "hf_kvbridge for a checkpoint saved by a newer version"
    )


class BenchmarkError(KVBridgeError, ChildProcessError):
    """A process a benchmark started (one engine of `kvbridge bench vllm`) exited non-zero; its output says why."""


class TuningError(KVBridgeError, ValueError):
    """No configuration of a tuning grid meets the quality target or the cost budget (`kvbridge tune`)."""


class StoreUnavailableError(KVBridgeError, OSError):
    """The KV store (a Redis-protocol server) cannot be reached or refused the client: connection, timeout, auth."""


class StoreFormatError(KVBridgeError, ValueError):
    """A KV store entry is not a chunk this version can use: another format or version, another model, bad bytes."""


class StoreMissError(KVBridgeError, OSError):
    """A chunk the lookup found is gone from the KV store (evicted or expired) by the time it is fetched.

    An `OSError`, as `FileNotFoundError` is: the data is missing from a storage system, not the call's input wrong.
    """


__all__ = [
    "BenchmarkError",
    "CalibrationDataError",
    "CheckpointExistsError",
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "ContextLengthError",
    "EvaluationError",
    "InvalidInputError",
    "KVBridgeError",
    "KVLayoutError",
    "MapperError",
    "MapperFileError",
    "MissingDependencyError",
    "MovedError",
    "ServingConfigError",
    "StatisticsError",
    "StatisticsMemoryError",
    "StoreFormatError",
    "StoreMissError",
    "StoreUnavailableError",
    "TuningError",
]
