"""Supervised fine-tuning data for the tests: synthetic chats and prompt/response pairs in a jsonl, the data
section that reads them, and a Hugging Face tokenizer directory with a chat template, built with `tokenizers`
(no download). Shared by tests/parallel/test_sft.py, tests/integration/test_finetune_e2e.py and
tests/unit/test_first_day.py."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.config import DataSection

VOCAB = 512


def pair(i: int) -> dict:
    return {"prompt": f"What is {i} plus {i + 1}?", "response": f"{i} plus {i + 1} is {2 * i + 1}."}


def chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"{i}+{i}?"},
            {"role": "assistant", "content": f"{2 * i}"},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "You're welcome."},
        ]
    }


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sft_cfg(tmp_path: Path, records: list | None = None, **overrides: object) -> DataSection:
    records = records if records is not None else [pair(i) if i % 2 else chat(i) for i in range(40)]
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    fields = {"source": str(source), "format": "sft", "cache_dir": str(tmp_path / "cache"), "seq_len": 64}
    return DataSection(**fields | {"val_fraction": 0.1} | overrides)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hf_tokenizer_dir(
    root: Path, template: str, specials: list[str], eos: str, bos: str | None = None, jinja: bool = False
) -> Path:
    """A Hugging Face tokenizer directory built with `tokenizers` (no download): tokenizer.json and a
    tokenizer_config.json carrying the chat template (or, `jinja`, chat_template.jinja beside it, as recent
    transformers save it)."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials,
        show_progress=False,
    )  # fmt: skip
    texts = [json.dumps(pair(i)) + json.dumps(chat(i)) for i in range(40)] + ["system user assistant"]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"} | ({"bos_token": bos} if bos else {})
    if jinja:
        (root / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root / "tokenizer.json"
