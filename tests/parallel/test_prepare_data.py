"""`meshlm prepare-data`: parallel tokenization into checksummed token shards that training memory-maps on every
rank with no wait on tokenization; the same tokens, batches and losses as the inline path."""

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_shared

from meshlm import cli
from meshlm.config import DataSection, load_config, parse_overrides
from meshlm.data import GlobalBatchSampler, dataset, prepare_data, prepare_data_shared, shards, train_tokenizer
from meshlm.data.shards import TokenShards
from meshlm.data.sources import DataError, source_fingerprint
from meshlm.train.trainer import train

VOCAB = 300
SHARD = 1000  # tokens a shard: a few thousand-token corpus spans several, so windows straddle shard boundaries


def corpus(tmp_path: Path, n: int = 400) -> Path:
    path = tmp_path / "corpus.jsonl"
    docs = [f"doc {i}: def f{i}(x):\n    return x * {i * 7 % 13} + {'y' * (i % 5)}\n" for i in range(n)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def overrides(source: Path | str, cache: Path) -> list[str]:
    return ["--data.source", str(source), "--data.cache_dir", str(cache), "--data.seq_len", "8",
            "--data.val_fraction", "0.1", "--model.vocab_size", str(VOCAB)]  # fmt: skip


def prepare_cli(source: Path | str, cache: Path, workers: int, *extra: str, shard_tokens: int = SHARD) -> int:
    args = ["prepare-data", "--workers", str(workers), "--shard-tokens", str(shard_tokens), *extra]
    return cli.main([*args, *overrides(source, cache)])


def data_cfg(source: Path, cache: Path) -> DataSection:
    return load_config(None, parse_overrides(overrides(source, cache))).data


def only_cache(cache: Path) -> Path:
    (directory,) = cache.iterdir()
    return directory


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of ~500 characters: dozens of them, so three workers really interleave."""
    monkeypatch.setattr(shards, "CHUNK_CHARS", 500)


def test_parallel_equals_serial_byte_for_byte(tmp_path, small_chunks, capsys):
    source = corpus(tmp_path)
    assert prepare_cli(source, tmp_path / "one", 1) == 0
    assert prepare_cli(source, tmp_path / "three", 3) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("tokeniz")]  # progress lines
    assert len(out) == 2 and "shard(s), built by prepare-data" in out[1], out
    one, three = only_cache(tmp_path / "one"), only_cache(tmp_path / "three")
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in three.iterdir()) and len([n for n in names if n.startswith("train-")]) > 3
    for name in names:
        if name != "manifest.json":
            assert (one / name).read_bytes() == (three / name).read_bytes(), name
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (one, three)]
    assert [m.pop("created") for m in manifests] and manifests[0] == manifests[1]
    # the shards hold exactly the stream the inline path writes as a single file per split
    inline = prepare_data(data_cfg(source, tmp_path / "inline"), VOCAB)
    prepared = prepare_data(data_cfg(source, tmp_path / "three"), VOCAB)
    assert len(inline.manifest["shards"]["train"]) == 1 and inline.manifest["builder"] == "inline"
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(getattr(prepared, split)), np.asarray(getattr(inline, split)))
    assert [r["tokens"] for r in manifests[0]["shards"]["train"][:-1]] == [SHARD] * (len(names) - 4)


def test_manifest_names_shards_checksums_tokenizer_and_source(tmp_path):
    source = corpus(tmp_path)
    assert prepare_cli(source, tmp_path / "c", 2) == 0
    directory = only_cache(tmp_path / "c")
    m = json.loads((directory / "manifest.json").read_text())
    assert m["builder"] == "prepare-data" and m["shard_tokens"] == SHARD and m["dtype"] == "uint16"
    assert m["sources_hash"] == source_fingerprint(data_cfg(source, tmp_path / "c"))
    assert m["tokenizer_sha256"] == hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
    for split in ("train", "val"):
        records = m["shards"][split]
        assert sum(r["tokens"] for r in records) == m["tokens"][split] > 0
        for r in records:
            data = (directory / r["file"]).read_bytes()
            assert len(data) == 2 * r["tokens"] and hashlib.sha256(data).hexdigest() == r["sha256"]
    assert sorted(p.name for p in tmp_path.joinpath("c").iterdir()) == [directory.name]  # no temp dirs left


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [(_truncate, "has 1998 bytes, manifest.json says 2000"), (_flip, "does not match its sha256"),
     (Path.unlink, "is missing")],
    ids=["truncated", "checksum", "missing"],
)  # fmt: skip
def test_a_damaged_prepared_shard_is_one_line_naming_it(tmp_path, damage, expected, capsys):
    source = corpus(tmp_path)
    assert prepare_cli(source, tmp_path / "c", 2) == 0
    shard = only_cache(tmp_path / "c") / "train-00001.bin"
    damage(shard)
    with pytest.raises(DataError) as err:
        prepare_data(data_cfg(source, tmp_path / "c"), VOCAB)
    message = str(err.value)
    assert "\n" not in message and str(shard) in message and expected in message and "meshlm prepare-data" in message
    capsys.readouterr()
    # `meshlm train` stops with that line and exit code 2 before any step; prepare-data rebuilds the corpus
    assert cli.main(["train", *overrides(source, tmp_path / "c"), "--log.run_dir", str(tmp_path / "run")]) == 2
    err_out = capsys.readouterr().err
    assert err_out.count("\n") == 1 and str(shard) in err_out and expected in err_out
    assert not (tmp_path / "run" / "config.toml").exists()  # stopped before the run started
    assert prepare_cli(source, tmp_path / "c", 2) == 0
    assert len(prepare_data(data_cfg(source, tmp_path / "c"), VOCAB).train) > 0


def test_token_shards_index_like_the_concatenated_array():
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 500, 1000).astype(np.uint16)
    view = TokenShards([whole[:7], whole[7:7], whole[7:600], whole[600:]], np.uint16)
    assert len(view) == 1000 and view.dtype == np.uint16 and np.array_equal(np.asarray(view), whole)
    index = rng.integers(-1000, 1000, (13, 9))
    assert np.array_equal(view[index], whole[index])
    rows = np.array([[5, 6, 7, 8], [598, 599, 600, 601], [0, 1, 2, 3]])  # windows across shard boundaries
    assert np.array_equal(view[rows], whole[rows]) and np.array_equal(view[rows - 1000], whole[rows - 1000])
    assert view[5] == whole[5] and view[-1] == whole[-1] and np.array_equal(view[3:900:7], whole[3:900:7])
    with pytest.raises(IndexError):
        view[np.array([1000])]
    epochs = [GlobalBatchSampler(tokens, 16, 62, seed=1).global_batch_at(0) for tokens in (view, whole)]  # all windows
    assert all(torch.equal(a, b) for a, b in zip(*epochs, strict=True))


def _train(source: Path, cache: Path, run: Path) -> list[float]:
    extra = ["--model.preset", "test", "--train.steps", "10", "--train.global_batch", "4", "--train.eval_every", "0",
             "--checkpoint.every", "0", "--log.progress", "false", "--log.tensorboard", "false",
             "--log.run_dir", str(run)]  # fmt: skip
    return train(load_config(None, parse_overrides([*overrides(source, cache), *extra]))).losses


def test_training_from_prepared_shards_equals_the_inline_path(tmp_path):
    """Same tokens in the same order, so the same batches and bitwise the same losses over 10 steps; 13-token
    shards make most 9-token windows straddle two of them."""
    source = corpus(tmp_path)
    assert prepare_cli(source, tmp_path / "prepared", 2, shard_tokens=13) == 0
    prepared = _train(source, tmp_path / "prepared", tmp_path / "a")
    inline = _train(source, tmp_path / "inline", tmp_path / "b")  # no cache: rank 0 tokenizes it inline
    assert len(prepared) == 10 and prepared == inline
    assert json.loads((only_cache(tmp_path / "inline") / "manifest.json").read_text())["builder"] == "inline"


def _read_shared(cfg: DataSection, damaged: bool) -> dict:
    """On each rank: prepare_data_shared with barriers and tokenization forbidden, recording what it hashed."""
    hashed: list[str] = []
    saved = dist.barrier, dataset.write_shards, shards.sha256_file

    def forbidden(*args, **kwargs):
        raise AssertionError("a rank waited at a barrier or tokenized")

    def sha256_file(path: Path, *args) -> str:
        hashed.append(path.name)
        return saved[2](path, *args)

    dist.barrier, dataset.write_shards, shards.sha256_file = forbidden, forbidden, sha256_file
    try:
        data = prepare_data_shared(cfg, VOCAB)
    except DataError as e:
        return {"error": str(e)}
    finally:
        dist.barrier, dataset.write_shards, shards.sha256_file = saved
    return {"train": np.asarray(data.train).tolist(), "hashed": hashed, "damaged": damaged}


def _inline_shared(cfg: DataSection) -> dict:
    """On each rank, with no cache: rank 0 tokenizes and warns about the size, the others wait at the barrier."""
    calls: list[str] = []
    records: list[str] = []
    saved_barrier, saved_limit = dist.barrier, dataset.INLINE_LIMIT_BYTES
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("meshlm.data.dataset").addHandler(handler)

    def barrier(*args, **kwargs):
        calls.append("barrier")
        return saved_barrier(*args, **kwargs)

    dist.barrier, dataset.INLINE_LIMIT_BYTES = barrier, 1000
    try:
        data = prepare_data_shared(cfg, VOCAB)
    finally:
        dist.barrier, dataset.INLINE_LIMIT_BYTES = saved_barrier, saved_limit
        logging.getLogger("meshlm.data.dataset").removeHandler(handler)
    warned = any("prepare-data" in r for r in records)
    return {"train": np.asarray(data.train).tolist(), "calls": calls, "warned": warned}


def test_ranks_read_prepared_shards_with_no_barrier_and_share_the_hashing(tmp_path):
    source = corpus(tmp_path)
    assert prepare_cli(source, tmp_path / "c", 2) == 0
    cfg = data_cfg(source, tmp_path / "c")
    expected = np.asarray(prepare_data(cfg, VOCAB).train).tolist()
    manifest = json.loads((only_cache(tmp_path / "c") / "manifest.json").read_text())
    files = [r["file"] for split in ("train", "val") for r in manifest["shards"][split]]
    ranks = run_shared(_read_shared, 2, cfg, False)
    assert all(r["train"] == expected for r in ranks)
    assert ranks[0]["hashed"] == files[0::2] and ranks[1]["hashed"] == files[1::2]  # each shard hashed once

    _flip(only_cache(tmp_path / "c") / files[1])  # a shard only rank 1 hashes: rank 0 must stop too
    errors = [r["error"] for r in run_shared(_read_shared, 2, cfg, True)]
    assert errors[0] == errors[1] and files[1] in errors[0] and "sha256" in errors[0]

    inline = run_shared(_inline_shared, 2, data_cfg(source, tmp_path / "fresh"))
    assert all(r["train"] == expected for r in inline) and [r["calls"] for r in inline] == [["barrier"]] * 2
    assert [r["warned"] for r in inline] == [True, False]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workers", "0"], "argument --workers: expected an integer from 1 to 4096, got '0'"),
        (["--data.seq_length", "8"], "config error: data.seq_length: unknown field"),
        (["--data.source", "/nonexistent.jsonl"], "data.source: /nonexistent.jsonl not found"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, args, expected, capsys):
    try:
        code = cli.main(["prepare-data", "--data.cache_dir", str(tmp_path / "c"), *args])
    except SystemExit as e:  # argparse usage errors exit from the parser
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "c").exists()


def test_hf_datasets_source_prepares_in_parallel(tmp_path, monkeypatch, small_chunks):
    """`hf:` sources stay optional and go through the same parallel path."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "train.jsonl").write_text(corpus(tmp_path).read_text())
    for workers, cache in ((1, "one"), (3, "three")):
        assert prepare_cli(f"hf:{folder}", tmp_path / cache, workers) == 0
    one, three = only_cache(tmp_path / "one"), only_cache(tmp_path / "three")
    assert (one / "train-00000.bin").read_bytes() == (three / "train-00000.bin").read_bytes()
    assert json.loads((one / "manifest.json").read_text())["source"] == f"hf:{folder}"


def test_prepare_data_uses_the_init_from_tokenizer_and_training_finds_it(tmp_path):
    """With model.init_from, the checkpoint's tokenizer.json is used (none trained) and the run's lookup
    (prepare_data with that tokenizer) finds the prepared cache."""
    source = corpus(tmp_path)
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    hf_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 128,
                 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
                 "hidden_act": "silu"}  # fmt: skip
    (checkpoint / "config.json").write_text(json.dumps(hf_config))
    train_tokenizer([f"word{i} " * 3 for i in range(50)], 280).save(str(checkpoint / "tokenizer.json"))
    assert prepare_cli(source, tmp_path / "c", 2, "--model.init_from", str(checkpoint)) == 0
    data = prepare_data(data_cfg(source, tmp_path / "c"), VOCAB, checkpoint / "tokenizer.json")
    assert data.manifest["builder"] == "prepare-data" and len(data.train) > 0
    assert (data.directory / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
