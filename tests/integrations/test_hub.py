"""Checksummed and sharded mapper files, push_to_hub in one commit, loading from the Hub cache, the model card."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import load, load_file

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM, MapperFileError
from hf_kvbridge.card import read_eval_table, render_model_card
from hf_kvbridge.persistence import checkpoint_files, sha256_file
from kvbridge_cli import main as cli_main
from tests.conftest import CORPUS, VOCAB

# the pair's shared tokenizer travels with the checkpoint (so AutoTokenizer.from_pretrained(bridge_dir) works)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}
BRIDGE_FILES = {"config.json", "mapper.safetensors", "README.md", *TOKENIZER_FILES}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def bridge(saved_pair):
    return hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=16, seq_len=32, top_k=2, batch_size=4
    )


def _load(path, bridge, **kw):
    return KVBridgeForCausalLM.from_pretrained(path, source_model=bridge.source, target_model=bridge.target, **kw)


def _same_mapping(a, b):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    for la, lb in zip(a.prefill(ids)[0].layers, b.prefill(ids)[0].layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.fixture
def hub_calls(monkeypatch):
    """Intercepts the Hub: `create_repo` and `upload_folder` record their arguments and the uploaded files."""
    calls = {"create_repo": [], "upload_folder": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append({"repo_id": repo_id, **kwargs})

        class Url(str):
            pass

        url = Url(f"https://huggingface.co/{repo_id}")
        url.repo_id = repo_id
        return url

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        root = Path(folder_path)
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        calls["upload_folder"].append({"repo_id": repo_id, "files": files, **kwargs})
        return f"https://huggingface.co/{repo_id}/commit/{COMMIT}"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def _uploaded_names(call):
    """What upload_folder really uploads: the files in the folder that match its allow_patterns."""
    import fnmatch

    return {n for n in call["files"] if any(fnmatch.fnmatch(n, p) for p in call["allow_patterns"])}


def test_checksums_recorded_and_verified(bridge, tmp_path):
    bridge.save_pretrained(tmp_path / "b")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["mapper_sha256"] == {"mapper.safetensors": sha256_file(tmp_path / "b" / "mapper.safetensors")}
    _same_mapping(_load(tmp_path / "b", bridge), bridge)

    # one flipped byte in the tensor data: still a valid safetensors file, but not the one that was saved
    weights = tmp_path / "b" / "mapper.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(MapperFileError, match=r"mapper\.safetensors fail their checksum"):
        _load(tmp_path / "b", bridge)


def test_sharded_save_load_round_trip(bridge, tmp_path):
    total = sum(t.numel() * t.element_size() for t in bridge.mapper.state_dict().values())
    bridge.save_pretrained(tmp_path / "b", max_shard_size=total // 3)
    files = {p.name for p in (tmp_path / "b").iterdir()}
    shards = sorted(f for f in files if f.startswith("mapper-"))
    assert len(shards) >= 3 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    assert files == {"config.json", "README.md", "mapper.safetensors.index.json", *shards, *TOKENIZER_FILES}
    index = json.loads((tmp_path / "b" / "mapper.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(bridge.mapper.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == total
    checksums = json.loads((tmp_path / "b" / "config.json").read_text())["mapper_sha256"]
    assert checksums == {s: sha256_file(tmp_path / "b" / s) for s in shards}
    _same_mapping(_load(tmp_path / "b", bridge), bridge)

    # saving unsharded over it removes the stale shards and index
    bridge.save_pretrained(tmp_path / "b", overwrite=True)
    assert {p.name for p in (tmp_path / "b").iterdir()} == BRIDGE_FILES
    _same_mapping(_load(tmp_path / "b", bridge), bridge)


def test_missing_or_tampered_shard(bridge, tmp_path):
    total = sum(t.numel() * t.element_size() for t in bridge.mapper.state_dict().values())
    bridge.save_pretrained(tmp_path / "b", max_shard_size=total // 2)
    shard = sorted((tmp_path / "b").glob("mapper-*.safetensors"))[-1]
    original = shard.read_bytes()
    shard.write_bytes(original[:-8] + bytes(8))
    with pytest.raises(MapperFileError, match=f"{shard.name} fail their checksum"):
        _load(tmp_path / "b", bridge)
    shard.unlink()
    with pytest.raises(MapperFileError, match=f"{shard.name} not found"):
        _load(tmp_path / "b", bridge)


def test_push_to_hub_uploads_exactly_the_saved_files_in_one_commit(bridge, tmp_path, hub_calls):
    commit = bridge.push_to_hub("me/tiny-bridge", commit_message="first", private=True)
    assert commit.endswith(COMMIT)
    assert hub_calls["create_repo"] == [
        {"repo_id": "me/tiny-bridge", "private": True, "exist_ok": True, "token": None}
    ]
    (call,) = hub_calls["upload_folder"]  # one commit
    assert call["repo_id"] == "me/tiny-bridge" and call["commit_message"] == "first" and not call["create_pr"]
    assert set(call["files"]) == BRIDGE_FILES == _uploaded_names(call)
    # what save_pretrained writes (safetensors 0.8 orders header metadata arbitrarily: compare tensors, and the
    # config up to the checksums of those bytes); the card names the repo
    bridge.save_pretrained(tmp_path / "local")
    pushed, saved = load(call["files"]["mapper.safetensors"]), load_file(tmp_path / "local" / "mapper.safetensors")
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    pushed_config = json.loads(call["files"]["config.json"])
    assert pushed_config.pop("mapper_sha256") == {
        "mapper.safetensors": hashlib.sha256(call["files"]["mapper.safetensors"]).hexdigest()
    }
    saved_config = json.loads((tmp_path / "local" / "config.json").read_text())
    saved_config.pop("mapper_sha256")
    assert pushed_config == saved_config
    card = call["files"]["README.md"].decode()
    assert 'from_pretrained("me/tiny-bridge")' in card and "library_name: hf-kvbridge" in card
    # stale shards of an earlier push are deleted in the same commit
    assert "mapper-*-of-*.safetensors" in call["delete_patterns"]


def test_push_sharded(bridge, hub_calls):
    total = sum(t.numel() * t.element_size() for t in bridge.mapper.state_dict().values())
    bridge.push_to_hub("me/tiny-bridge", max_shard_size=total // 2, revision="dev", create_pr=True)
    (call,) = hub_calls["upload_folder"]
    names = set(call["files"])
    assert {"config.json", "README.md", "mapper.safetensors.index.json"} < names and "mapper.safetensors" not in names
    assert len([n for n in names if n.startswith("mapper-")]) >= 2
    assert call["revision"] == "dev" and call["create_pr"] is True


def test_cli_push_keeps_the_eval_table(bridge, tmp_path, hub_calls, capsys):
    table = "| task | metric |\n|---|---|\n| cloze | acc |"
    bridge.save_pretrained(tmp_path / "b", model_card_kwargs={"eval_table": table})
    assert read_eval_table((tmp_path / "b" / "README.md").read_text()) == table
    (tmp_path / "b" / "notes.txt").write_text("not part of the checkpoint")
    assert cli_main(["push", str(tmp_path / "b"), "me/tiny-bridge"]) == 0
    (call,) = hub_calls["upload_folder"]
    assert _uploaded_names(call) == BRIDGE_FILES
    card = call["files"]["README.md"].decode()
    assert read_eval_table(card) == table and 'from_pretrained("me/tiny-bridge")' in card
    assert call["files"]["mapper.safetensors"] == (tmp_path / "b" / "mapper.safetensors").read_bytes()
    assert "pushed" in capsys.readouterr().out


def test_cli_push_passes_the_hub_options(bridge, tmp_path, hub_calls):
    """`kvbridge push`'s Hub options reach the Hub, through the bridge's own push path (`SavedCheckpoint`)."""
    bridge.save_pretrained(tmp_path / "b")
    options = ["--revision", "dev", "--private", "--token", "hf_test", "--commit-message", "second", "--create-pr"]
    assert cli_main(["push", str(tmp_path / "b"), "me/tiny-bridge", *options]) == 0
    assert hub_calls["create_repo"] == [
        {"repo_id": "me/tiny-bridge", "private": True, "exist_ok": True, "token": "hf_test"}
    ]
    (call,) = hub_calls["upload_folder"]
    assert call["revision"] == "dev" and call["create_pr"] is True and call["commit_message"] == "second"
    assert call["token"] == "hf_test" and _uploaded_names(call) == BRIDGE_FILES


def test_cli_push_refuses_a_damaged_checkpoint(bridge, tmp_path, hub_calls, capsys):
    bridge.save_pretrained(tmp_path / "b")
    weights = tmp_path / "b" / "mapper.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    with pytest.raises(MapperFileError, match="checksum"):
        cli_main(["push", str(tmp_path / "b"), "me/tiny-bridge", "--debug"])
    assert cli_main(["push", str(tmp_path / "b"), "me/tiny-bridge"]) == 1  # one line, no traceback
    assert "checksum" in capsys.readouterr().err
    assert hub_calls["upload_folder"] == []


def _hub_cache(tmp_path, bridge, repo="org/tiny-bridge", commit=COMMIT, ref="main"):
    """A Hub cache folder as huggingface_hub lays it out: models--org--name/{refs/main, snapshots/<commit>/...}."""
    cache = tmp_path / "hub-cache"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    bridge.save_pretrained(repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return cache


def test_from_pretrained_resolves_through_the_hub_cache_offline(bridge, tmp_path, monkeypatch):
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # conftest: nothing may touch the network
    cache = _hub_cache(tmp_path, bridge)
    for revision in (None, "main", COMMIT):
        loaded = _load("org/tiny-bridge", bridge, cache_dir=cache, revision=revision)
        _same_mapping(loaded, bridge)
        assert loaded.config.name_or_path == "org/tiny-bridge"
    # HF_HUB_CACHE is honoured as well (read by huggingface_hub at import: patch its constant)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    _same_mapping(_load("org/tiny-bridge", bridge), bridge)
    with pytest.raises(Exception, match="(?i)offline|cache|not found"):
        _load("org/tiny-bridge", bridge, cache_dir=cache, revision="v2")  # not cached: no network call offline
    with pytest.raises(Exception, match="(?i)offline|cache|not found"):
        _load("org/other-bridge", bridge, cache_dir=cache)


def test_hub_cache_checksum_mismatch_is_refused(bridge, tmp_path):
    cache = _hub_cache(tmp_path, bridge)
    snapshot = cache / "models--org--tiny-bridge" / "snapshots" / COMMIT
    config = json.loads((snapshot / "config.json").read_text())
    config["mapper_sha256"]["mapper.safetensors"] = "0" * 64
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(MapperFileError, match=r"snapshots/.*mapper\.safetensors fail their checksum"):
        _load("org/tiny-bridge", bridge, cache_dir=cache)


def test_model_card(bridge):
    table = "| task | metric | source | target | bridge |\n|---|---|---|---|---|\n| t | acc | 0.3 | 0.5 | 0.45 |"
    card = render_model_card(bridge.config, repo_id="me/x", eval_table=table, attention_cosine=[0.9, 0.8, 0.95])
    data = card.data.to_dict()
    assert data["library_name"] == "hf-kvbridge"
    assert data["base_model"] == [bridge.config.source_name_or_path, bridge.config.target_name_or_path]
    assert {"kv-cache", "kvbridge"} <= set(data["tags"])
    text = str(card)
    assert "## The pair" in text and "## Calibration" in text and "num_sequences" in text
    assert "Held-out R²" in text and "worst layer 0.8000" in text
    assert "## Retention" in text and read_eval_table(text) == table
    plain = str(render_model_card(bridge.config))
    assert "## Retention" not in plain and "Attention-output cosine" not in plain


def test_bidirectional_checkpoint_pushes_its_reverse_mapper(saved_pair, tmp_path, hub_calls):
    both = hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=16, seq_len=32, top_k=2, bidirectional=True
    )
    reverse_files = {
        f"reverse/{name}" for name in ("config.json", "mapper.safetensors", "README.md", *TOKENIZER_FILES)
    }
    both.push_to_hub("me/both-ways")
    both.save_pretrained(tmp_path / "b")
    assert cli_main(["push", str(tmp_path / "b"), "me/both-ways"]) == 0
    for call in hub_calls["upload_folder"]:  # the method and the CLI upload the same files
        assert _uploaded_names(call) == BRIDGE_FILES | reverse_files


def test_checkpoint_carries_the_tokenizer_and_world_readable_weights(bridge, saved_pair, tmp_path):
    from transformers import AutoTokenizer

    bridge.save_pretrained(tmp_path / "b")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "b")
    reference = AutoTokenizer.from_pretrained(saved_pair["large"])
    assert loaded.get_vocab() == reference.get_vocab()
    assert loaded("The quick brown fox")["input_ids"] == reference("The quick brown fox")["input_ids"]
    # what a push uploads and what save_pretrained writes stay the same set
    assert set(checkpoint_files(tmp_path / "b")) == BRIDGE_FILES == {p.name for p in (tmp_path / "b").iterdir()}
    mode = (tmp_path / "b" / "config.json").stat().st_mode & 0o777
    assert (tmp_path / "b" / "mapper.safetensors").stat().st_mode & 0o777 == mode  # not safetensors' 0600


def test_checkpoint_without_a_tokenizer_at_hand_still_saves(bridge, tmp_path, monkeypatch):
    monkeypatch.setattr(bridge.config, "target_name_or_path", str(tmp_path / "gone"))
    bridge.save_pretrained(tmp_path / "b")
    assert {p.name for p in (tmp_path / "b").iterdir()} == BRIDGE_FILES - TOKENIZER_FILES


def test_one_way_push_over_a_bidirectional_repo_leaves_no_stale_reverse(bridge, tmp_path, hub_calls):
    """The repo after two pushes, replayed as the Hub applies `upload_folder` (deletions matching `delete_patterns`,
    except files uploaded in the same commit, then the uploads): the one-way bridge's repo has no `reverse/`, and
    `from_pretrained` attaches none."""
    import fnmatch

    from hf_kvbridge.fitting.calibration.calibrate import fit_bridge

    two_way = bridge.with_mapper(bridge.mapper, bridge.config)  # same models and mapper, plus a target→source one
    windows = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(0))
    stats = hf_kvbridge.collect_statistics(bridge.target, bridge.source, windows, heldout=[0, 1])
    two_way.reverse = fit_bridge(bridge.target, bridge.source, *stats[:2], top_k=1)
    two_way.push_to_hub("me/tiny-bridge")
    bridge.push_to_hub("me/tiny-bridge")
    repo: dict[str, bytes] = {}
    for call in hub_calls["upload_folder"]:
        uploaded = _uploaded_names(call)
        for name in list(repo):
            if name not in uploaded and any(fnmatch.fnmatch(name, p) for p in call.get("delete_patterns") or []):
                del repo[name]
        repo.update({name: call["files"][name] for name in uploaded})
    assert any(name.startswith("reverse/") for name in _uploaded_names(hub_calls["upload_folder"][0]))
    assert set(repo) == BRIDGE_FILES  # before the fix: reverse/config.json and reverse/mapper.safetensors stayed
    snapshot = tmp_path / "snapshot"
    for name, data in repo.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    assert _load(snapshot, bridge).reverse is None
