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

from meshlm.data.dataset import document_separator
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
