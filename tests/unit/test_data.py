import json
import logging
import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlm.config import DataSection
from meshlm.data import (
    EOT,
    DataError,
    GlobalBatchSampler,
    decode,
    encode,
    eot_id,
    eval_batches,
    iter_documents,
    prepare_data,
    train_tokenizer,
)
from meshlm.data import dataset as dataset_module

VOCAB = 512


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory):
    cfg = DataSection(cache_dir=str(tmp_path_factory.mktemp("cache")), max_chars=200_000, val_fraction=0.2, seq_len=64)
    return prepare_data(cfg, VOCAB)


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def unique_docs(n):
    return [f"document number {i} says {'hello ' * (i % 7)}and {i * 31 % 97} is its code." for i in range(n)]


def jsonl_cfg(tmp_path, n_docs=60, **overrides):
    """A small corpus of distinct documents with a sequence length it can fill."""
    path = write_jsonl(tmp_path / "c.jsonl", unique_docs(n_docs))
    return DataSection(**{"source": str(path), "cache_dir": str(tmp_path / "cache"), "seq_len": 8} | overrides)


# ---------------------------------------------------------------- sources


def test_stdlib_source_is_real_python_and_deterministic():
    cfg = DataSection(max_chars=200_000)
    docs = list(iter_documents(cfg))
    assert docs == list(iter_documents(cfg))
    assert sum(map(len, docs)) == 200_000
    assert len(docs) > 1
    compile(docs[0], "first_stdlib_file.py", "exec")  # a whole, untruncated source file
    assert any("def " in d for d in docs)


def test_max_chars_takes_documents_in_order_and_truncates_the_last(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["aaaa", "bbbb", "cccc"])
    assert list(iter_documents(DataSection(source=str(tmp_path / "c.jsonl"), max_chars=6))) == ["aaaa", "bb"]
    assert list(iter_documents(DataSection(source=str(tmp_path / "c.jsonl"), max_chars=8))) == ["aaaa", "bbbb"]


def test_txt_source_splits_documents_at_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nstill first\n\n\nsecond\n  \nthird\n")
    assert list(iter_documents(DataSection(source=str(tmp_path / "a.txt")))) == [
        "first line\nstill first",
        "second",
        "third",
    ]


def test_jsonl_source_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n')
    assert list(iter_documents(DataSection(source=str(path), text_field="body"))) == ["one", "two"]


def test_folder_source_reads_known_suffixes_sorted_by_relative_path(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.md").write_text("markdown")
    (tmp_path / "a.py").write_text("x = 1\n")
    write_jsonl(tmp_path / "c.jsonl", ["j1", "j2"])
    (tmp_path / "d.txt").write_text("t1\n\nt2")
    (tmp_path / "e.csv").write_text("ignored")
    assert list(iter_documents(DataSection(source=str(tmp_path)))) == ["x = 1\n", "markdown", "j1", "j2", "t1", "t2"]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.txt", None, "missing.txt not found"),
        ("c.jsonl", '{"text": "ok"}\n{"text": broken\n', "c.jsonl:2: not valid JSON"),
        ("c.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"other": "x"}\n', "c.jsonl:3: no string field 'text'"),
        ("c.jsonl", '["text"]\n', "c.jsonl:1: no string field 'text'"),
        ("empty.txt", "\n  \n\n", "no text found in"),
        ("table.csv", "a,b\n", "table.csv is not a .txt or .jsonl file"),
    ],
)
def test_source_errors_are_one_line_and_name_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError) as err:
        list(iter_documents(DataSection(source=str(path))))
    message = str(err.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message


def test_empty_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match=f"no text found in {tmp_path}"):
        list(iter_documents(DataSection(source=str(tmp_path))))


def test_hf_source_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"pip install meshlm\[hf\]"):
        list(iter_documents(DataSection(source="hf:roneneldan/TinyStories")))


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    ["def f(x):\n    return x + 1\n", "héllo wörld — 日本語 🚀 \t\r\n", "", f"a{EOT}b", "\x00\x7f odd bytes"],
)
def test_tokenizer_round_trips(stdlib_data, text):
    assert decode(stdlib_data.tokenizer, encode(stdlib_data.tokenizer, text)) == text


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(stdlib_data, text):
    assert decode(stdlib_data.tokenizer, encode(stdlib_data.tokenizer, text)) == text


def test_tokenizer_is_deterministic_and_compresses():
    docs = list(iter_documents(DataSection(max_chars=100_000)))
    a, b = train_tokenizer(docs, 400), train_tokenizer(docs, 400)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400
    assert len(encode(a, docs[0])) < len(docs[0].encode()) / 1.5


def test_vocab_too_small_for_bytes_is_an_error():
    with pytest.raises(DataError, match=r"model.vocab_size \(256\) must be at least 257"):
        train_tokenizer(["abc"], 256)


# ---------------------------------------------------------------- prepared data


def test_prepared_stdlib_data(stdlib_data):
    d, m = stdlib_data, stdlib_data.manifest
    assert d.train.dtype == np.uint16 and all(isinstance(a, np.memmap) for a in d.train.arrays + d.val.arrays)
    assert len(d.train) == m["tokens"]["train"] > 0 and len(d.val) == m["tokens"]["val"] > 0
    assert max(np.asarray(d.train).max(), np.asarray(d.val).max()) < VOCAB
    assert d.train[-1] == d.val[-1] == eot_id(d.tokenizer) == m["eot_id"]
    files = ["manifest.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]
    assert sorted(p.name for p in d.directory.iterdir()) == files and m["builder"] == "inline"
    assert m["source"].startswith("stdlib") and m["vocab_size"] == VOCAB and m["dtype"] == "uint16"
    assert [p.name for p in d.directory.parent.iterdir()] == [d.directory.name]  # no temp dirs left behind


def test_splits_are_disjoint_by_document_and_cover_the_corpus(tmp_path):
    data = prepare_data(jsonl_cfg(tmp_path, 100, val_fraction=0.1), 300)

    def documents(tokens):
        return decode(data.tokenizer, tokens.tolist()).split(EOT)[:-1]

    train, val = documents(data.train), documents(data.val)
    assert len(val) == 10 and data.manifest["documents"] == {"train": 90, "val": 10}
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(unique_docs(100))


def test_second_prepare_reuses_the_cache(tmp_path, monkeypatch):
    cfg = jsonl_cfg(tmp_path)
    first = prepare_data(cfg, 300)
    stamp = os.stat(first.directory / "train-00000.bin").st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("retokenized a cached corpus")

    monkeypatch.setattr(dataset_module, "train_tokenizer", fail)
    second = prepare_data(cfg, 300)
    assert second.directory == first.directory and second.manifest == first.manifest
    assert os.stat(second.directory / "train-00000.bin").st_mtime_ns == stamp
    assert np.array_equal(second.train, first.train)


def test_changed_inputs_get_a_new_cache(tmp_path):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.txt").write_text("\n\n".join(unique_docs(60)))
    cfg = DataSection(source=str(source), cache_dir=str(tmp_path / "cache"), seq_len=8, val_fraction=0.1)
    base = prepare_data(cfg, 300).directory
    assert prepare_data(cfg, 320).directory != base
    assert prepare_data(cfg.model_copy(update={"max_chars": 2000}), 300).directory != base
    text = (source / "a.txt").read_text()
    mtime = (source / "a.txt").stat().st_mtime_ns
    (source / "a.txt").write_text(text.replace("number 0 ", "number X "))  # same size
    os.utime(source / "a.txt", ns=(mtime + 10**9, mtime + 10**9))
    same_size = prepare_data(cfg, 300)
    assert same_size.directory != base and "number X" in decode(same_size.tokenizer, same_size.train.tolist())
    (source / "a.txt").write_text("\n\n".join(unique_docs(61)))
    edited = prepare_data(cfg, 300)
    assert edited.directory not in (base, same_size.directory) and sum(edited.manifest["documents"].values()) == 61


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: (d / "manifest.json").unlink(),
        lambda d: (d / "manifest.json").write_text("{not json"),
        lambda d: (d / "train-00000.bin").write_bytes((d / "train-00000.bin").read_bytes()[:-2]),
        lambda d: (d / "val-00000.bin").unlink(),
        lambda d: (d / "tokenizer.json").write_text("{}"),
    ],
    ids=["no-manifest", "bad-manifest", "short-train", "no-val", "bad-tokenizer"],
)
def test_corrupt_cache_is_rebuilt_with_a_warning(tmp_path, caplog, corrupt):
    cfg = jsonl_cfg(tmp_path)
    good = prepare_data(cfg, 300)
    train = np.array(good.train)
    corrupt(good.directory)
    with caplog.at_level(logging.WARNING, logger="meshlm.data.dataset"):
        rebuilt = prepare_data(cfg, 300)
    assert any("corrupt" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert rebuilt.directory == good.directory and np.array_equal(rebuilt.train, train)
    assert [p.name for p in rebuilt.directory.parent.iterdir()] == [good.directory.name]


def test_a_builder_that_loses_the_race_keeps_the_installed_cache(tmp_path):
    first = prepare_data(jsonl_cfg(tmp_path), 300)
    inode = os.stat(first.directory / "manifest.json").st_ino
    # a second rank that finishes tokenizing after the first one installed its directory
    manifest = dataset_module._build(jsonl_cfg(tmp_path), 300, first.directory, first.directory.name)
    assert manifest == first.manifest
    assert os.stat(first.directory / "manifest.json").st_ino == inode
    assert [p.name for p in first.directory.parent.iterdir()] == [first.directory.name]


def test_too_few_documents_to_hold_out_is_an_error_and_leaves_no_cache(tmp_path):
    with pytest.raises(DataError, match=r"c\.jsonl has only 3 document\(s\).*data\.val_fraction") as err:
        prepare_data(jsonl_cfg(tmp_path, 3), 300)
    assert "\n" not in str(err.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_split_shorter_than_a_sequence_is_an_error(tmp_path):
    expected = r"the val split of .*c\.jsonl has \d+ tokens, fewer than data.seq_len \+ 1 = 65"
    with pytest.raises(DataError, match=expected):
        prepare_data(jsonl_cfg(tmp_path, seq_len=64), 300)


# ---------------------------------------------------------------- sampler

TOKENS = np.arange(8000, dtype=np.uint16)  # token value = position, so every row shows where it came from


def test_same_seed_and_step_give_the_same_batch_from_any_sampler():
    a = GlobalBatchSampler(TOKENS, 16, 8, seed=3)
    b = GlobalBatchSampler(TOKENS, 16, 8, seed=3)
    for step in (0, 5, 100):
        assert all(torch.equal(x, y) for x, y in zip(a.global_batch_at(step), b.global_batch_at(step), strict=True))
    assert not torch.equal(a.global_batch_at(0)[0], a.global_batch_at(1)[0])
    assert not torch.equal(a.global_batch_at(0)[0], GlobalBatchSampler(TOKENS, 16, 8, seed=4).global_batch_at(0)[0])


def test_batches_are_windows_with_shifted_targets():
    inputs, targets = GlobalBatchSampler(TOKENS, 16, 8, seed=0).global_batch_at(7)
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets[:, -1], inputs[:, -1] + 1)
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(16))  # contiguous slices of the stream
    assert torch.all(inputs[:, 0] % 16 == 0)


def test_each_epoch_visits_every_window_once_in_a_new_order():
    sampler = GlobalBatchSampler(TOKENS[:801], 16, 10, seed=0)  # 50 windows = 5 steps per epoch
    epoch = lambda e: torch.cat([sampler.global_batch_at(s)[0][:, 0] for s in range(5 * e, 5 * e + 5)])  # noqa: E731
    first, second = epoch(0), epoch(1)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 800, 16))
    assert not torch.equal(first, second)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(-(2**40), 2**40), step=st.integers(0, 10_000), world=st.sampled_from([1, 2, 4]))
def test_local_batches_concatenate_to_the_global_batch(seed, step, world):
    sampler = GlobalBatchSampler(TOKENS, 16, 8, seed)
    inputs, targets = sampler.global_batch_at(step)
    local = [sampler.local_batch_at(step, rank, world) for rank in range(world)]
    assert torch.equal(torch.cat([x for x, _ in local]), inputs)
    assert torch.equal(torch.cat([y for _, y in local]), targets)


def test_state_dict_resumes_the_same_sequence():
    run = GlobalBatchSampler(TOKENS, 16, 4, seed=9)
    expected = [run.next_batch(rank=1, world=2)[0] for _ in range(6)]
    first = GlobalBatchSampler(TOKENS, 16, 4, seed=9)
    got = [first.next_batch(rank=1, world=2)[0] for _ in range(3)]
    state = first.state_dict()
    assert state["step"] == 3 and state["seed"] == 9
    resumed = GlobalBatchSampler(TOKENS, 16, 4, seed=9)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(rank=1, world=2)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    it = iter(GlobalBatchSampler(TOKENS, 16, 4, seed=9))
    assert torch.equal(next(it)[0], GlobalBatchSampler(TOKENS, 16, 4, seed=9).global_batch_at(0)[0])


@pytest.mark.parametrize(("name", "value"), [("seed", 10), ("seq_len", 8), ("global_batch", 8)])
def test_load_state_dict_refuses_a_different_stream(name, value):
    state = GlobalBatchSampler(TOKENS, 16, 4, seed=9).state_dict() | {name: value}
    with pytest.raises(ValueError, match=f"checkpoint has {name}={value}"):
        GlobalBatchSampler(TOKENS, 16, 4, seed=9).load_state_dict(state)


def test_sampler_errors():
    with pytest.raises(ValueError, match="must be divisible by the data-parallel size"):
        GlobalBatchSampler(TOKENS, 16, 6, seed=0).local_batch_at(0, 0, 4)
    with pytest.raises(ValueError, match=r"has 16 tokens, fewer than data.seq_len \+ 1 = 17"):
        GlobalBatchSampler(TOKENS[:16], 16, 4, seed=0)


def test_eval_batches_are_fixed_spread_and_shardable():
    batches = list(eval_batches(TOKENS, 16, 4, 3))
    assert len(batches) == 3 and all(x.shape == (4, 16) for x, _ in batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, eval_batches(TOKENS, 16, 4, 3), strict=True))
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert starts[0] == 0 and starts[-1] == (len(TOKENS) - 1) // 16 * 16 - 16  # spread over the whole split
    halves = [list(eval_batches(TOKENS, 16, 4, 3, rank=r, world=2)) for r in range(2)]
    for i, (x, y) in enumerate(batches):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), x)
        assert torch.equal(torch.cat([halves[0][i][1], halves[1][i][1]]), y)


def test_sampler_over_prepared_tokens(stdlib_data):
    sampler = GlobalBatchSampler(stdlib_data.train, 64, 8, seed=0)
    inputs, targets = sampler.global_batch_at(3)
    assert inputs.shape == (8, 64) and int(inputs.max()) < VOCAB and int(targets.max()) < VOCAB
    x, _ = next(eval_batches(stdlib_data.val, 64, 4, 1))
    assert x.shape == (4, 64)


def test_hf_dataset_source_reads_a_local_dataset(tmp_path, monkeypatch):
    """With `datasets` installed, `hf:PATH` goes through `datasets.load_dataset` (a local folder: no network)."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "corpus"
    folder.mkdir()
    rows = [{"text": f"document {i}: def f{i}(x):\n    return x * {i}\n", "id": i} for i in range(40)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataSection(source=f"hf:{folder}", cache_dir=str(tmp_path / "cache"), seq_len=8, val_fraction=0.1)
    assert list(iter_documents(cfg)) == [r["text"] for r in rows]
    with pytest.raises(DataError, match="has no field 'body'; valid: text, id"):
        list(iter_documents(cfg.model_copy(update={"text_field": "body"})))
    data = prepare_data(cfg, vocab_size=300)
    assert len(data.train) > 0 and len(data.val) > 0


def test_token_caches_get_the_mode_the_umask_gives(tmp_path):
    """A cache built under umask 022 is readable by a teammate (0755 folder, 0644 files), as mkdir would make it."""
    old = os.umask(0o022)
    try:
        data = prepare_data(jsonl_cfg(tmp_path, 40, val_fraction=0.1), 300)
    finally:
        os.umask(old)
    assert data.directory.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in data.directory.iterdir())  # group and others read


def test_tokenizing_prints_progress_lines(tmp_path, monkeypatch, capsys):
    """A line per PROGRESS_CHARS of text while the corpus is tokenized, and one when it is done: a batch job's
    log is not silent for the minutes a large corpus takes."""
    monkeypatch.setattr(dataset_module, "PROGRESS_CHARS", 1000)
    cfg = jsonl_cfg(tmp_path, 100, val_fraction=0.1)
    chars = sum(len(t) for t in unique_docs(100))
    data = prepare_data(cfg, 300)
    lines = capsys.readouterr().out.splitlines()
    source = cfg.source
    assert lines[0] == f"tokenizing {source}: training a 300-token BPE tokenizer on its train split first"
    progress = [line for line in lines if line.startswith(f"tokenizing {source}: ") and " M characters, " in line]
    assert len(progress) == chars // 1000, lines
    assert progress[0].startswith(f"tokenizing {source}: 0.0 M characters, ")
    assert lines[-1].startswith(f"tokenized {source} in ") and lines[-1].endswith(
        f"{len(data.train):,} train and {len(data.val):,} validation tokens"
    )
    prepare_data(cfg, 300)  # the cache: nothing tokenized, nothing said
    assert capsys.readouterr().out == ""
