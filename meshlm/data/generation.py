"""The token ids generation needs, for an exported model: what `transformers`' `generate` stops at.

An export carries them twice, as Hugging Face checkpoints do: `bos_token_id`, `eos_token_id` and
`pad_token_id` in config.json, and generation_config.json (which `generate` reads). The source checkpoint's
generation_config.json (kept with the run at `model.init_from` time, with its sampling defaults) is the base;
without one the ids come from the tokenizer: eos is its document separator (tokenizer_config.json's
eos_token, else meshlm's EOT). Either way, a tokenizer with a chat template adds the tokens that end an
assistant turn (ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`), so a fine-tuned chat model stops after its answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from meshlm.data.dataset import check_tokenizer, document_separator
from meshlm.data.sft import ChatTemplate, chat_template_files
from meshlm.files import atomic_write

GENERATION_CONFIG = "generation_config.json"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _token_id(tokenizer_file: Path, tokenizer: Tokenizer, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` token (e.g. bos_token), or None."""
    config_path = tokenizer_file.parent / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    token = json.loads(config_path.read_bytes()).get(key)
    token = token.get("content") if isinstance(token, dict) else token
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _as_list(ids: object) -> list[int]:
    return [ids] if isinstance(ids, int) else [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else []


def generation_ids(tokenizer_file: Path, carried: dict | None = None) -> dict[str, int | list[int]]:
    """bos/eos/pad ids for a model trained with `tokenizer_file`: `carried` (a source generation_config.json)
    first, else the tokenizer's; eos gains the chat template's end-of-turn tokens. eos is one id or a list, as
    Hugging Face writes it; pad defaults to the first eos id (meshlm pads SFT rows with eos)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    carried = carried or {}
    eos = _as_list(carried.get("eos_token_id")) or [document_separator(tokenizer_file, tokenizer)]
    if chat_template_files(tokenizer_file):
        eos += [i for i in ChatTemplate(tokenizer_file, tokenizer).end_of_turn_ids() if i not in eos]
    ids: dict[str, int | list[int]] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    bos = carried.get("bos_token_id", _token_id(tokenizer_file, tokenizer, "bos_token"))
    if isinstance(bos, int):
        ids["bos_token_id"] = bos
    pad = carried.get("pad_token_id", _token_id(tokenizer_file, tokenizer, "pad_token"))
    ids["pad_token_id"] = pad if isinstance(pad, int) else eos[0]
    return ids


def write_generation_ids(export_dir: Path) -> None:
    """Put the generation ids into an export's config.json and generation_config.json (kept from the source
    checkpoint when the run carried one, else written); nothing without a tokenizer.json beside the weights."""
    tokenizer_file = export_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    generation_path = export_dir / GENERATION_CONFIG
    carried = json.loads(generation_path.read_bytes()) if generation_path.is_file() else {}
    if not isinstance(carried, dict):
        raise ValueError(f"{generation_path}: should be a JSON object, got {type(carried).__name__}")
    ids = generation_ids(tokenizer_file, carried)
    atomic_write(generation_path, json.dumps({**carried, **ids}, indent=2) + "\n")
    config_path = export_dir / "config.json"
    config = json.loads(config_path.read_bytes())
    atomic_write(config_path, json.dumps({**config, **ids}, indent=2) + "\n")


class Prompter:
    """A run's tokenizer as `meshlm generate` uses it (the library's way to the same): a prompt as token ids, plain
    or as a user turn of the run's chat template, and the ids that end a reply. The tokenizer file must load and
    fit the model's vocabulary (one DataError line naming it otherwise).

        prompter = Prompter(run_dir / "tokenizer.json", model.cfg.vocab_size)
        ids = torch.tensor([prompter.encode("3+3?", chat=True)])
        out = meshlm.model.generate(model, ids, 32, temperature=0, stop_token=prompter.stop_ids(chat=True))
        print(prompter.decode(out[0, ids.shape[1]:].tolist()))

    With a chat template (tokenizer_config.json's `chat_template` or chat_template.jinja beside the file) the
    prompt is that template's user turn and generation prompt, encoded as training encodes it (the template
    writes BOS itself), and a reply ends at the template's end-of-turn tokens; without one, the plain SFT
    template's `user:\\n{prompt}\\nassistant:\\n` (meshlm.data.sft), ended by the document separator."""

    def __init__(self, tokenizer_file: Path, vocab_size: int) -> None:
        self.file = tokenizer_file
        self.tokenizer = check_tokenizer(tokenizer_file, vocab_size)
        self.eos = document_separator(tokenizer_file, self.tokenizer)
        self.template = ChatTemplate(tokenizer_file, self.tokenizer) if chat_template_files(tokenizer_file) else None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if not chat:
            return self.tokenizer.encode(text).ids
        if self.template is None:  # the plain template's user turn, then the assistant's header
            return self.tokenizer.encode(f"user:\n{text}\nassistant:\n").ids
        rendered = self.template.render([("user", text)], str(self.file), generation_prompt=True)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    def stop_ids(self, chat: bool = False) -> list[int]:
        """What ends generation: the document separator, and in a chat also the template's end-of-turn tokens."""
        turn = self.template.end_of_turn_ids() if chat and self.template is not None else []
        return [self.eos, *(i for i in turn if i != self.eos)]

    def decode(self, ids: list[int], chat: bool = False) -> str:
        """The text of `ids`; a chat reply without the token that ended it."""
        if chat and ids and ids[-1] in self.stop_ids(chat=True):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)
