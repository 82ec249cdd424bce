"""Supervised fine-tuning data (`data.format = "sft"`): labels masked token by token under the plain template and
a Hugging Face chat template, whole examples packed into rows, the same global batch in every layout and after
a resume, one-line refusals of bad input, and a `meshlm train` run on a small jsonl."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_shared
from equivalence import assert_same_losses, trainer_runs
from sft_data import CHATML, VOCAB, chat, hf_tokenizer_dir, pair, sft_cfg, write_jsonl
from tokenizers import Tokenizer

from meshlm.cli import main
from meshlm.config import ConfigError, DataSection, load_config, parse_overrides
from meshlm.convert import load_checkpoint_model
from meshlm.data import IGNORE, DataError, prepare_data, prepare_data_shared
from meshlm.data.sft import PackedBatchSampler, PackedRows, PlainTemplate, SFTSplit

PAD = 9999  # a padding id no synthetic example uses


def expected_row(ids: list[int], keep: list[bool], seq_len: int, pad: int) -> tuple[list[int], list[int]]:
    """One example alone in a row, built by hand: inputs padded, targets the next token where it is a label."""
    tokens = ids + [pad] * (seq_len + 1 - len(ids))
    labels = keep + [False] * (seq_len + 1 - len(keep))
    return tokens[:-1], [t if k else IGNORE for t, k in zip(tokens[1:], labels[1:], strict=True)]


# ---------------------------------------------------------------- masking, token by token


def test_plain_template_labels_only_the_responses_and_their_eos(tmp_path: Path) -> None:
    data = prepare_data(sft_cfg(tmp_path, sft_packing=False), VOCAB)
    tok, eos = data.tokenizer, data.manifest["eos_id"]
    assert data.manifest["template"] == "plain" and tok.id_to_token(eos) == "<|endoftext|>"
    rows = data.rows("train", 64)
    examples = [pair(i) if i % 2 else chat(i) for i in range(40)]
    train_examples = [e for i, e in enumerate(examples) if int((i + 1) * 0.1) == int(i * 0.1)]
    checked = 0
    for row in range(len(rows)):
        (e,) = rows.row_examples(row)  # sft_packing = false: one example per row
        example = train_examples[e]
        if "prompt" in example:  # by hand: prompt pieces masked, the response and the eos kept
            head = tok.encode(f"user:\n{example['prompt']}\nassistant:\n").ids
            body = tok.encode(example["response"]).ids
            ids, keep = head + body + [eos], [False] * len(head) + [True] * (len(body) + 1)
        else:
            m = [msg["content"] for msg in example["messages"]]
            head1 = tok.encode(f"system:\n{m[0]}\nuser:\n{m[1]}\nassistant:\n").ids
            body1 = tok.encode(m[2]).ids
            head2 = tok.encode(f"user:\n{m[3]}\nassistant:\n").ids
            body2 = tok.encode(m[4]).ids
            ids = head1 + body1 + [eos] + head2 + body2 + [eos]
            keep = [False] * len(head1) + [True] * (len(body1) + 1) + [False] * len(head2) + [True] * (len(body2) + 1)
        x, y = rows.gather(np.array([row]))
        want_x, want_y = expected_row(ids, keep, 64, eos)
        assert x[0].tolist() == want_x and y[0].tolist() == want_y, example
        checked += 1
    assert checked == len(train_examples) == 36
    # and what a model learns reads back as the responses
    (e,) = rows.row_examples(0)
    _, y = rows.gather(np.array([0]))
    kept = tok.decode([t for t in y[0].tolist() if t != IGNORE], skip_special_tokens=False)
    assert kept == "0<|endoftext|>You're welcome.<|endoftext|>"


def test_the_plain_pieces_are_the_documented_template() -> None:
    messages = [("system", "S"), ("user", "U"), ("assistant", "A"), ("user", "V")]
    assert PlainTemplate.pieces(messages) == [("system:\nS\nuser:\nU\nassistant:\nA", (29, 30)), ("user:\nV\n", None)]


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "specials", "eos", "bos", "end"),
    [
        (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>", None, "<|im_end|>"),
        (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>",
         "<|begin_of_text|>", "<|eot_id|>"),
    ],
    ids=["chatml", "llama3"],
)  # fmt: skip
def test_hf_chat_template_labels_the_assistant_turns_through_their_end_of_turn(
    tmp_path: Path, template: str, specials: list[str], eos: str, bos: str | None, end: str
) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer_file = hf_tokenizer_dir(tmp_path / "tok", template, specials, eos, bos)
    data = prepare_data(sft_cfg(tmp_path, sft_packing=False), VOCAB, tokenizer_file)
    assert data.manifest["template"] == f"chat template of {tokenizer_file.parent}"
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_file.parent))
    tok, end_id = data.tokenizer, data.tokenizer.token_to_id(end)
    examples = [pair(i) if i % 2 else chat(i) for i in range(40)]
    train_examples = [e for i, e in enumerate(examples) if int((i + 1) * 0.1) == int(i * 0.1)]
    rows = data.rows("train", 64)
    for row in range(len(rows)):
        (e,) = rows.row_examples(row)
        example = train_examples[e]
        messages = example.get("messages") or [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["response"]},
        ]
        ids = tok.encode(hf.apply_chat_template(messages, tokenize=False), add_special_tokens=False).ids
        keep = [False] * len(ids)
        for k, message in enumerate(messages):  # by hand: the content's tokens and the end-of-turn after it
            if message["role"] != "assistant":
                continue
            before = tok.encode(
                hf.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            ).ids
            content = tok.encode(message["content"], add_special_tokens=False).ids
            assert ids[len(before) : len(before) + len(content) + 1] == [*content, end_id]
            keep[len(before) : len(before) + len(content) + 1] = [True] * (len(content) + 1)
        x, y = rows.gather(np.array([row]))
        want_x, want_y = expected_row(ids, keep, 64, data.manifest["eos_id"])
        assert x[0].tolist() == want_x and y[0].tolist() == want_y, example
    _, y = rows.gather(np.array([0]))
    kept = tok.decode([t for t in y[0].tolist() if t != IGNORE], skip_special_tokens=False)
    assert kept == f"0{end}You're welcome.{end}"  # ChatML's newline after <|im_end|> is not a label


# ---------------------------------------------------------------- packing


def synthetic_split(lengths: list[int], labels: list[list[int]] | None = None) -> SFTSplit:
    """Example e's tokens are all e (so a row shows which examples it holds); labels: kept positions."""
    tokens = np.concatenate([np.full(n, e) for e, n in enumerate(lengths)])
    keep = [np.zeros(n, np.uint8) for n in lengths]
    for e, n in enumerate(lengths):
        keep[e][labels[e] if labels else list(range(1, n))] = 1
    return SFTSplit(tokens, np.concatenate(keep), np.array(lengths))


def row_contents(x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """The row's tokens (inputs and the last target slot) with padding removed."""
    return [t for t in x.tolist() + ([y[-1].item()] if y[-1] != IGNORE else []) if t != PAD]


@pytest.mark.parametrize("packing", [True, False])
def test_whole_examples_are_packed_greedily_never_split_and_padding_is_ignored(packing: bool) -> None:
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(2, 10, size=200).tolist(), 40, 3, 17, 16]  # 40: longer than a row, truncated to 17
    split = synthetic_split(lengths)
    rows = PackedRows(split, seq_len=16, packing=packing, pad_id=PAD, name="train")
    x, y = rows.gather(np.arange(len(rows)))
    assert x.shape == y.shape == (len(rows), 16)
    seen = []
    for r in range(len(rows)):
        examples = rows.row_examples(r).tolist()
        tokens = [e for e in examples for _ in range(min(lengths[e], 17))]  # whole examples, in order
        assert row_contents(x[r], y[r])[: len(tokens)] == tokens
        assert len(tokens) <= 17
        if not packing:
            assert len(examples) == 1
        elif r + 1 < len(rows):  # greedy: the next row's first example did not fit here
            assert len(tokens) + min(lengths[rows.row_examples(r + 1)[0]], 17) > 17
        padding = 17 - len(tokens)
        assert x[r].tolist()[17 - padding :] == [PAD] * max(padding - 1, 0)
        assert all(t == IGNORE for t in y[r].tolist()[16 - padding :])  # padding is never a target
        seen += examples
    assert seen == list(range(len(lengths)))  # every example exactly once, in corpus order
    if packing:
        assert len(rows) < len(lengths) / 2


def test_targets_are_labels_only_and_never_cross_into_the_next_example() -> None:
    split = synthetic_split([5, 4, 6], labels=[[3, 4], [1], [2, 5]])
    rows = PackedRows(split, seq_len=15, packing=True, pad_id=PAD, name="train")
    x, y = rows.gather(np.array([0]))
    assert rows.row_examples(0).tolist() == [0, 1, 2]
    assert x[0].tolist() == [0] * 5 + [1] * 4 + [2] * 6
    # row token j+1 is the target of position j: labels at row positions 3, 4, 6, 11, 14 only
    want = [IGNORE] * 15
    for position, example in ((3, 0), (4, 0), (6, 1), (11, 2), (14, 2)):
        want[position - 1] = example
    assert y[0].tolist() == want


def test_an_example_truncated_to_no_label_is_dropped_and_a_set_without_labels_refused() -> None:
    split = synthetic_split([4, 30, 5], labels=[[3], [25], [4]])
    rows = PackedRows(split, seq_len=8, packing=False, pad_id=PAD, name="train")
    assert [rows.row_examples(r).tolist() for r in range(len(rows))] == [[0], [2]]
    with pytest.raises(DataError, match=r"^data: no train example keeps a response token within data.seq_len \+ 1"):
        PackedRows(synthetic_split([30], labels=[[25]]), seq_len=8, packing=True, pad_id=PAD, name="train")


# ---------------------------------------------------------------- the same global batch in every layout


def test_every_layout_sees_its_slice_of_the_same_global_batch_and_resume_continues_it(tmp_path: Path) -> None:
    data = prepare_data(sft_cfg(tmp_path, seq_len=48), VOCAB)
    sampler = data.sampler(48, global_batch=8, seed=7)
    assert isinstance(sampler, PackedBatchSampler) and sampler.n_windows == len(data.rows("train", 48))
    for step in (0, 3, 11):  # 11 crosses an epoch boundary: fewer rows than 11 * 8
        want_x, want_y = sampler.global_batch_at(step)
        assert (want_y != IGNORE).any(dim=1).all()  # every row has a label
        for world in (1, 2, 4, 8):
            other = data.sampler(48, global_batch=8, seed=7)  # a fresh instance, as on another rank
            parts = [other.local_batch_at(step, rank, world) for rank in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), want_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), want_y)
    assert not torch.equal(sampler.global_batch_at(0)[0], data.sampler(48, 8, seed=8).global_batch_at(0)[0])

    full = [sampler.next_batch(1, 2) for _ in range(6)]
    resumed = data.sampler(48, global_batch=8, seed=7)
    for _ in range(3):
        resumed.next_batch(1, 2)
    state = json.loads(json.dumps(resumed.state_dict()))  # as a checkpoint stores it
    again = data.sampler(48, global_batch=8, seed=7)
    again.load_state_dict(state)
    for want, got in zip(full[3:], [again.next_batch(1, 2) for _ in range(3)], strict=True):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    unpacked = prepare_data(sft_cfg(tmp_path, seq_len=48, sft_packing=False), VOCAB).sampler(48, 8, seed=7)
    with pytest.raises(
        ValueError, match="sampler state mismatch: checkpoint has packing=True, this run has packing=False"
    ):
        unpacked.load_state_dict(state)


def _local_rows_of_step_3(cfg: DataSection) -> dict:
    """On each rank of a group: the shared preparation (rank 0 builds, the others read), then its dp rows."""
    rank = torch.distributed.get_rank()
    try:
        data = prepare_data_shared(cfg, VOCAB)
    except DataError as e:
        return {"error": str(e)}
    x, y = data.sampler(cfg.seq_len, global_batch=8, seed=7).local_batch_at(3, rank, 2)
    return {"x": x, "y": y}


def test_two_ranks_prepare_once_and_each_takes_its_rows_and_a_bad_line_stops_both(tmp_path: Path) -> None:
    cfg = sft_cfg(tmp_path, seq_len=48)
    ranks = run_shared(_local_rows_of_step_3, 2, cfg)
    want_x, want_y = prepare_data(cfg, VOCAB).sampler(48, global_batch=8, seed=7).global_batch_at(3)
    assert torch.equal(torch.cat([r["x"] for r in ranks]), want_x)
    assert torch.equal(torch.cat([r["y"] for r in ranks]), want_y)
    (tmp_path / "bad").mkdir()
    bad = sft_cfg(tmp_path / "bad", [pair(0), '{"messages": []}'], seq_len=48)
    errors = [r["error"] for r in run_shared(_local_rows_of_step_3, 2, bad)]
    assert errors[0] == errors[1] and errors[0].startswith(f"{bad.source}:2: messages: must be a non-empty list")


def sft_train_args(cfg: DataSection, run_dir: Path, *extra: str) -> list[str]:
    """`meshlm train` on `cfg`'s examples with the `test` model: fp32 on CPU, no evaluation, no checkpoints."""
    return [
        "--model.preset", "test", "--data.format", "sft", "--data.source", cfg.source,
        "--data.cache_dir", cfg.cache_dir, "--data.seq_len", str(cfg.seq_len), "--data.val_fraction", "0.1",
        "--train.global_batch", "4", "--train.warmup_steps", "2", "--train.eval_every", "0", "--train.device", "cpu",
        "--checkpoint.every", "0", "--checkpoint.async_save", "false", "--log.run_dir", str(run_dir),
        "--log.progress", "false", "--log.tensorboard", "false", *extra,
    ]  # fmt: skip


@pytest.mark.slow  # ten steps at world 1, then dp=2 ZeRO-1 with accumulation, tp=2 and pp=2 on two ranks: ~45 s
def test_sft_training_is_the_same_in_every_layout(tmp_path: Path) -> None:
    """The trainer on SFT rows (prompt and padding -100, a different count of labels on each dp rank) under
    dp=2 ZeRO-1 with gradient accumulation, tp=2 and pp=2: every step's loss as in one process (criterion 1 of
    tests/equivalence.py, 1e-5 relative: the same fp32 sums in another order)."""
    varied = [{"prompt": f"Count to {i % 9}.", "response": " ".join(map(str, range(i % 9 + 1)))} for i in range(40)]
    cfg = sft_cfg(tmp_path, [*varied, *(chat(i) for i in range(20))], seq_len=48)
    sampler = prepare_data(cfg, VOCAB).sampler(48, global_batch=4, seed=1234)
    kept = [[int((sampler.local_batch_at(k, r, 2)[1] != IGNORE).sum()) for r in range(2)] for k in range(10)]
    assert any(a != b for a, b in kept)  # uneven: a per-rank mean would differ from the global one
    steps = ("--train.steps", "10")
    (reference,) = trainer_runs([sft_train_args(cfg, tmp_path / "one", *steps)])
    runs = [
        sft_train_args(cfg, tmp_path / "dp", *steps, "--parallel.layout", "dp=2", "--parallel.zero", "1",
                       "--train.micro_batch", "1"),
        sft_train_args(cfg, tmp_path / "tp", *steps, "--parallel.layout", "tp=2"),
        sft_train_args(cfg, tmp_path / "pp", *steps, "--parallel.layout", "pp=2", "--train.micro_batch", "2"),
    ]  # fmt: skip
    for got in run_shared(trainer_runs, 2, runs, timeout=400)[0]:
        assert_same_losses(reference, got)


def test_validation_batches_are_fixed_and_split_over_ranks_and_prepare_data_reuses_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = sft_cfg(tmp_path)
    data = prepare_data(cfg, VOCAB)
    assert data.manifest["examples"] == {"train": 36, "val": 4}
    whole = list(data.eval_batches(64, batch=4, n_batches=2))
    halves = [list(data.eval_batches(64, batch=4, n_batches=2, rank=r, world=2)) for r in range(2)]
    for b, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), x)
        assert torch.equal(torch.cat([halves[0][b][1], halves[1][b][1]]), y)
    assert main(["prepare-data", "--data.format", "sft", "--data.source", cfg.source, "--data.cache_dir",
                 cfg.cache_dir, "--data.val_fraction", "0.1", "--model.vocab_size", str(VOCAB)]) == 0  # fmt: skip
    summary = capsys.readouterr().out
    assert summary.startswith(f"{data.directory}: 36 train + 4 val examples (") and "plain), built by" in summary
    again = prepare_data(cfg, VOCAB)  # from the cache: the same
    assert again.directory == data.directory
    assert all(torch.equal(a[1], b[1]) for a, b in zip(whole, again.eval_batches(64, 4, 2), strict=True))


# ---------------------------------------------------------------- bad input: one line naming file, line, field


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r":3: not valid JSON; each line must be a JSON object with \"messages\""),
        ("[1, 2]", r":3: not a JSON object"),
        ('{"text": "x"}', r":3: no field 'messages' or 'prompt'"),
        ('{"response": "x"}', r":3: prompt: missing or not a string \(data.prompt_field\)"),
        ('{"prompt": "x"}', r":3: response: missing, empty or not a string"),
        ('{"prompt": "x", "response": ""}', r":3: response: missing, empty or not a string"),
        ('{"messages": []}', r":3: messages: must be a non-empty list"),
        ('{"messages": ["hi"]}', r":3: messages\[0\]: must be an object"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r":3: messages\[0\].role: unknown role 'bot'; valid: "),
        ('{"messages": [{"role": "user", "content": 3}]}', r":3: messages\[0\].content: missing or not a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', r":3: messages: no assistant message"),
        ('{"messages": [{"role": "assistant", "content": ""}]}', r":3: messages\[0\].content: an empty assistant"),
    ],
)
def test_bad_lines_are_one_line_naming_file_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    cfg = sft_cfg(tmp_path, [pair(0), "", line, pair(1)])  # line 2 is blank: skipped, still counted
    with pytest.raises(DataError, match=str(tmp_path / "sft.jsonl") + message) as e:
        prepare_data(cfg, VOCAB)
    assert len(str(e.value).splitlines()) == 1


def test_many_bad_lines_are_one_error_with_a_count(tmp_path: Path) -> None:
    """The first bad line's reason, then how many more and where the next few are: one rerun fixes them all."""
    lines = [pair(0), "{not json", pair(1), "[1]", '{"text": "x"}', "{", "{", pair(2)]
    cfg = sft_cfg(tmp_path, lines)
    path = tmp_path / "sft.jsonl"
    with pytest.raises(DataError) as e:
        prepare_data(cfg, VOCAB)
    assert str(e.value) == (
        f'{path}:2: not valid JSON; each line must be a JSON object with "messages" (data.messages_field) or '
        f'"prompt" and "response" (data.prompt_field, data.response_field) (and 4 more bad line(s): {path}:4, '
        f"{path}:5, {path}:6, ...)"
    )


def test_bad_sources_and_sets_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.source: .*a.txt is not a .jsonl file"):
        prepare_data(DataSection(source=str(write_jsonl(tmp_path / "a.txt", [])), format="sft"), VOCAB)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.source: .*empty holds no .jsonl file"):
        prepare_data(DataSection(source=str(tmp_path / "empty"), format="sft"), VOCAB)
    with pytest.raises(DataError, match=r"has only 2 example\(s\), too few to hold out data.val_fraction"):
        prepare_data(sft_cfg(tmp_path, [pair(0), pair(1)]), VOCAB)
    long = {"prompt": "word " * 200, "response": "yes"}
    data = prepare_data(sft_cfg(tmp_path, [long] * 20), VOCAB)  # every response lies past seq_len + 1
    with pytest.raises(DataError, match=r"^data: no train example keeps a response token within data.seq_len"):
        data.sampler(64, 4, 0)
    for overrides, message in (
        ([], "config error: data.source: data.format = 'sft' reads .jsonl files, not 'stdlib'"),
        (["--data.source", "x.jsonl", "--data.max_chars", "10"], "config error: data.max_chars caps a text corpus"),
        (["--data.source", "x.jsonl", "--train.ignore_index", "-1"], "config error: train.ignore_index = -1: data"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, parse_overrides(["--data.format", "sft", *overrides]))


# ---------------------------------------------------------------- `meshlm train` on a small jsonl


def test_meshlm_train_eval_generate_on_sft_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = sft_cfg(tmp_path, seq_len=48)
    run_dir = tmp_path / "run"
    args = [
        "--model.preset", "test", "--data.format", "sft", "--data.source", cfg.source,
        "--data.cache_dir", cfg.cache_dir, "--data.seq_len", "48", "--data.val_fraction", "0.1",
        "--train.steps", "2", "--train.global_batch", "4", "--train.warmup_steps", "1", "--train.eval_every", "2",
        "--train.eval_batches", "1", "--train.device", "cpu", "--checkpoint.async_save", "false",
        "--log.run_dir", str(run_dir), "--log.progress", "false", "--log.tensorboard", "false", "--log.every", "1",
    ]  # fmt: skip
    assert main(["train", *args]) == 0
    assert main(["eval", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step_00000002: validation loss" in out
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained if r["kind"] == "train"] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in trained if r["kind"] in ("train", "eval"))
    assert main(["generate", str(run_dir), "--prompt", "user:\n3+3?\nassistant:\n", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("user:\n3+3?\nassistant:\n")


@pytest.mark.slow  # train, eval, generate and export from an HF checkpoint, then transformers loads it: ~15 s
def test_sft_from_a_hugging_face_checkpoint_with_its_chat_template_exports_to_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/finetune.md's SFT walk-through: init_from an HF Llama with a ChatML tokenizer (its template in
    chat_template.jinja), SFT on chats, then eval, generate and convert; transformers loads the export with
    the chat template and gives the same loss on an SFT batch (-100 labels ignored) as meshlm."""
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    hf_tokenizer_dir(hf_dir, CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>", jinja=True)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    vocab = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    end_of_text, im_end = vocab.token_to_id("<|endoftext|>"), vocab.token_to_id("<|im_end|>")
    # the base model's own generation config: it stops at end-of-text and samples at 0.7
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_text, "temperature": 0.7}))
    cfg = sft_cfg(tmp_path, seq_len=48)
    run_dir = tmp_path / "run"
    args = [
        "--model.init_from", str(hf_dir), "--data.format", "sft", "--data.source", cfg.source,
        "--data.cache_dir", cfg.cache_dir, "--data.seq_len", "48", "--data.val_fraction", "0.1",
        "--train.steps", "2", "--train.global_batch", "4", "--train.lr", "1e-3", "--train.warmup_steps", "1",
        "--train.eval_every", "2", "--train.eval_batches", "1", "--train.device", "cpu",
        "--checkpoint.async_save", "false", "--log.run_dir", str(run_dir), "--log.progress", "false",
        "--log.tensorboard", "false",
    ]  # fmt: skip
    assert main(["train", *args]) == 0
    assert main(["eval", str(run_dir)]) == 0
    assert "step_00000002: validation loss" in capsys.readouterr().out
    prompt = "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    assert main(["generate", str(run_dir), "--prompt", prompt, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    assert main(["convert", "meshlm-to-hf", str(run_dir), str(tmp_path / "out")]) == 0

    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf.chat_template == CHATML
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    data = prepare_data(load_config(None, parse_overrides(args)).data, VOCAB, hf_dir / "tokenizer.json")
    x, y = next(data.eval_batches(48, batch=4, n_batches=1))
    with torch.no_grad():
        logits = model(x).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in evals if r["kind"] == "eval"][-1]
    assert abs(got - want.item()) <= 1e-5 * want.item()  # fp32 both sides: the suite's loss tolerance

    # the export generates like the original, and stops at the end of an assistant turn: the source's
    # generation config kept (its sampling default too), its eos joined by the template's end-of-turn token
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert generation["eos_token_id"] == exported["eos_token_id"] == [end_of_text, im_end]
    assert generation["temperature"] == 0.7 and exported["pad_token_id"] == end_of_text
    assert model.generation_config.eos_token_id == [end_of_text, im_end]
    prompt_ids = torch.tensor([hf(prompt)["input_ids"]])

    def end_the_turn_at_the_third_token(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] == prompt_ids.shape[1] + 2:  # the third token of the answer ends the turn
            scores = torch.full_like(scores, -math.inf)
            scores[:, im_end] = 0.0
        return scores

    forced = transformers.LogitsProcessorList([end_the_turn_at_the_third_token])
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=20, do_sample=False, logits_processor=forced)
    answer = out[0, prompt_ids.shape[1] :].tolist()  # it may end its turn by itself before the third token
    assert answer[-1] == im_end and im_end not in answer[:-1] and len(answer) <= 3, answer
    # lm-eval moves a context's trailing whitespace to the continuation: the context ends without it
    check_lm_eval_scores_like_meshlm(tmp_path / "out", run_dir, hf, prompt.removesuffix("\n"), "\n6<|im_end|>")


def check_lm_eval_scores_like_meshlm(export: Path, run_dir: Path, hf: object, context: str, answer: str) -> None:
    """EleutherAI's lm-evaluation-harness (installed as `pip install 'lm-eval[hf]'`, docs/finetune.md) loads the
    export through its Hugging Face model class and scores an answer as meshlm's own model of the run does
    (fp32 both sides: the suite's loss tolerance)."""
    huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    lm = huggingface.HFLM(pretrained=str(export), device="cpu", batch_size=1)
    [(got, _)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, answer), 0)], disable_tqdm=True)
    ids = hf(context + answer, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    n_context = len(hf(context, add_special_tokens=False)["input_ids"])  # type: ignore[operator]
    model, _ = load_checkpoint_model(run_dir)
    with torch.no_grad():
        logprobs = torch.log_softmax(model.eval()(torch.tensor([ids])), dim=-1)[0]
    want = sum(logprobs[i - 1, ids[i]].item() for i in range(n_context, len(ids)))
    assert len(ids) > n_context and abs(got - want) <= 1e-5 * abs(want), (got, want)
