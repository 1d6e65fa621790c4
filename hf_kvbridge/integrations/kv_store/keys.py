"""Store keys of a token sequence: one per whole chunk of `chunk_size` tokens, chained over the sequence, and for its
trailing partial chunk, sub-chunks of `SUB_CHUNK_SIZE` tokens and a remainder, chained on from the last whole chunk.

The key of chunk `i` is a digest of the digest of chunk `i - 1` and chunk `i`'s token ids, and the chain starts from
a digest of the format version, the model's identity and the tenant's cache salt. So a key stands for the whole
prefix up to the end of its chunk: two sequences share a key exactly when they share every token up to there, and
the longest stored run of whole chunks of a sequence is its longest run of leading keys found in the store. Chunks
are counted in tokens, independent of any engine's block size.

A chain *node* is the digest after `k` whole chunks (node 0 is the chain's root). A sequence that ends inside a chunk
stores the tokens after its last node as a chain of its own, in finer steps: sub-chunks of `SUB_CHUNK_SIZE` tokens
(`<digest>.sub`, each chained from the one before, the first from the node) and a remainder of fewer tokens
(`<digest>.part`, chained from the last sub-chunk). Every key of it is content-addressed, like a whole chunk's: it
stands for every token from the sequence's start to its own end, so a reader finds exactly the part of a stored
sequence that it shares (to the sub-chunk, and to the token for the remainder, whose every length it probes), two
sequences that branch never share a key past their branch point, and nothing is ever replaced. A partial chunk that a
longer conversation later completes stays a valid entry of the shorter sequence; it is never read by anything else,
so the server's LRU eviction drops it first, and `partial_ttl_s` makes it expire.

The model's digest and the salt's digest are readable in every key
(`kvbridge:v2:<model 12 hex>:<salt 8 hex or "-">:<chain 32 hex>[.sub | .part]`), so a `SCAN` pattern picks one
model's or one tenant's entries (`scan_pattern`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidInputError

FORMAT_VERSION = 2
"""Version of the keys and of the stored chunk format (`format.py`); a change of either bumps it (2: partial chunks
as sub-chunks and a remainder, token ids in every chunk)."""

DEFAULT_CHUNK_SIZE = 256
"""Tokens per stored chunk."""

SUB_CHUNK_SIZE = 16
"""Tokens per sub-chunk of a trailing partial chunk (at most the chunk size): a reader finds a stored partial chunk to
the sub-chunk in one step, and its remainder (fewer tokens) by probing each length."""

KEY_PREFIX = "kvbridge"
"""First field of every key the package writes."""

_CHAIN_BYTES = 16  # 32 hex characters: collisions are out of reach for any number of stored chunks


def model_identity(
    name_or_path: str, revision: str | None = None, layout_fingerprint: dict | str | None = None
) -> str:
    """The identity of the model whose K/V a chunk holds, as it goes into keys and chunk metadata.

    Args:
        name_or_path (`str`): the model's Hub id or local path (`config.name_or_path`).
        revision (`str`, *optional*): the Hub revision (a commit hash pins it).
        layout_fingerprint (`dict` or `str`, *optional*): the model's KV layout facts
            (`hf_kvbridge.KVLayout.fingerprint()`); its digest joins the identity, so two different checkpoints
            at one local path do not share keys.

    Example:

    ```python
    >>> model_identity("Qwen/Qwen3-0.6B", "main")
    'Qwen/Qwen3-0.6B@main'
    >>> model_identity("pocket-s", None, {"num_layers": 4})
    'pocket-s#layout=fc3a7cea07db0f7f'
    ```
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InvalidInputError(f"model_identity needs the model's name or path, got {name_or_path!r}")
    identity = name_or_path if not revision else f"{name_or_path}@{revision}"
    if layout_fingerprint is not None:
        facts = (
            layout_fingerprint
            if isinstance(layout_fingerprint, str)
            else json.dumps(layout_fingerprint, sort_keys=True, default=str)
        )
        identity += f"#layout={hashlib.sha256(facts.encode()).hexdigest()[:16]}"
    return identity


def model_digest(model_id: str) -> str:
    """The 12 hex characters of `model_id` in every key."""
    return hashlib.sha256(model_id.encode()).hexdigest()[:12]


def salt_digest(salt: str | None) -> str:
    """The 8 hex characters of a cache salt in every key; `"-"` without one (an empty salt is no salt)."""
    return "-" if not salt else hashlib.sha256(salt.encode()).hexdigest()[:8]


def scan_pattern(model_id: str | None = None, salt: str | None = None, *, any_salt: bool = True) -> str:
    """A `SCAN MATCH` pattern for the keys of one model (and one tenant's salt, with `any_salt=False`).

    Example:

    ```python
    >>> scan_pattern()
    'kvbridge:v2:*'
    >>> scan_pattern("Qwen/Qwen3-0.6B@main", "tenant-a", any_salt=False)
    'kvbridge:v2:8e85322260a1:80a707af:*'
    ```
    """
    if model_id is None:
        return f"{KEY_PREFIX}:v{FORMAT_VERSION}:*"
    tenant = "*" if any_salt and salt is None else salt_digest(salt)
    return f"{KEY_PREFIX}:v{FORMAT_VERSION}:{model_digest(model_id)}:{tenant}:*"


def as_token_list(token_ids: Any) -> list[int]:
    """Token ids as a list of ints: from a list or tuple, a 1-D tensor or array, or a `(1, seq)` batch of one."""
    if hasattr(token_ids, "tolist"):  # torch tensors, numpy arrays
        token_ids = token_ids.tolist()
    if isinstance(token_ids, list) and len(token_ids) == 1 and isinstance(token_ids[0], list):
        token_ids = token_ids[0]  # (1, seq)
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
        raise InvalidInputError(
            f"token ids must be a sequence of ints or a 1-D tensor, got {type(token_ids).__name__}"
        )
    return [int(t) for t in token_ids]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """A fixed encoding of token ids: unsigned 64-bit little-endian, whatever the platform."""
    try:
        return struct.pack(f"<{len(tokens)}Q", *tokens)
    except struct.error:
        raise InvalidInputError(
            f"token ids must be whole numbers in [0, 2**64), got one outside it among {list(tokens)[:8]}..."
        ) from None


def chain_root(model_id: str, salt: str | None = None) -> bytes:
    """The digest the chain of a model (and salt) starts from (node 0): format version, model identity, salt."""
    if not isinstance(model_id, str) or not model_id:
        raise InvalidInputError(f"model_id must be a non-empty string (see model_identity), got {model_id!r}")
    seed = json.dumps([KEY_PREFIX, FORMAT_VERSION, model_id, salt or None]).encode()
    return hashlib.blake2b(seed, digest_size=_CHAIN_BYTES).digest()


def _check_chunk_size(chunk_size: Any) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be a whole number of tokens ≥ 1, got {chunk_size!r}")


def _link(node: bytes, tokens: Sequence[int], kind: bytes = b"") -> bytes:
    """The digest of `tokens` following `node`: the next node for a whole chunk; with `kind` (`b"sub"`, `b"part"`)
    the digest of a sub-chunk or a remainder (domain-separated: never a whole chunk's)."""
    return hashlib.blake2b(kind + node + _token_bytes(tokens), digest_size=_CHAIN_BYTES).digest()


def key_prefix(model_id: str, salt: str | None = None) -> str:
    """`kvbridge:v2:<model digest>:<salt digest>:`, the start of every key of this model and tenant."""
    return f"{KEY_PREFIX}:v{FORMAT_VERSION}:{model_digest(model_id)}:{salt_digest(salt)}:"


@dataclass(frozen=True)
class TailKeys:
    """The keys of a trailing partial chunk: the tokens after a node, in sub-chunks and a remainder.

    Attributes:
        start (`int`): the absolute position of the first token after the node.
        sub_size (`int`): tokens per sub-chunk.
        subs (`list[str]`): one key per whole sub-chunk; sub-chunk `j` holds tokens `[start + j·sub_size, start +
            (j + 1)·sub_size)`.
        sub_nodes (`list[bytes]`): the chain digests after `0, 1, ...` sub-chunks (`sub_nodes[0]` is the node).
    """

    prefix: str
    start: int
    sub_size: int
    subs: list[str]
    sub_nodes: list[bytes]

    def remainders(self, sub: int, tokens: Sequence[int]) -> list[str]:
        """The key of each remainder after sub-chunk node `sub`: `tokens[:1]`, `tokens[:2]`, ... (the tokens that
        follow that node, fewer than `sub_size` of them): every length a reader probes; a writer writes the longest."""
        node = self.sub_nodes[sub]
        return [f"{self.prefix}{_link(node, tokens[:n], b'part').hex()}.part" for n in range(1, len(tokens) + 1)]


@dataclass(frozen=True)
class SequenceKeys:
    """The keys of one token sequence (`sequence_keys`): its whole chunks' keys and its chain nodes.

    Attributes:
        prefix (`str`): `key_prefix(model_id, salt)`.
        chunk_size (`int`): tokens per chunk.
        nodes (`list[bytes]`): the chain digests after `0, 1, ..., K` whole chunks (`K = len(tokens) // chunk_size`).
    """

    prefix: str
    chunk_size: int
    nodes: list[bytes]

    @property
    def chunks(self) -> list[str]:
        """The key of each whole chunk: chunk `i` stands for tokens `[0, (i + 1) * chunk_size)`."""
        return [self.prefix + node.hex() for node in self.nodes[1:]]

    def tail(self, node: int, tokens: Sequence[int]) -> TailKeys:
        """The sub-chunk keys of `tokens`, the tokens that follow node `node` (those of a partial chunk: at most
        `chunk_size - 1` of them are used)."""
        size = min(SUB_CHUNK_SIZE, self.chunk_size)
        tokens = list(tokens)[: self.chunk_size - 1]
        sub_nodes, subs = [self.nodes[node]], []
        for lo in range(0, len(tokens) - size + 1, size):
            sub_nodes.append(_link(sub_nodes[-1], tokens[lo : lo + size], b"sub"))
            subs.append(f"{self.prefix}{sub_nodes[-1].hex()}.sub")
        return TailKeys(self.prefix, node * self.chunk_size, size, subs, sub_nodes)


def sequence_keys(token_ids: Any, *, model_id: str, chunk_size: int, salt: str | None = None) -> SequenceKeys:
    """The chain of `token_ids`: one node per whole chunk (see `SequenceKeys`), from token 0.

    Example:

    ```python
    >>> seq = sequence_keys(list(range(600)), model_id="pocket-s", chunk_size=256)
    >>> tail = seq.tail(2, list(range(512, 600)))  # 88 tokens after the 2 whole chunks: 5 sub-chunks and 8 more
    >>> len(seq.chunks), len(tail.subs), len(tail.remainders(5, list(range(592, 600))))
    (2, 5, 8)
    ```
    """
    _check_chunk_size(chunk_size)
    tokens = as_token_list(token_ids)
    nodes = [chain_root(model_id, salt)]
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        nodes.append(_link(nodes[-1], tokens[start : start + chunk_size]))
    return SequenceKeys(key_prefix(model_id, salt), chunk_size, nodes)


def chunk_keys(token_ids: Any, *, model_id: str, chunk_size: int, salt: str | None = None) -> list[str]:
    """One store key per full chunk of `token_ids`, chained from token 0 (a trailing partial chunk's keys are its
    sub-chunks' and remainder's, see `SequenceKeys.tail`).

    Args:
        token_ids (list of `int`, or a 1-D tensor): the sequence from its first token.
        model_id (`str`): the identity of the model whose K/V the chunks hold (`model_identity`).
        chunk_size (`int`): tokens per chunk (`DEFAULT_CHUNK_SIZE`).
        salt (`str`, *optional*): the tenant's cache salt; sequences under different salts share no key.

    Returns:
        `list[str]`: `len(token_ids) // chunk_size` keys; key `i` stands for tokens `[0, (i + 1) * chunk_size)`.

    Example:

    ```python
    >>> keys = chunk_keys(list(range(600)), model_id="pocket-s", chunk_size=256)
    >>> len(keys), keys[0][:25]
    (2, 'kvbridge:v2:54748c083f53:')
    ```
    """
    return sequence_keys(token_ids, model_id=model_id, chunk_size=chunk_size, salt=salt).chunks


KEY_KINDS = ("chunk", "sub", "partial")
"""What a key holds: a whole chunk, a sub-chunk of a partial chunk, or a partial chunk's remainder."""


def parse_key(key: str) -> dict[str, str]:
    """The fields of a key this package wrote: `version`, `model` (digest), `salt` (digest or `"-"`), `chain` (the
    entry's digest) and `kind` (`"chunk"`, `"sub"` or `"partial"`).

    Raises `InvalidInputError` for anything else.
    """
    parts = key.split(":")
    if len(parts) != 5 or parts[0] != KEY_PREFIX or not parts[1].startswith("v"):
        raise InvalidInputError(
            f"{key!r} is not an hf_kvbridge store key (kvbridge:v2:<model>:<salt>:<chain>[.sub | .part])"
        )
    chain, _, suffix = parts[4].partition(".")
    kind = {"": "chunk", "sub": "sub", "part": "partial"}.get(suffix)
    if kind is None:
        raise InvalidInputError(f"{key!r} is not an hf_kvbridge store key: unknown suffix {suffix!r}")
    return {"version": parts[1][1:], "model": parts[2], "salt": parts[3], "chain": chain, "kind": kind}
