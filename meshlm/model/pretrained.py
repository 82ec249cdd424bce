"""Initial weights from a Hugging Face checkpoint (`model.init_from`), read slice by slice.

The model is built on `meta` and the parallel engine asks its init source for exactly the elements each rank
keeps (meshlm.parallel.materialize): a tensor-parallel row or column slice, a ZeRO-3 flat range, or a whole
parameter of this rank's pipeline stage. `HFWeights.fill` reads that region with safetensors' lazy
`get_slice` (for a flat range, the fewest whole rows of the rank's tp slice that cover it), so no rank reads
a tensor, or part of one, it does not keep beyond the rows around its range. Stored dtypes (bf16 checkpoints)
are cast on the copy into the working buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from meshlm.files import atomic_copy
from meshlm.model.config import ModelConfig
from meshlm.model.hf import CONFIG_NAME, check_hf_checkpoint, hf_tensor_names, tied_names
from meshlm.model.init import TensorSlice, slice_offsets

TOKENIZER_NAME = "tokenizer.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# What an HF directory's tokenizer consists of (recent transformers save a chat template as chat_template.jinja),
# and how it generates (its stop ids and sampling defaults); a run keeps a copy so that its export, and an SFT
# run started from it, carry them.
TOKENIZER_FILES = (
    TOKENIZER_NAME, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", GENERATION_CONFIG_NAME
)  # fmt: skip


def is_hf_directory(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


class HFWeights:
    """Where each meshlm parameter of an HF checkpoint directory lies (file and tensor name), checked against
    the config from the headers when opened; `fill` reads only the requested region."""

    def __init__(self, directory: str | Path, cfg: ModelConfig | None = None) -> None:
        """`cfg`: the model the directory's config.json defines, if the caller has read it already."""
        self.directory = Path(directory)
        self.cfg, by_file = check_hf_checkpoint(self.directory, cfg)
        self.files = {name: path for path, names in by_file.items() for name in names}
        self.aliases = tied_names(self.cfg)  # HF stores a tied head once, as the embedding
        self._open: dict[Path, Any] = {}

    def tensor_name(self, name: str) -> str:
        """The stored tensor of meshlm parameter `name` (a tie's alias: its canonical name; a stacked MoE
        weight's: its first expert's)."""
        return hf_tensor_names(self.cfg, self.aliases.get(name, name))[0]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The region `index` (one slice per leading dimension) of stored tensor `name`; every read of the
        checkpoint's data goes through here."""
        path = self.files[name]
        try:
            if path not in self._open:
                self._open[path] = safe_open(path, framework="pt")
            return self._open[path].get_slice(name)[index]
        except SafetensorError as e:
            raise ValueError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0]})") from None

    @torch.no_grad()
    def fill(
        self,
        name: str,
        shape: Sequence[int],
        local_shape: Sequence[int],
        tp_slice: TensorSlice | None,
        start: int,
        out: torch.Tensor,
    ) -> None:
        """Write elements [start, start + out.numel()) of the flattened `local_shape` slice of parameter `name`
        (full shape `shape`, tensor-parallel slice at `tp_slice = (dim, offset)` or whole; a stacked expert
        weight may be sliced along its experts and its hidden units at once) into `out`."""
        if out.numel() == 0:
            return
        stored = self.tensor_name(name)
        cols = math.prod(local_shape[1:]) if len(local_shape) > 1 else 1
        end = start + out.numel()
        first, last = start // cols, (end - 1) // cols  # local rows the range touches
        experts = hf_tensor_names(self.cfg, name)
        if len(experts) > 1:  # a stacked MoE weight: its rows are experts, each stored whole as its own tensor
            slices = slice_offsets(tp_slice)  # experts (ep) along dim 0, hidden units (tp) along another
            expert0 = sum(offset for d, offset in slices if d == 0)
            index = [slice(None)] * (len(shape) - 1)
            for d, offset in slices:
                if d > 0:
                    index[d - 1] = slice(offset, offset + local_shape[d])
            parts = [self.read(experts[expert0 + e], tuple(index)) for e in range(first, last + 1)]
            rows = torch.stack(parts).reshape(-1)
            out.copy_(rows[start - first * cols : end - first * cols])
            return
        dim, offset = tp_slice if tp_slice is not None else (0, 0)
        if dim == 0:
            index = (slice(offset + first, offset + last + 1),)
        elif dim == 1 and len(shape) == 2:
            index = (slice(first, last + 1), slice(offset, offset + local_shape[1]))
        else:
            raise ValueError(f"{name}: a tensor-parallel slice of dim {dim} of {tuple(shape)} cannot be read")
        rows = self.read(stored, index).reshape(-1)
        out.copy_(rows[start - first * cols : end - first * cols])

    def close(self) -> None:
        self._open.clear()


def init_tokenizer(init_from: str | None) -> Path | None:
    """The tokenizer.json of an `init_from` directory (of a meshlm run: the copy it keeps), which the data
    pipeline then uses instead of training one; None without init_from or when there is none."""
    if init_from is None:
        return None
    path = Path(init_from)
    if not is_hf_directory(path) and (path / "trainer.json").is_file():
        path = path.parent.parent  # a checkpoint folder: its run keeps the tokenizer
    return path / TOKENIZER_NAME if (path / TOKENIZER_NAME).is_file() else None


def keep_tokenizer(run_dir: Path, tokenizer_file: Path) -> None:
    """Copy the run's tokenizer (and, beside a given one, its tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja and generation_config.json) into the run directory, where `meshlm convert meshlm-to-hf`
    finds it; each copy whole or not at all."""
    for name in TOKENIZER_FILES:
        src = tokenizer_file.parent / name
        if src.is_file():
            atomic_copy(src, run_dir / name)


def _run_of(src: Path) -> Path:
    return src.parent.parent if (src / "trainer.json").is_file() else src


def check_run_tokenizer(src: Path) -> None:
    """Refuse, naming the file, a run's tokenizer.json that the tokenizers library cannot load (damaged on
    disk): an export must not carry it silently."""
    from tokenizers import Tokenizer

    file = _run_of(src) / TOKENIZER_NAME
    if file.is_file():
        try:
            Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises its own Exception for any damage
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(
                f"{file} is not a loadable tokenizer ({reason}); restore it from the run's token cache "
                f"(data.cache_dir/<key>/tokenizer.json) or the model it was fine-tuned from"
            ) from None


def copy_run_tokenizer(src: Path, out: Path) -> list[str]:
    """The tokenizer files of a run directory, or of the run a checkpoint folder belongs to, copied into
    `out`; the names copied."""
    run_dir = _run_of(src)
    copied = [name for name in TOKENIZER_FILES if (run_dir / name).is_file()]
    for name in copied:
        atomic_copy(run_dir / name, out / name)
    return copied
