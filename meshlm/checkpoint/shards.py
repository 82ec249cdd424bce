"""Describing one rank's pieces of global tensors to torch.distributed.checkpoint (DCP), and reading safely.

meshlm's strategies hold parameters in shapes DCP does not know: tensor-parallel slices, and ZeRO flat shards
that cut across parameters (a shard can start in the middle of a row). Every such piece is a union of at most
a few rectangular boxes of the global tensor, so each rank describes its pieces as `Chunks` (box offsets +
local views) and DCP does the rest: one file per rank on save, and on load the intersection of the boxes this
rank needs with the boxes that were saved, under any other layout or world size (resharding).

Nothing here unpickles arbitrary objects: tensors are read with `weights_only=True` by DCP, the `.metadata`
file through an allow-list of DCP's own metadata classes, and byte (pickled) entries are refused.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The rectangular boxes, in row-major order, that elements [start, stop) of a flattened `shape` cover:
    a partial leading row, a block of whole rows and a partial trailing row (recursively in more dims)."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []

    def rows_part(row: int, lo: int, hi: int) -> None:
        boxes.extend(((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi))

    if start % inner:
        row, end = start // inner, min(stop, (start // inner + 1) * inner)
        rows_part(row, start % inner, end - row * inner)
        start = end
    if (full := (stop - start) // inner) > 0:
        boxes.append(((start // inner,) + (0,) * (len(shape) - 1), (full, *shape[1:])))
        start += full * inner
    if start < stop:
        rows_part(start // inner, 0, stop - start)
    return boxes


@dataclass
class Chunks:
    """This rank's boxes of one global tensor: `views[i]` holds elements [offsets[i], offsets[i] + its shape).

    The views alias live storage (parameters, optimizer moments, or a staging copy), so saving reads and loading
    writes them in place. Replicas describing the same box are written once (DCP deduplicates by offset)."""

    global_shape: torch.Size
    offsets: list[tuple[int, ...]]
    views: list[torch.Tensor]

    def size(self) -> torch.Size:  # DCP compares this with the saved size before loading
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                    properties=TensorProperties(dtype=view.dtype),
                    size=self.global_shape,
                ),
            )
            for offsets, view in zip(self.offsets, self.views, strict=True)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape)
            for o, v in zip(self.offsets, self.views, strict=True)
        ]

    def view_at(self, offsets: Sequence[int]) -> torch.Tensor:
        return self.views[self.offsets.index(tuple(offsets))]

    def staged(self, take: Any) -> Chunks:
        """The same boxes over copies made by `take(view)` (a slice of a staging buffer, filled)."""
        return Chunks(self.global_shape, list(self.offsets), [take(v) for v in self.views])


def _lookup(state: dict[str, Any], index: MetadataIndex) -> torch.Tensor:
    obj = state[index.fqn]
    return obj.view_at(index.offset) if isinstance(obj, Chunks) else obj


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's save planner, taught to find the tensor of a box in a `Chunks` entry."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's resharding load planner over `Chunks` entries; refuses pickled (non-tensor) entries."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=allow_partial_load)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # The default set-up rebuilds meta-device tensors and drops objects it does not know (ours); there
        # are no meta tensors here, so set up on nothing and keep the entries as they are.
        super().set_up_planner({}, metadata, is_coordinator)
        self.state_dict = self.original_state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise pickle.UnpicklingError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; refused")


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class; refused")


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled through an allow-list instead of plain pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
