"""The KV store of warm-path serving (`hf_kvbridge.integrations.kv_store`) against a real Redis server.

The server is the installed `redis-server` (or `valkey-server`), started on 127.0.0.1 by the package's own
`start_local_server`; with neither installed these tests fail and say to install Debian's redis-server.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_save
from transformers import AutoConfig, DynamicCache, Qwen3Config

from hf_kvbridge import KVLayout, MissingDependencyError, ServingConfigError
from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.integrations.kv_store import (
    DEFAULT_CHUNK_SIZE,
    AsyncWriter,
    KVStore,
    LocalServer,
    PrefixKVStore,
    RedisKVStore,
    StoreFormatError,
    StoreMetrics,
    StoreMissError,
    StoreUnavailableError,
    chunk_bytes,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    load_cache,
    model_digest,
    model_identity,
    open_store,
    parse_key,
    save_cache,
    sequence_keys,
    start_local_server,
)
from hf_kvbridge.integrations.kv_store.format import CHUNK_VERSION
from hf_kvbridge.integrations.kv_store.local_server import free_port
from hf_kvbridge.integrations.kv_store.prefix import fetch_runs
from hf_kvbridge.integrations.kv_store.sizing import HEADER_BYTES_FIXED, HEADER_BYTES_PER_LAYER, TOKEN_ID_BYTES
from hf_kvbridge.pocket import model_path
from hf_kvbridge.utils.cache import append_layer, cache_kwargs, output_cache
from tests.conftest import VOCAB, qwen3, sigint_as_in_a_terminal

ROOT = Path(__file__).resolve().parents[3]
MODEL = "org/source@abc123"
KEY = re.compile(r"^kvbridge:v2:[0-9a-f]{12}:(?:[0-9a-f]{8}|-):[0-9a-f]{32}$")


@pytest.fixture(scope="module")
def server() -> LocalServer:
    try:
        server = start_local_server(maxmemory="256mb")
    except MissingDependencyError as err:  # fail, never skip: the store is part of what CI tests
        pytest.fail(f"{err}; e.g. `apt-get install -y redis-server` (the KV store tests need a real server)")
    yield server
    server.stop()


@pytest.fixture
def store(server) -> RedisKVStore:
    store = RedisKVStore(server.url, timeout=2.0)
    yield store
    store.close()


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _layers(shapes, tokens: int, dtype=torch.float32, seed: int = 0) -> tuple[list, list]:
    """Per layer random keys/values `(heads, tokens, dim)` of the given `(heads, dim)` shapes."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(h, tokens, d, generator=gen).to(dtype) for h, d in shapes]
    values = [torch.randn(h, tokens, d, generator=gen).to(dtype) for h, d in shapes]
    return keys, values


# ---- keys -------------------------------------------------------------------------------------------------------


def test_chunk_keys_are_deterministic_chained_and_cover_full_chunks_only():
    ids = _ids(16 * 5 + 7)
    keys = chunk_keys(ids, model_id=MODEL, chunk_size=16)
    assert len(keys) == 5 and all(KEY.match(k) for k in keys)  # the 7 trailing tokens have no key
    assert keys == chunk_keys(torch.tensor([ids]), model_id=MODEL, chunk_size=16)  # list, (1, seq) tensor: same
    assert len(set(keys)) == 5
    assert chunk_keys(ids[:15], model_id=MODEL, chunk_size=16) == []
    # a key stands for its whole prefix: the keys of a prefix are the leading keys of the sequence, whatever the
    # sequence was cut into (no engine block size enters)
    assert chunk_keys(ids[:48], model_id=MODEL, chunk_size=16) == keys[:3]
    assert chunk_keys(ids[:50], model_id=MODEL, chunk_size=16) == keys[:3]

    changed_first = [ids[0] + 1, *ids[1:]]
    assert not set(chunk_keys(changed_first, model_id=MODEL, chunk_size=16)) & set(keys)  # every key changes
    changed_chunk3 = list(ids)
    changed_chunk3[3 * 16 + 5] += 1
    other = chunk_keys(changed_chunk3, model_id=MODEL, chunk_size=16)
    assert other[:3] == keys[:3] and not set(other[3:]) & set(keys)

    for kwargs in ({"model_id": MODEL + "x"}, {"model_id": MODEL, "salt": "tenant-a"}):
        moved = chunk_keys(ids, chunk_size=16, **kwargs)
        assert not set(moved) & set(keys)
    salted = chunk_keys(ids, model_id=MODEL, chunk_size=16, salt="tenant-a")
    assert not set(chunk_keys(ids, model_id=MODEL, chunk_size=16, salt="tenant-b")) & set(salted)
    assert chunk_keys(ids, model_id=MODEL, chunk_size=16, salt="") == keys  # an empty salt is no salt
    assert not set(chunk_keys(ids, model_id=MODEL, chunk_size=32)) & set(keys)  # writers and readers must agree

    # the model's and the salt's digests are readable in every key (SCAN per model or tenant)
    assert len({k.split(":")[2] for k in keys + salted}) == 1
    assert {k.split(":")[3] for k in keys} == {"-"} and len({k.split(":")[3] for k in salted}) == 1
    assert salted[0].split(":")[3] != "-"


def test_chunk_keys_refuse_bad_arguments():
    with pytest.raises(InvalidInputError, match="chunk_size must be a whole number of tokens ≥ 1, got 0"):
        chunk_keys([1, 2], model_id=MODEL, chunk_size=0)
    with pytest.raises(InvalidInputError, match="model_id must be a non-empty string"):
        chunk_keys([1, 2], model_id="", chunk_size=1)
    with pytest.raises(InvalidInputError, match=r"token ids must be whole numbers in \[0, 2\*\*64\)"):
        chunk_keys([-1], model_id=MODEL, chunk_size=1)


def test_sequence_keys_chain_a_partial_chunk_in_sub_chunks_and_a_remainder():
    ids = _ids(16 * 3 + 37)
    seq = sequence_keys(ids, model_id=MODEL, chunk_size=16)
    assert seq.chunks == chunk_keys(ids, model_id=MODEL, chunk_size=16) and len(seq.nodes) == len(ids) // 16 + 1
    long = sequence_keys(_ids(300), model_id=MODEL, chunk_size=256)
    tail = long.tail(1, _ids(300)[256:])  # 44 tokens after the whole chunk: 2 sub-chunks of 16, then 12
    assert len(tail.subs) == 2 and all(parse_key(k)["kind"] == "sub" for k in tail.subs)
    remainders = tail.remainders(2, _ids(300)[288:])
    assert len(remainders) == 12 and all(parse_key(k)["kind"] == "partial" for k in remainders)
    assert len(set(remainders)) == 12  # every length its own key
    # content-addressed: a sequence sharing the first 20 tokens of the tail shares its first sub-chunk, not the second
    other = _ids(300)[:276] + [1, 2, 3] + _ids(300)[279:]
    other_tail = sequence_keys(other, model_id=MODEL, chunk_size=256).tail(1, other[256:])
    assert other_tail.subs[0] == tail.subs[0] and other_tail.subs[1] != tail.subs[1]
    assert not set(tail.subs) & set(long.chunks)  # never a whole chunk's key
    with pytest.raises(InvalidInputError, match="unknown suffix"):
        parse_key(seq.chunks[0] + ".bogus")


def test_model_identity_names_the_model_revision_and_layout():
    layout = KVLayout.from_config(qwen3().config).fingerprint()
    identity = model_identity("org/m", "abc123", layout)
    assert identity.startswith("org/m@abc123#layout=")
    assert identity == model_identity("org/m", "abc123", layout)
    other_layout = KVLayout.from_config(qwen3(layers=3).config).fingerprint()
    assert model_identity("org/m", "abc123", other_layout) != identity
    assert model_identity("org/m") == "org/m"


# ---- chunk format -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_round_trip_is_exact_with_layers_of_different_shapes(dtype):
    keys, values = _layers([(2, 16), (4, 8), (1, 32)], tokens=8, dtype=dtype)
    payload = encode_chunk(keys, values, model_id=MODEL, start=256, token_ids=range(8))
    got_k, got_v = decode_chunk(payload, model_id=MODEL, start=256, token_ids=[0, 1, 2])
    for want, got in zip(keys + values, got_k + got_v, strict=True):
        assert got.dtype == dtype and got.device.type == "cpu" and torch.equal(got, want)
    assert decode_chunk(payload, model_id=MODEL)[0][0].equal(keys[0])  # start unchecked when not given


def test_encode_takes_views_and_tensors_sharing_memory():
    kv = torch.randn(2, 3, 40, 16)  # (k/v, heads, tokens, dim), as one buffer
    keys, values = [kv[0, :, 8:24]], [kv[1, :, 8:24]]  # non-contiguous slices of one storage
    payload = encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(16))
    got_k, got_v = decode_chunk(payload, model_id=MODEL, start=0)
    assert torch.equal(got_k[0], keys[0]) and torch.equal(got_v[0], values[0])
    same = torch.randn(2, 4, 8)
    got_k, got_v = decode_chunk(
        encode_chunk([same], [same], model_id=MODEL, start=0, token_ids=range(4)), model_id=MODEL
    )
    assert torch.equal(got_k[0], same) and torch.equal(got_v[0], same)


def _resave(payload: bytes, *, metadata_changes: dict | None = None, tensor_changes: dict | None = None) -> bytes:
    """`payload` rewritten as safetensors with some metadata fields or tensors replaced (None removes one)."""
    from safetensors.torch import load

    from hf_kvbridge.integrations.kv_store import read_metadata

    metadata = {**read_metadata(payload), **(metadata_changes or {})}
    tensors = {**load(payload), **(tensor_changes or {})}
    return safetensors_save({k: v for k, v in tensors.items() if v is not None},
                            metadata={k: v for k, v in metadata.items() if v is not None})  # fmt: skip


def test_decode_refuses_what_is_not_this_chunk():
    keys, values = _layers([(2, 16), (2, 16)], tokens=8)
    good = encode_chunk(keys, values, model_id=MODEL, start=16, token_ids=range(100, 108))
    flipped = bytearray(good)
    flipped[-3] ^= 0xFF  # one byte of the last tensor
    cases = [
        (b"", "too short to be a chunk"),
        (good[: len(good) // 2], "truncated"),
        (good + b"\0", "trailing bytes"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", "header is not JSON"),
        (safetensors_save({"x": torch.zeros(2)}), "not an hf_kvbridge K/V chunk"),
        (_resave(good, metadata_changes={"format": "lmcache"}), r"format 'lmcache'"),
        (_resave(good, metadata_changes={"version": str(CHUNK_VERSION + 1)}), "upgrade hf_kvbridge"),
        (_resave(good, metadata_changes={"encoding": "cachegen"}), "encoding 'cachegen'.*a miss"),
        (_resave(good, metadata_changes={"version": "0"}), "re-export the prompt"),
        (_resave(good, metadata_changes={"start": None}), "lacks start/tokens/layers"),
        (_resave(good, tensor_changes={"layers.1.values": torch.zeros(2, 7, 16)}), r"layer 1 has keys"),
        (_resave(good, tensor_changes={"layers.1.values": None}), "do not match its 2 layers"),
        (_resave(good, metadata_changes={"layers": "3"}), "do not match its 3 layers"),
        (_resave(good, tensor_changes={"token_ids": torch.arange(7)}), r"token ids are \(7,\)"),
        (_resave(good, tensor_changes={"token_ids": None}), "do not match its 2 layers"),
        (bytes(flipped), "checksum"),
    ]
    for payload, message in cases:
        with pytest.raises(StoreFormatError, match=message):
            decode_chunk(payload, model_id=MODEL, start=16)
    with pytest.raises(StoreFormatError, match=r"holds K/V of model 'org/source@abc123', not 'org/other'"):
        decode_chunk(good, model_id="org/other", start=16)
    with pytest.raises(StoreFormatError, match="starts at token 16, expected 32"):
        decode_chunk(good, model_id=MODEL, start=32)
    with pytest.raises(StoreFormatError, match="is bytes, got str"):
        decode_chunk("text", model_id=MODEL)
    # a reader names the tokens it takes: a chunk of other tokens (a branch's, or replaced) is never used
    assert decode_chunk(good, model_id=MODEL, start=16, token_ids=[100, 101])[0][0].equal(keys[0])
    for wanted in ([100, 999], list(range(100, 109))):
        with pytest.raises(StoreFormatError, match="holds other tokens"):
            decode_chunk(good, model_id=MODEL, start=16, token_ids=wanted)


def test_encode_refuses_inconsistent_layers():
    keys, values = _layers([(2, 16), (2, 16)], tokens=8)
    with pytest.raises(InvalidInputError, match="same ≥ 1 layers, got 2 and 1"):
        encode_chunk(keys, values[:1], model_id=MODEL, start=0, token_ids=range(8))
    with pytest.raises(InvalidInputError, match=r"layer 1: keys \(2, 4, 16\)"):
        encode_chunk(
            [keys[0], keys[1][:, :4]], [values[0], values[1][:, :4]], model_id=MODEL, start=0, token_ids=range(8)
        )
    with pytest.raises(InvalidInputError, match="7 token ids for K/V of 8 tokens"):
        encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(7))


def test_chunk_bytes_counts_what_a_stored_chunk_holds():
    pocket = AutoConfig.from_pretrained(model_path("pocket-s"))
    layout = KVLayout.from_config(pocket)
    payload = encode_chunk(
        *_layers([(layout.num_kv_heads, layout.head_dim)] * layout.num_layers, tokens=64, dtype=torch.bfloat16),
        model_id=model_identity("pocket-s", None, layout.fingerprint()),
        start=0,
        token_ids=range(64),
    )
    raw = chunk_bytes(pocket, 64, torch.bfloat16)
    assert raw == layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 64 * 2
    ids = TOKEN_ID_BYTES * 64
    assert raw + ids < len(payload) <= raw + ids + HEADER_BYTES_FIXED + HEADER_BYTES_PER_LAYER * layout.num_layers
    qwen3_14b = Qwen3Config(num_hidden_layers=40, num_key_value_heads=8, head_dim=128)
    assert chunk_bytes(qwen3_14b, 1, "bfloat16") == 40 * 2 * 8 * 128 * 2
    zeros = [torch.zeros(8, 256, 128, dtype=torch.bfloat16)] * 40  # a Qwen3-14B chunk: 40 MiB, offsets of 8 digits
    payload = encode_chunk(zeros, zeros, model_id="Qwen/Qwen3-14B@" + "f" * 40, start=10**6, token_ids=range(256))
    raw = chunk_bytes(qwen3_14b, 256, torch.bfloat16)
    ids = TOKEN_ID_BYTES * 256
    assert raw + ids < len(payload) <= raw + ids + HEADER_BYTES_FIXED + HEADER_BYTES_PER_LAYER * 40
    bf16 = chunk_bytes(layout, DEFAULT_CHUNK_SIZE, "bfloat16")
    assert chunk_bytes(layout, DEFAULT_CHUNK_SIZE, torch.float32) == 2 * bf16
    with pytest.raises(InvalidInputError, match="not a torch dtype"):
        chunk_bytes(layout, 1, "float99")


# ---- the Redis store --------------------------------------------------------------------------------------------


def test_redis_store_counts_prefix_puts_and_gets(store):
    keys = chunk_keys(_ids(64, seed=1), model_id=MODEL, chunk_size=16)
    assert isinstance(store, KVStore)
    before = store.metrics.as_dict()
    assert store.count_prefix(keys) == 0 and store.count_prefix([]) == 0
    store.put_many({keys[0]: b"zero", keys[1]: b"one!", keys[3]: b"three"})
    assert store.count_prefix(keys) == 2  # leading keys only: key 2 is missing
    assert store.exists_many(keys) == [True, True, False, True]
    assert store.get_many(keys) == [b"zero", b"one!", None, b"three"]
    after = store.metrics.as_dict()
    assert after["chunks_written"] - before["chunks_written"] == 3
    assert after["bytes_written"] - before["bytes_written"] == 13
    assert after["chunks_read"] - before["chunks_read"] == 3 and after["bytes_read"] - before["bytes_read"] == 13
    assert after["fetch_seconds"] > before["fetch_seconds"] and after["put_seconds"] > before["put_seconds"]
    assert store.delete_many(keys) == 3


def test_valkey_schemes_are_aliases_and_unknown_schemes_are_refused(server):
    with open_store(server.url.replace("redis://", "valkey://")) as store:
        store.ping()
    with pytest.raises(ServingConfigError, match=r"unknown KV store URL 'lmcache://host/0'.*redis://HOST:PORT/DB"):
        open_store("lmcache://host/0")
    with pytest.raises(ServingConfigError, match="ttl_s must be a number of seconds > 0"):
        RedisKVStore(server.url, ttl_s=0)


def test_tls_and_unix_socket_urls_are_passed_to_the_client(tmp_path):
    port = free_port()
    tls = open_store(f"rediss://:secret@127.0.0.1:{port}/0", ssl_cert_reqs="none", timeout=0.5)
    with tls, pytest.raises(StoreUnavailableError, match=rf"KV store rediss://127.0.0.1:{port}/0: lookup .* failed"):
        tls.count_prefix(["kvbridge:v2:x"])
    sock = tmp_path / "none.sock"
    with open_store(f"unix://{sock}?db=0", timeout=0.5) as unix, pytest.raises(StoreUnavailableError):
        unix.get_many(["kvbridge:v2:x"])
    with pytest.raises(ServingConfigError, match="the redis client refuses its settings"):
        open_store(f"redis://127.0.0.1:{port}/0", no_such_option=1)


def test_ttl_expires_chunks(server):
    with RedisKVStore(server.url, ttl_s=0.3) as store:
        store.put_many({"kvbridge:v2:ttl-test": b"x"})
        assert store.count_prefix(["kvbridge:v2:ttl-test"]) == 1
        deadline = time.monotonic() + 5
        while store.count_prefix(["kvbridge:v2:ttl-test"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get_many(["kvbridge:v2:ttl-test"]) == [None]


def test_password_is_passed_through_and_never_shown():
    password = 'p@ss:w"rd'  # URL-quoted in the URL, quoted in the server's config
    with start_local_server(maxmemory="16mb", password=password) as secured:
        with open_store(secured.url) as store:
            store.put_many({"kvbridge:v2:auth": b"ok"})
            assert store.get_many(["kvbridge:v2:auth"]) == [b"ok"]
        wrong = secured.url.replace("p%40ss", "nope")
        for url in (wrong, f"redis://127.0.0.1:{secured.port}/0"):
            with open_store(url, timeout=1.0) as store, pytest.raises(StoreUnavailableError) as info:
                store.count_prefix(["kvbridge:v2:auth"])
            message = str(info.value)
            assert "refused the credentials" in message and 'w"rd' not in message and "nope" not in message
            assert f"redis://127.0.0.1:{secured.port}/0" in message  # the URL, without the password
            assert store.metrics.read_errors == 1
        with open_store(f"redis://127.0.0.1:{secured.port}/0", password=password) as store:  # keyword form
            assert store.get_many(["kvbridge:v2:auth"]) == [b"ok"]


def test_a_stopped_server_fails_fast_with_store_unavailable():
    doomed = start_local_server(maxmemory="16mb")
    store = open_store(doomed.url, timeout=0.5)
    store.warm_up()  # connects both clients
    store.put_many({"kvbridge:v2:gone": b"x"})
    doomed.stop()
    assert not doomed.running
    begin = time.monotonic()
    for call in (lambda: store.count_prefix(["kvbridge:v2:gone"]), lambda: store.get_many(["kvbridge:v2:gone"]),
                 lambda: store.put_many({"kvbridge:v2:gone": b"y"})):  # fmt: skip
        with pytest.raises(StoreUnavailableError, match=rf"KV store redis://127.0.0.1:{doomed.port}/0: .* failed"):
            call()
    assert time.monotonic() - begin < 5
    assert store.metrics.read_errors == 2 and store.metrics.write_errors == 1
    with pytest.raises(StoreUnavailableError):
        store.warm_up()
    store.close()


def test_a_hung_server_costs_one_deadline_then_is_skipped_until_it_answers_again():
    hung = start_local_server(maxmemory="16mb")
    store = open_store(hung.url, timeout=0.05, cooldown_s=0.5)
    prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=4)
    ids = _ids(10)
    store.put_many({prefix.keys(ids)[0]: b"x"})
    os.kill(hung.pid, signal.SIGSTOP)  # the process is there and its socket accepts, but nothing answers
    try:
        begin = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="no answer within 50 ms .*hung"):
            prefix.lookup(ids)
        first = time.monotonic() - begin
        begin = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="not sent: .* failed less than 0.5 s ago"):
            prefix.lookup(ids)
        second = time.monotonic() - begin
        assert first < 0.5 and second < 0.05, (first, second)  # one deadline, then not asked at all
        assert store.metrics.timeouts == 1 and store.metrics.skipped_down == 1
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    time.sleep(0.6)
    assert prefix.lookup(ids).chunks == 1  # after the cool-down it is asked again, and answers
    store.close()
    hung.stop()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate whose subjectAltName names 127.0.0.1, and its key (made with openssl)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=kvbridge-test", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@torch.no_grad()
def test_a_tls_server_with_a_password_serves_a_cache(certificate, model):
    cert, key = certificate
    with start_local_server(maxmemory="16mb", tls=(cert, key), password="tls-secret") as server:
        assert server.url.startswith("rediss://")
        ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(13))
        cache, _ = _prefill(model, ids)
        # the client checks the server's certificate against it, and that it names 127.0.0.1
        with open_store(server.url, ssl_ca_certs=cert, timeout=2.0) as store:
            prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=16)
            save_cache(prefix, ids, cache)
            loaded = load_cache(prefix, ids, prefix.lookup(ids).tokens)
            assert torch.equal(loaded.layers[0].keys, cache.layers[0].keys)
        with open_store(server.url, timeout=2.0) as store:  # the system's CAs do not know this certificate
            with pytest.raises(StoreUnavailableError, match="(?i)certificate verify failed"):
                store.ping()
        with open_store(server.url.replace("rediss://", "redis://"), timeout=1.0) as store:
            with pytest.raises(StoreUnavailableError, match="TLS matches"):  # plain text to a TLS port
                store.ping()


def test_an_acl_user_is_let_in_and_no_one_else():
    config = ["user default off", "user kvb on >kvb-secret ~kvbridge:* +@all"]  # only kvb, only the package's keys
    with start_local_server(maxmemory="16mb", extra_config=config) as server:
        url = f"redis://kvb:kvb-secret@127.0.0.1:{server.port}/0"
        with open_store(url, timeout=2.0) as store:
            (key,) = chunk_keys(_ids(4), model_id=MODEL, chunk_size=4)
            store.put_many({key: b"ok"})
            assert store.get_many([key]) == [b"ok"] and store.stats()["keys"] == 1
            with pytest.raises(StoreUnavailableError, match="refused the credentials.*ACL"):
                store.put_many({"elsewhere": b"x"})  # a key outside the user's pattern (NOPERM)
        for bad in (url.replace("kvb-secret", "wrong"), f"redis://127.0.0.1:{server.port}/0"):
            with open_store(bad, timeout=1.0) as store, pytest.raises(StoreUnavailableError) as info:
                store.ping()
            assert "refused the credentials" in str(info.value) and "kvb-secret" not in str(info.value)


def test_the_server_evicts_least_recently_used_chunks_when_full():
    with start_local_server(maxmemory="4mb") as small, open_store(small.url) as store:
        chunk = os.urandom(256 << 10)
        keys = chunk_keys(_ids(40 * 4, seed=3), model_id=MODEL, chunk_size=4)
        for key in keys:  # 10 MB into 4 MB: no OOM error, older chunks go
            store.put_many({key: chunk})
        present = store.exists_many(keys)
        assert 0 < sum(present) < len(keys) and present[-1]
        stats = store.stats()
        assert stats["maxmemory_policy"] == "allkeys-lru" and stats["maxmemory"] == 4 << 20
        assert stats["keys"] == sum(present) and stats["bytes"] >= sum(present) * len(chunk)
        store._bulk.config_set("maxmemory-policy", "noeviction")  # a server set up without eviction
        with pytest.raises(StoreUnavailableError, match="full and does not evict.*allkeys-lru") as info:
            for key in keys:
                store.put_many({key + "x": chunk})
        assert len(str(info.value)) < 600  # the pipeline's error quotes the payload: it is cut out


def test_start_local_server_refuses_a_missing_binary_and_bad_sizes():
    with pytest.raises(MissingDependencyError, match="'no-such-redis-server' not found"):
        start_local_server(binary="no-such-redis-server")
    with pytest.raises(InvalidInputError, match="maxmemory must be a size such as 512mb"):
        start_local_server(maxmemory="lots")


# ---- the asynchronous writer ------------------------------------------------------------------------------------


def test_async_writer_writes_after_flush(store):
    keys = chunk_keys(_ids(48, seed=4), model_id=MODEL, chunk_size=16)
    with AsyncWriter(store) as writer:
        assert writer.submit(keys[0], b"bytes")
        assert writer.submit(keys[1], lambda: b"encoded on the writer thread", nbytes=28)
        assert writer.flush(timeout=10)
        assert store.get_many(keys[:2]) == [b"bytes", b"encoded on the writer thread"]
        assert writer.pending_bytes == 0
    assert not writer.submit(keys[2], b"after close")  # closed: dropped
    store.delete_many(keys)


def test_async_writer_drops_instead_of_blocking_when_full(store):
    keys = chunk_keys(_ids(64, seed=5), model_id=MODEL, chunk_size=16)
    release = threading.Event()

    def slow() -> bytes:  # holds the writer thread, as a slow store would
        release.wait(10)
        return b"slow"

    before = store.metrics.writes_dropped
    with AsyncWriter(store, max_pending_bytes=1000) as writer:
        assert writer.submit(keys[0], slow, nbytes=10)
        assert writer.submit(keys[1], b"a" * 600)
        begin = time.monotonic()
        assert not writer.submit(keys[2], b"b" * 600)  # 1,210 bytes > 1,000: dropped at once
        assert not writer.submit(keys[3], lambda: b"c", nbytes=500)
        assert time.monotonic() - begin < 0.5
        assert store.metrics.writes_dropped - before == 2
        release.set()
        assert writer.flush(timeout=10)
    assert store.exists_many(keys) == [True, True, False, False]
    store.delete_many(keys)


def test_async_writer_counts_errors_of_a_dead_server_and_never_raises(caplog):
    dead = open_store(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    with caplog.at_level(logging.DEBUG, logger="hf_kvbridge.integrations.kv_store.writer"):
        with AsyncWriter(dead) as writer:
            for burst in range(2):
                for index in range(3):
                    assert writer.submit(f"kvbridge:v2:dead:{burst}:{index}", b"x")
                assert writer.flush(timeout=10)
            assert writer.submit("kvbridge:v2:dead:bad", lambda: 1 / 0, nbytes=1)  # an encoding error
            assert writer.flush(timeout=10)
    assert dead.metrics.write_errors == 7 and dead.metrics.chunks_written == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not written" in warnings[0].getMessage()  # once per run of failures


# ---- prefixes of a real model's cache ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return qwen3(layers=2)


def _prefill(model, ids: torch.Tensor, cache=None):
    """`(cache, logits)` of the model's forward pass over `ids`, continuing `cache` if given."""
    out = model(ids, use_cache=True, **cache_kwargs(cache if cache is not None else DynamicCache()))
    return output_cache(out), out.logits


def _model_id(model) -> str:
    return model_identity("tests/qwen3-tiny", None, KVLayout.from_config(model.config).fingerprint())


@torch.no_grad()
def test_saved_cache_loads_back_exactly_and_the_model_continues_from_it(store, model):
    ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(6))
    full, logits = _prefill(model, ids)
    cache, _ = _prefill(model, ids[:, :100])  # a prompt of 100 tokens: 6 whole chunks of 16 and 4 tokens
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=16)
    assert prefix.stored_tokens(ids[:, :100]) == 0
    assert save_cache(prefix, ids[:, :100], cache) == 6  # and the partial chunk of tokens [96, 100)
    found = prefix.lookup(ids[:, :100])
    assert (found.tokens, found.chunks, found.tail_tokens, found.round_trips) == (100, 6, 4, 1)  # the whole prompt
    loaded = load_cache(prefix, ids[:, :100], 100, stored=found)
    for layer in range(2):
        assert torch.equal(loaded.layers[layer].keys, cache.layers[layer].keys)
        assert torch.equal(loaded.layers[layer].values, cache.layers[layer].values)
    # a longer prompt (the next turn) finds the same 100 tokens (two round trips: its whole chunks stop at node 6,
    # before its last node 7) and the model continues from them at position 100
    found = prefix.lookup(ids)
    assert (found.tokens, found.chunks, found.round_trips) == (100, 6, 3)  # the tail after chunk 6 in two more
    _, continued = _prefill(model, ids[:, 100:], load_cache(prefix, ids, 100, stored=found))
    torch.testing.assert_close(continued, logits[:, 100:])
    assert prefix.stored_tokens(ids, salt="tenant-b") == 0  # another tenant sees nothing
    metrics = prefix.metrics.as_dict()
    assert metrics["lookups"] >= 4 and metrics["lookup_miss"] >= 2 and metrics["lookup_tail_tokens"] >= 8
    del full


@torch.no_grad()
def test_a_partial_chunk_is_taken_only_as_far_as_it_is_the_readers_own_prefix(store, model):
    ids = torch.randint(0, VOCAB, (1, 140), generator=torch.Generator().manual_seed(11))
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=64)  # sub-chunks of 16
    cache, _ = _prefill(model, ids)
    save_cache(prefix, ids, cache)  # 2 whole chunks, then 12 tokens: no sub-chunk, a remainder of 12
    found = prefix.lookup(ids)
    assert (found.tokens, found.chunks, found.tail_tokens, found.round_trips) == (140, 2, 12, 1)
    many = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(14))
    many_cache, _ = _prefill(model, many)
    save_cache(prefix, many, many_cache)  # 1 whole chunk, 2 sub-chunks (96), a remainder of 4
    # a remainder is found by a reader that has all of its tokens; one that ends inside it stops at the sub-chunk
    assert prefix.lookup(many).tokens == 100 and prefix.lookup(many[:, :98]).tokens == 96
    branch = many.clone()
    branch[0, 90] = (branch[0, 90] + 1) % VOCAB  # branches inside the second sub-chunk
    found = prefix.lookup(branch)
    assert (found.tokens, found.tail_tokens) == (80, 16)  # the sub-chunk it shares, not the one it does not
    loaded = load_cache(prefix, branch, 80, stored=found)
    own, _ = _prefill(model, branch[:, :80])
    for layer in range(2):  # the stored K/V of the 80 tokens it shares, which are its own
        assert torch.equal(loaded.layers[layer].keys, many_cache.layers[layer].keys[:, :, :80])
        torch.testing.assert_close(loaded.layers[layer].keys, own.layers[layer].keys)
    longer = torch.cat([many, ids[:, :30]], dim=1)  # a longer prompt (the next turn): all that is stored of it
    found = prefix.lookup(longer)
    assert (found.tokens, found.round_trips) == (100, 3)  # its whole chunks stop early: then sub-chunks, remainders
    with pytest.raises(StoreMissError, match="holds 100 tokens of this sequence"):
        prefix.load(longer, 101)
    # two short prompts (no whole chunk: they share only the chain's root) are both found whole
    short_a, short_b = ids[:, :40], many[:, :50]
    for short in (short_a, short_b):
        save_cache(prefix, short, _prefill(model, short)[0])
    assert prefix.lookup(short_a).tokens == 40 and prefix.lookup(short_b).tokens == 50


@torch.no_grad()
def test_every_turn_of_a_growing_conversation_is_found_whole(store, model):
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(12))
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=64)
    full, _ = _prefill(model, ids)
    kv = [(layer.keys[0], layer.values[0]) for layer in full.layers]  # per layer (H, 150, d)
    done = 0
    for end in (40, 58, 71, 150):  # each turn exports what it added, from its first whole chunk not yet stored
        start = done // 64 * 64
        keys, values = [k[:, start:end] for k, _ in kv], [v[:, start:end] for _, v in kv]
        assert prefix.save(ids[:, :end], keys, values, start=start) == end // 64 - start // 64
        done = end
    # every turn's prompt is found whole; a prefix no turn ended at finds what earlier turns left before it (71): the
    # later turn's whole chunk [64, 128) is keyed by tokens a 100-token reader does not have
    for n in (40, 58, 71, 150, 100):
        found = prefix.lookup(ids[:, :n])
        assert found.tokens == (71 if n == 100 else n), n
        loaded = load_cache(prefix, ids[:, :n], found.tokens, stored=found)
        assert torch.equal(loaded.layers[1].values, full.layers[1].values[:, :, : found.tokens])
    by_model = store.stats(_model_id(model))["by_model"][model_digest(_model_id(model))]
    assert by_model["subs"] >= 2 and by_model["partials"] >= 4  # earlier turns' partial chunks stay findable


@torch.no_grad()
def test_iter_load_yields_runs_that_join_into_the_load_and_stops_at_a_missing_run(store, model):
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(15))
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=16)
    cache, _ = _prefill(model, ids)
    save_cache(prefix, ids, cache)  # 9 whole chunks and a remainder of 6: 10 entries
    found = prefix.lookup(ids)
    runs = list(prefix.iter_load(ids, 150, stored=found, start=20, parts=4))
    # 9 entries from token 20, in runs of about equal bytes: 2, 2, 2 whole chunks and 2 with the remainder
    assert [(run.start, run.end) for run in runs] == [(20, 48), (48, 80), (80, 112), (112, 150)]
    assert all(run.seconds > 0 for run in runs)
    keys, _ = prefix.load(ids, 150, stored=found)
    for layer in range(2):  # the runs, joined, are the load from token 20 on: the model's own K/V
        joined = torch.cat([run.keys[layer] for run in runs], dim=1)
        assert torch.equal(joined, keys[layer][:, 20:]) and torch.equal(keys[layer], cache.layers[layer].keys[0])
    store.delete_many([found.pieces[5][0]])  # evicted: the run that holds tokens [80, 96) fails, the first not
    iterator = prefix.iter_load(ids, 150, stored=found, parts=3)  # runs of 3, 3 and 4 entries (3 whole chunks each)
    assert next(iterator).end == 48
    with pytest.raises(StoreMissError, match=r"tokens \[80, 96\)"):
        next(iterator)


@torch.no_grad()
def test_fetch_runs_balance_bytes_not_entries():
    """A whole chunk outweighs a partial chunk's sub-chunks: runs of equal counts would fetch most bytes first."""
    whole = [(f"w{i}", 256 * i, 256 * (i + 1), 256) for i in range(3)]  # 3 whole chunks of 256 tokens
    subs = [(f"s{j}", 768 + 16 * j, 784 + 16 * j, 16) for j in range(14)]  # 14 sub-chunks of a partial chunk
    runs = fetch_runs([*whole, *subs, ("r", 992, 1000, 8)], 4)
    assert [len(run) for run in runs] == [1, 1, 1, 15]
    assert [p for run in runs for p in run] == [*whole, *subs, ("r", 992, 1000, 8)]  # in order, each piece once
    assert fetch_runs(whole, 8) == [[p] for p in whole] and fetch_runs([], 4) == []


@torch.no_grad()
def test_a_longer_sequence_saves_only_its_new_chunks(store, model):
    ids = torch.randint(0, VOCAB, (1, 160), generator=torch.Generator().manual_seed(7))
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=16)
    first, _ = _prefill(model, ids[:, :64])
    assert save_cache(prefix, ids[:, :64], first) == 4
    # as an engine with a prefix-cache hit: it computes the new tokens only, on the cache of the stored prefix
    cache, _ = _prefill(model, ids[:, 64:], load_cache(prefix, ids, prefix.stored_tokens(ids)))
    written = store.metrics.chunks_written
    new_keys = [layer.keys[0, :, 64:] for layer in cache.layers]  # (H, 96, d): tokens [64, 160)
    new_values = [layer.values[0, :, 64:] for layer in cache.layers]
    assert prefix.save(ids, new_keys, new_values, start=64) == 6
    assert store.metrics.chunks_written - written == 6
    assert prefix.stored_tokens(ids) == 160
    written = store.metrics.chunks_written
    assert save_cache(prefix, ids, cache) == 0  # everything stored: nothing rewritten
    assert store.metrics.chunks_written == written
    full, _ = _prefill(model, ids)
    loaded = load_cache(prefix, ids, 160)
    for layer in range(2):  # chunks written by two passes join into the model's own cache of the whole sequence
        torch.testing.assert_close(loaded.layers[layer].keys, full.layers[layer].keys)
    with pytest.raises(InvalidInputError, match="start must be a multiple of chunk_size=16"):
        prefix.save(ids, new_keys, new_values, start=60)


@torch.no_grad()
def test_an_evicted_or_corrupt_chunk_stops_the_prefix_or_refuses_the_load(store, model):
    ids = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(8))
    prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=16)
    cache, _ = _prefill(model, ids)
    assert save_cache(prefix, ids, cache) == 8
    keys = prefix.keys(ids)
    store.delete_many([keys[3]])  # as the server's eviction would
    assert prefix.stored_tokens(ids) == 48
    with pytest.raises(StoreMissError, match=r"chunk of tokens \[48, 64\).*evicted or expired"):
        prefix.load(ids, 128)
    assert prefix.load(ids, 48)[0][0].shape == (2, 48, 16)
    chunk_two = store.get_many([keys[2]])[0]
    store.put_many({keys[1]: chunk_two})  # another chunk's bytes under this key
    with pytest.raises(StoreFormatError, match=r"chunk of tokens \[16, 32\).*starts at token 32, expected 16"):
        prefix.load(ids, 48)
    store.put_many({keys[1]: os.urandom(2048)})
    with pytest.raises(StoreFormatError, match=r"chunk of tokens \[16, 32\)"):
        load_cache(prefix, ids, 48)
    other_model = PrefixKVStore(store, model_id=_model_id(model) + "-other", chunk_size=16)
    assert other_model.stored_tokens(ids) == 0


@torch.no_grad()
def test_a_bfloat16_source_and_a_float32_target_share_chunks_through_the_writer(store, model):
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(9))
    cache, _ = _prefill(model, ids)
    bf16 = DynamicCache()
    for index, layer in enumerate(cache.layers):  # a bfloat16 engine's cache of the same prefill
        append_layer(bf16, index, layer.keys.bfloat16(), layer.values.bfloat16())
    with AsyncWriter(store) as writer:
        prefix = PrefixKVStore(store, model_id=_model_id(model), chunk_size=32, writer=writer)
        assert save_cache(prefix, ids, bf16, salt="tenant-a") == 2
        assert writer.flush(timeout=10)
    assert prefix.stored_tokens(ids, salt="tenant-a") == 64
    loaded = load_cache(prefix, ids, 64, salt="tenant-a", dtype=torch.float32)
    for layer in range(2):
        assert loaded.layers[layer].keys.dtype == torch.float32
        assert torch.equal(loaded.layers[layer].keys, bf16.layers[layer].keys.float())
    with pytest.raises(InvalidInputError, match="cache layer 0 holds 64 tokens but token_ids has 63"):
        save_cache(prefix, ids[:, :63], cache)
    part = load_cache(prefix, ids, 40, salt="tenant-a")  # inside a whole chunk: its first tokens
    assert torch.equal(part.layers[0].keys, bf16.layers[0].keys[:, :, :40])
    with pytest.raises(InvalidInputError, match=r"num_tokens must be a number of tokens in \[1, 64\]"):
        prefix.load(ids, 65)


def test_store_metrics_are_thread_safe():
    metrics = StoreMetrics()

    def add():
        for _ in range(2000):
            metrics.add(chunks_written=1, bytes_written=3)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert metrics.as_dict()["chunks_written"] == 8000 and metrics.bytes_written == 24000


# ---- the command line -------------------------------------------------------------------------------------------


def test_store_help_parses_without_torch(tmp_path):
    from tests.test_startup import _cli, _heavy

    proc, loaded = _cli(tmp_path, "store", "--help")
    assert proc.returncode == 0 and "serve" in proc.stdout and "stats" in proc.stdout
    assert _heavy(loaded) == []
    proc, loaded = _cli(tmp_path, "store", "serve", "--maxmemory", "lots")
    assert proc.returncode == 2 and "not a size such as 512mb" in proc.stderr and _heavy(loaded) == []


def test_store_stats_of_an_unreachable_store_is_one_line(capsys):
    from kvbridge_cli import main

    assert main(["store", "stats", "redis://127.0.0.1:1", "--socket-timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "KV store redis://127.0.0.1:1" in err and "check that the server is running" in err


def test_store_stats_prints_json(server, store, capsys):
    import json

    from kvbridge_cli import main

    keys = chunk_keys(_ids(32, seed=10), model_id="org/stats-model", chunk_size=16)
    store.put_many({key: b"z" * 100 for key in keys})
    assert main(["store", "stats", server.url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["keys"] >= 2 and stats["maxmemory_policy"] == "allkeys-lru"
    assert stats["by_model"][keys[0].split(":")[2]]["keys"] == 2
    store.delete_many(keys)


def test_store_serve_runs_until_interrupted():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_cli", "store", "serve", "--port", str(port), "--maxmemory", "32mb"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # the URL, once the server answers
        assert f"redis://127.0.0.1:{port}/0" in line, line + proc.stderr.read()
        with open_store(f"redis://127.0.0.1:{port}/0") as store:
            store.ping()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        with open_store(f"redis://127.0.0.1:{port}/0", timeout=0.5) as store:
            with pytest.raises(StoreUnavailableError):  # the server went with it
                store.ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
