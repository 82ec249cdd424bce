"""Supervised fine-tuning data (`data.format = "sft"`): .jsonl conversations, prompt tokens masked, packed rows.

Each line of a .jsonl file is one example: `{"prompt": ..., "response": ...}` (field names `data.prompt_field`,
`data.response_field`) or `{"messages": [{"role": ..., "content": ...}, ...]}` (`data.messages_field`; roles
system, user, assistant). A pair is the chat `[user: prompt, assistant: response]`.

Rendering: with the chat template of the tokenizer `model.init_from` brought (`chat_template` in its
tokenizer_config.json, or chat_template.jinja beside it; needs transformers), else the plain template

    system:\\n{content}\\n   user:\\n{content}\\n   assistant:\\n{content}<eos>

(text pieces encoded as they come, the eos token's id appended after each assistant message). The tokens of
each assistant message's content and its end-of-turn token are the labels; every other token is -100. Under a
chat template the end-of-turn token is the last special token the template writes in that assistant turn
(ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`); text after it (a newline) is masked. The first token of an
example is never a label, so a packed row never asks one example to predict the next.

Examples are tokenized once into a cache (`<cache_dir>/<key>/`: tokenizer.json, and per split the tokens, a
label mask and the examples' lengths, each with its sha256 in manifest.json), held out for validation as
text documents are (`data.val_fraction`, by example index). Rows are built at load time for `data.seq_len`:
a row holds `seq_len + 1` token slots (inputs are the first seq_len, targets the last seq_len). Whole examples
are packed greedily in corpus order (next fit: an example that does not fit the current row starts a new one;
`data.sft_packing = false`: one example per row), never split across rows; the rest of a row is padding
(the eos id) labelled -100. An example longer than `seq_len + 1` tokens is truncated to its first
`seq_len + 1` (a warning counts them); one left without a label token is dropped. Packed examples in one row
can attend to each other (no block-diagonal mask), as Hugging Face's plain packing does.

The rows then go through the same deterministic global-batch sampler as token windows (meshlm.data.sampler),
so every layout sees its slice of the same global batch and a checkpoint's data position resumes exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Encoding, Tokenizer

from meshlm.config import DataSection
from meshlm.data.dataset import (
    _install,
    cache_tokenizer,
    cached_manifest,
    check_tokenizer,
    is_val_document,
    staging_dir,
    token_dtype,
)
from meshlm.data.sampler import GlobalBatchSampler, eval_windows
from meshlm.data.shards import SPLITS
from meshlm.data.sources import DataError, _walk
from meshlm.errors import InputError
from meshlm.files import atomic_write, sha256_file
from meshlm.model.llama import IGNORE_INDEX

FORMAT = "sft-1"
ROLES = ("system", "user", "assistant")
IGNORE = IGNORE_INDEX  # the label of a position that is not trained on (prompt, padding), as in Hugging Face
# The arrays each split of the cache holds, with their dtypes (None: the token dtype of the vocabulary).
SPLIT_ARRAYS = {"tokens": None, "keep": np.uint8, "lengths": np.int64}

Message = tuple[str, str]  # (role, content)


# ---- reading examples -----------------------------------------------------------------------------------
def sft_files(cfg: DataSection) -> list[Path]:
    """The .jsonl files of `data.source` (one file, or every .jsonl under a folder sorted by relative path)."""
    path = Path(cfg.source)
    valid = "a .jsonl file or a folder of them"
    if path.is_dir():
        files = _walk(path, (".jsonl",), skip=set())
        if not files:
            raise DataError(f"data.source: {path} holds no .jsonl file; data.format = 'sft' reads {valid}")
        return files
    if not path.is_file():
        raise DataError(f"data.source: {path} not found; data.format = 'sft' reads {valid}")
    if path.suffix != ".jsonl":
        raise DataError(f"data.source: {path} is not a .jsonl file; data.format = 'sft' reads {valid}")
    return [path]


def iter_examples(cfg: DataSection) -> Iterator[tuple[str, list[Message]]]:
    """Every example of the source in corpus order, as ("file:line", messages); blank lines are skipped. Bad
    lines are one error at the end, the first one's reason and how many more there are (with where the next
    few are), so a fix is not one rerun per bad line; nothing is yielded after the first bad line."""
    bad: list[tuple[str, str]] = []
    for path in sft_files(cfg):
        with path.open(encoding="utf-8") as f:
            lineno = 0
            try:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        example = parse_example(line, where, cfg)
                    except DataError as e:
                        bad.append((where, str(e)))
                        continue
                    if not bad:
                        yield where, example
            except UnicodeDecodeError:
                bad.append((f"{path}:{lineno + 1}", f"{path}:{lineno + 1}: not UTF-8 text; convert the file to UTF-8"))
    if len(bad) > 1:
        listed = ", ".join(where for where, _ in bad[1:4]) + (", ..." if len(bad) > 4 else "")
        raise DataError(f"{bad[0][1]} (and {len(bad) - 1} more bad line(s): {listed})")
    if bad:
        raise DataError(bad[0][1])


def parse_example(line: str, where: str, cfg: DataSection) -> list[Message]:
    """One .jsonl line as a list of (role, content); a problem is one line naming `where` and the field."""
    expected = (
        f'each line must be a JSON object with "{cfg.messages_field}" (data.messages_field) or '
        f'"{cfg.prompt_field}" and "{cfg.response_field}" (data.prompt_field, data.response_field)'
    )
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise DataError(f"{where}: not valid JSON; {expected}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object; {expected}")
    if cfg.messages_field in record:
        return _messages(record[cfg.messages_field], where, cfg.messages_field)
    if cfg.prompt_field not in record and cfg.response_field not in record:
        raise DataError(f"{where}: no field {cfg.messages_field!r} or {cfg.prompt_field!r}; {expected}")
    prompt, response = record.get(cfg.prompt_field), record.get(cfg.response_field)
    if not isinstance(prompt, str):
        raise DataError(f"{where}: {cfg.prompt_field}: missing or not a string (data.prompt_field); {expected}")
    if not isinstance(response, str) or not response:
        raise DataError(
            f"{where}: {cfg.response_field}: missing, empty or not a string; an example needs the response to "
            "learn (data.response_field)"
        )
    return [("user", prompt), ("assistant", response)]


def _messages(value: object, where: str, name: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: {name}: must be a non-empty list of {{"role", "content"}} objects')
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f'{where}: {name}[{k}]: must be an object with "role" and "content"')
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: {name}[{k}].role: unknown role {role!r}; valid: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {name}[{k}].content: missing or not a string")
        if role == "assistant" and not content:
            raise DataError(f"{where}: {name}[{k}].content: an empty assistant message; give it the response")
        messages.append((role, content))
    if not any(role == "assistant" for role, _ in messages):
        raise DataError(
            f"{where}: {name}: no assistant message, so nothing to learn; add the response with role 'assistant'"
        )
    return messages


# ---- templates: messages -> (token ids, label mask) -------------------------------------------------------
def _labels_in(encoding: Encoding, spans: list[tuple[int, int]], end_tokens: set[int]) -> list[bool]:
    """Per token: whether it starts inside one of the character `spans`, up to and including the last token of
    `end_tokens` in that span (with none there, the whole span)."""
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    is_end = np.isin(np.array(encoding.ids, dtype=np.int64), list(end_tokens))
    keep = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        inside = np.flatnonzero((starts >= a) & (starts < b))
        ends = inside[is_end[inside]]
        last = ends[-1] if len(ends) else (inside[-1] if len(inside) else -1)
        keep[inside[inside <= last]] = True
    return keep.tolist()


class PlainTemplate:
    """The documented template used without a chat template (module docstring): text pieces encoded in turn,
    the eos id after each assistant message; labels are the assistant contents and their eos."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.name = "plain"

    @staticmethod
    def pieces(messages: list[Message]) -> list[tuple[str, tuple[int, int] | None]]:
        """(text, character span of the assistant content ending it or None) for each piece; every piece with
        a span is followed by the eos token."""
        out, text = [], ""
        for role, content in messages:
            text += f"{role}:\n"
            if role == "assistant":
                out.append((text + content, (len(text), len(text) + len(content))))
                text = ""
            else:
                text += f"{content}\n"
        return [*out, (text, None)] if text else out

    def encode(self, messages: list[Message], where: str) -> tuple[list[int], list[bool]]:
        ids, keep = [], []
        for k, (text, span) in enumerate(self.pieces(messages)):
            encoding = self.tokenizer.encode(text, add_special_tokens=k == 0)  # its post-processor's BOS first
            ids += encoding.ids
            keep += _labels_in(encoding, [span] if span else [], set())
            if span:
                ids.append(self.eos)
                keep.append(True)
        return ids, keep


def chat_template_files(tokenizer_file: Path | None) -> list[Path]:
    """The files that hold the chat template beside a given tokenizer.json (empty when it has none)."""
    if tokenizer_file is None:
        return []
    config_path = tokenizer_file.parent / "tokenizer_config.json"
    jinja = tokenizer_file.parent / "chat_template.jinja"
    files = [jinja] if jinja.is_file() else []
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_bytes())
        except ValueError:
            raise DataError(f"{config_path}: invalid JSON object") from None
        if isinstance(config, dict) and config.get("chat_template"):
            files.insert(0, config_path)
    return files


class ChatTemplate:
    """The Hugging Face chat template of a tokenizer directory, rendered by transformers. An assistant message's
    characters are those `render(messages[:k+1])` adds to `render(messages[:k], add_generation_prompt=True)`;
    its labels are the tokens there through the last special token (the end-of-turn)."""

    def __init__(self, tokenizer_file: Path, tokenizer: Tokenizer) -> None:
        directory = tokenizer_file.parent
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise DataError(
                f"{directory}: the tokenizer has a chat template; rendering it needs transformers: "
                "pip install meshlm[hf]"
            ) from None
        self.hf = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
        self.tokenizer = tokenizer
        self.end_tokens = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        self.name = f"chat template of {directory}"

    def render(self, messages: list[Message], where: str, generation_prompt: bool = False) -> str:
        chat = [{"role": role, "content": content} for role, content in messages]
        try:
            return self.hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja's raise_exception and template errors: any class
            raise DataError(f"{where}: the chat template refused this conversation: {str(e).splitlines()[0]}") from None

    def end_of_turn_ids(self) -> list[int]:
        """The special tokens the template writes to end an assistant turn (what generation stops at)."""
        messages: list[Message] = [("user", "Hi"), ("assistant", "Hello")]
        before = self.render(messages[:1], self.name, generation_prompt=True)
        turn = self.render(messages, self.name)[len(before) :]
        return [i for i in self.tokenizer.encode(turn, add_special_tokens=False).ids if i in self.end_tokens]

    def encode(self, messages: list[Message], where: str) -> tuple[list[int], list[bool]]:
        text = self.render(messages, where)
        spans = []
        for k, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            before = self.render(messages[:k], where, generation_prompt=True)
            through = self.render(messages[: k + 1], where)
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{where}: messages[{k}]: the chat template does not render this conversation turn by turn "
                    "(an earlier turn's text changes), so its response tokens cannot be told apart"
                )
            spans.append((len(before), len(through)))
        encoding = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        return encoding.ids, _labels_in(encoding, spans, self.end_tokens)


# ---- the cache ----------------------------------------------------------------------------------------------
def sft_cache_key(cfg: DataSection, vocab_size: int, tokenizer_file: Path | None) -> str:
    """Hash of everything the cached examples depend on (not seq_len or packing: rows are built at load)."""
    h = hashlib.sha256()
    for p in sft_files(cfg):
        st = p.stat()
        h.update(f"{p.absolute()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    inputs = {
        "format": FORMAT,
        "files": h.hexdigest(),
        "fields": [cfg.prompt_field, cfg.response_field, cfg.messages_field],
        "val_fraction": cfg.val_fraction,
        "vocab_size": vocab_size,
    }
    if tokenizer_file is not None:
        inputs["tokenizer_sha256"] = sha256_file(tokenizer_file)
        inputs["template_sha256"] = [sha256_file(p) for p in chat_template_files(tokenizer_file)]
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class SFTSplit:
    """One split's examples: their tokens one after another, a label mask (1 = trained on) and lengths."""

    tokens: np.ndarray
    keep: np.ndarray
    lengths: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)])

    def __len__(self) -> int:
        return len(self.lengths)


class PackedRows:
    """A split's examples in rows of seq_len + 1 slots (module docstring); `gather` builds rows on demand."""

    def __init__(self, split: SFTSplit, seq_len: int, packing: bool, pad_id: int, name: str) -> None:
        self.split, self.seq_len, self.packing, self.pad_id = split, seq_len, packing, pad_id
        width = seq_len + 1
        offsets = split.offsets
        self.starts = offsets[:-1]
        self.lengths = np.minimum(split.lengths, width)
        labels = np.concatenate([[0], np.cumsum(split.keep, dtype=np.int64)])
        kept = labels[self.starts + self.lengths] - labels[self.starts]
        self.examples = np.flatnonzero(kept > 0)  # an example truncated to no label is dropped
        truncated = int(np.sum(split.lengths > width))
        if truncated:
            logging.getLogger(__name__).warning(
                "data: %d of %d %s examples are longer than data.seq_len + 1 = %d tokens (the longest has %d) "
                "and were truncated; %d left without a response token were dropped",
                truncated, len(split), name, width, int(split.lengths.max()), len(split) - len(self.examples),
            )  # fmt: skip
        if not len(self.examples):
            raise DataError(
                f"data: no {name} example keeps a response token within data.seq_len + 1 = {width} tokens; "
                "raise data.seq_len or shorten the prompts"
            )
        self.first = self._pack(self.lengths[self.examples], width, packing)

    @staticmethod
    def _pack(lengths: np.ndarray, width: int, packing: bool) -> np.ndarray:
        """Row r holds examples first[r] .. first[r+1]-1: next fit in order (or one per row)."""
        if not packing:
            return np.arange(len(lengths) + 1)
        first, used = [], width
        for i, n in enumerate(lengths.tolist()):
            if used + n > width:
                first.append(i)
                used = 0
            used += n
        return np.array([*first, len(lengths)])

    def __len__(self) -> int:
        return len(self.first) - 1

    def row_examples(self, row: int) -> np.ndarray:
        """The indices (into the split) of the examples in `row`."""
        return self.examples[self.first[row] : self.first[row + 1]]

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(rows), seq_len) int64; a target is -100 where it is not a label."""
        width = self.seq_len + 1
        tokens = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        keep = np.zeros((len(rows), width), dtype=bool)
        for i, row in enumerate(np.asarray(rows).tolist()):
            column = 0
            for e in self.row_examples(row).tolist():
                start, n = int(self.starts[e]), int(self.lengths[e])
                tokens[i, column : column + n] = self.split.tokens[start : start + n]
                keep[i, column : column + n] = self.split.keep[start : start + n]
                column += n
        targets = np.where(keep[:, 1:], tokens[:, 1:], IGNORE)
        return torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(targets)


class PackedBatchSampler(GlobalBatchSampler):
    """GlobalBatchSampler over packed rows instead of token windows: the same (seed, step) order, dp slicing
    and resumable position."""

    def __init__(self, rows: PackedRows, global_batch: int, seed: int) -> None:
        self.rows = rows
        super().__init__(rows.split.tokens, rows.seq_len, global_batch, seed)

    def _count_windows(self) -> int:
        return len(self.rows)

    def _gather_windows(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.gather(windows)

    def state_dict(self) -> dict:
        return super().state_dict() | {"format": "sft", "rows": len(self.rows), "packing": self.rows.packing}

    def load_state_dict(self, state: dict) -> None:
        for name in ("format", "rows", "packing"):
            if state.get(name) != self.state_dict()[name]:
                raise ValueError(
                    f"sampler state mismatch: checkpoint has {name}={state.get(name)}, this run has "
                    f"{name}={self.state_dict()[name]}; resume with the same data and batch settings"
                )
        super().load_state_dict(state)


@dataclass
class SFTData:
    """Both splits' examples, the tokenizer and the padding id; rows are packed per seq_len when asked."""

    train: SFTSplit
    val: SFTSplit
    tokenizer: Tokenizer
    directory: Path
    manifest: dict
    packing: bool = True
    _rows: dict = field(default_factory=dict, repr=False)

    def rows(self, split: str, seq_len: int) -> PackedRows:
        if (split, seq_len) not in self._rows:
            examples = getattr(self, split)
            self._rows[split, seq_len] = PackedRows(examples, seq_len, self.packing, self.manifest["eos_id"], split)
        return self._rows[split, seq_len]

    def sampler(self, seq_len: int, global_batch: int, seed: int) -> PackedBatchSampler:
        return PackedBatchSampler(self.rows("train", seq_len), global_batch, seed)

    def eval_batches(
        self, seq_len: int, batch: int, n_batches: int, rank: int = 0, world: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same validation batches on every call: rows spread evenly over the split, this rank's share."""
        rows = self.rows("val", seq_len)
        for windows in eval_windows(len(rows), batch, n_batches, rank, world):
            yield rows.gather(windows)


def prepare_sft(
    cfg: DataSection, vocab_size: int, tokenizer_file: Path | None = None, builder: str = "inline"
) -> SFTData:
    """The cached, tokenized examples of `cfg` (built first if missing or damaged, as token caches are)."""
    if tokenizer_file is not None:
        check_tokenizer(tokenizer_file, vocab_size)
    key = sft_cache_key(cfg, vocab_size, tokenizer_file)
    directory = Path(cfg.cache_dir) / key
    manifest = cached_manifest(directory, key, builder, _read_sft_manifest)
    if manifest is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(directory.parent, key)
        try:
            _build_into(tmp, cfg, vocab_size, key, tokenizer_file, builder)
            _install(tmp, directory, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        manifest = _read_sft_manifest(directory, key)
    splits = {split: _open_split(directory, manifest, split) for split in SPLITS}
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return SFTData(splits["train"], splits["val"], tokenizer, directory, manifest, cfg.sft_packing)


def prepare_sft_shared(cfg: DataSection, vocab_size: int, tokenizer_file: Path | None = None) -> SFTData:
    """`prepare_sft` on every rank (collective): rank 0 builds or verifies the cache first, and its one-line
    problem, if any, stops every rank."""
    import torch.distributed as dist

    problem: list[str | None] = [None]
    data = None
    if dist.get_rank() == 0:
        try:
            data = prepare_sft(cfg, vocab_size, tokenizer_file)
        except InputError as e:
            problem = [str(e)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise DataError(problem[0])
    return data if data is not None else prepare_sft(cfg, vocab_size, tokenizer_file)


def _file_name(split: str, kind: str) -> str:
    return f"{split}-{kind}.bin"


def _read_sft_manifest(directory: Path, key: str) -> dict:
    """The manifest of a complete cache; raises if a file disagrees with it (size or sha256)."""
    manifest = json.loads((directory / "manifest.json").read_text())
    if manifest["key"] != key or manifest["format"] != FORMAT:
        raise ValueError(f"manifest.json is for key {manifest['key']} format {manifest['format']}")
    for split in SPLITS:
        for record in manifest["files"][split].values():
            path = directory / record["file"]
            if not path.is_file() or path.stat().st_size != record["bytes"]:
                raise DataError(
                    f"data: {path} is missing or does not have the {record['bytes']} bytes of manifest.json"
                )
            if sha256_file(path) != record["sha256"]:
                raise DataError(f"data: {path} does not match its sha256 in manifest.json")
    if sha256_file(directory / "tokenizer.json") != manifest["tokenizer_sha256"]:
        raise ValueError("tokenizer.json does not match the manifest's sha256")
    return manifest


def _open_split(directory: Path, manifest: dict, split: str) -> SFTSplit:
    arrays = {}
    for kind, dtype in SPLIT_ARRAYS.items():
        path = directory / manifest["files"][split][kind]["file"]
        arrays[kind] = np.fromfile(path, dtype=np.dtype(dtype or manifest["dtype"]))
    return SFTSplit(**arrays)


def _build_into(
    out: Path, cfg: DataSection, vocab_size: int, key: str, tokenizer_file: Path | None, builder: str
) -> None:
    start = time.perf_counter()
    texts = (
        text
        for i, (_, messages) in enumerate(iter_examples(cfg))
        if not is_val_document(i, cfg.val_fraction)
        for text, _ in PlainTemplate.pieces(messages)
    )
    tokenizer, eos = cache_tokenizer(out, tokenizer_file, vocab_size, texts)
    has_template = bool(chat_template_files(tokenizer_file))
    template = ChatTemplate(tokenizer_file, tokenizer) if has_template else PlainTemplate(tokenizer, eos)

    dtype = token_dtype(vocab_size)
    parts: dict[str, dict[str, list]] = {split: {kind: [] for kind in SPLIT_ARRAYS} for split in SPLITS}
    for i, (where, messages) in enumerate(iter_examples(cfg)):
        ids, keep = template.encode(messages, where)
        keep[0] = False  # no context within the example to predict it from
        part = parts["val" if is_val_document(i, cfg.val_fraction) else "train"]
        part["tokens"].append(np.asarray(ids, dtype=dtype))
        part["keep"].append(np.asarray(keep, dtype=np.uint8))
        part["lengths"].append(len(ids))
    counts = {split: len(parts[split]["lengths"]) for split in SPLITS}
    if counts["val"] == 0:
        raise DataError(
            f"data: {cfg.source} has only {counts['train']} example(s), too few to hold out data.val_fraction = "
            f"{cfg.val_fraction} of them for validation; add examples or raise data.val_fraction"
        )

    files: dict[str, dict] = {split: {} for split in SPLITS}
    for split in SPLITS:
        for kind, kind_dtype in SPLIT_ARRAYS.items():
            values = parts[split][kind]
            array = np.asarray(values, np.int64) if kind == "lengths" else np.concatenate(values)
            name = _file_name(split, kind)
            data = array.astype(kind_dtype or dtype).tobytes()
            (out / name).write_bytes(data)
            files[split][kind] = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    tokens = {split: int(sum(parts[split]["lengths"])) for split in SPLITS}
    labels = {split: int(sum(int(k.sum()) for k in parts[split]["keep"])) for split in SPLITS}
    manifest = {
        "format": FORMAT,
        "key": key,
        "source": cfg.source,
        "template": template.name,
        "vocab_size": vocab_size,
        "tokenizer_sha256": sha256_file(out / "tokenizer.json"),
        "eos_id": eos,
        "dtype": dtype.name,
        "examples": counts,
        "tokens": tokens,
        "labels": labels,
        "files": files,
        "builder": builder,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")  # last: the cache's commit
    logging.getLogger(__name__).info(
        "tokenized %d + %d examples of %s (%s) in %.1fs",
        counts["train"], counts["val"], cfg.source, template.name, time.perf_counter() - start,
    )  # fmt: skip
