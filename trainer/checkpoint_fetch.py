"""Which files of a sharded checkpoint each rank reads, and the file layout that keeps that small.

A commit holds the DCP files of every rank that saved it (docs/checkpoints.md, "Layout and the
commit protocol"). At 8B parameters with AdamW that is ~96 GB, and a rank resuming FSDP needs
only its own slice of it, so `Checkpointer.load` downloads and verifies only the files this rank's load
will read, and `.metadata` (DCP's index), from which that set is worked out:

- `local_load_plan` builds this rank's read plan exactly as `dcp.load` does (same planner, same
  state dict), so the set also follows DCP when the world size changed since the save (a 1-rank
  save resumed on 2 ranks needs the one shard file on both);
- `files_needed` (pure) maps the plan's reads through `.metadata`'s `storage_data` to files.

The plan, not a naming rule (`__<rank>_*`), decides: DCP saves each replicated value (AdamW's
`step` counters, the RNG state, param groups, the loop's own state) once, in whichever rank's
file was smallest when it was planned, and every rank loads every such value. Left there, they
would make every rank need every other rank's shard file. `SplitWriter` therefore writes a
rank's DTensor shards to `__<rank>_0.distcp` and its share of the replicated values to
`__<rank>_1.distcp` (kilobytes): a rank then fetches its own shard file, the small files of
replicated values and `.metadata`. Commits written before the split still load; a rank just
fetches every file holding something it reads.
"""

from __future__ import annotations

import enum
import io
import pickle
import queue
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

METADATA = ".metadata"  # DCP's global index (torch.distributed.checkpoint.filesystem._metadata_fn)


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file would unpickle something other than DCP's own index types."""


# What DCP's `.metadata` holds (torch 2.x): its metadata dataclasses and enums, the file
# layout's _StorageInfo, torch.Size, dtypes and layouts, the writer's PosixPath. Anything else in
# a pickle (os.system, builtins.eval, ...) is code someone put there: whoever can write the
# bucket must not get to run it in every training pod.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                 ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
                 ("torch", "Size"), ("torch.serialization", "_get_layout"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                 ("collections", "OrderedDict")}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _enum_member(owner, name):
    """`builtins.getattr` as a pickle may use it: newer Pythons pickle an Enum member as
    `getattr(EnumClass, "NAME")` (DCP's index holds such members). Only that use is answered:
    a member, by name, of an enum class that itself came through the allow-list."""
    if (isinstance(owner, type) and issubclass(owner, enum.Enum) and isinstance(name, str)
            and name in owner.__members__):
        return owner[name]
    raise UnsafeCheckpoint(f"{METADATA} would call getattr({owner!r}, {name!r}), which is not an "
                           "enum member of a DCP index: refusing it")


class _IndexUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals ("Restricting Globals", the pickle docs):
    `find_class` answers only for the allow-list. torch.load(weights_only=True) has its own
    allow-list, but for tensors, not DCP's dataclasses."""

    def find_class(self, module: str, name: str):
        found = None
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS:
            found = super().find_class(module, name)
            if module in _SAFE_MODULES and not isinstance(found, type):
                found = None
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            found = getattr(torch, name)
        elif (module, name) == ("builtins", "getattr"):
            found = _enum_member
        if found is None:
            raise UnsafeCheckpoint(f"{METADATA} would load {module}.{name}, which is not part of "
                                   "a DCP index: refusing it (the file was written by something "
                                   "other than torch.distributed.checkpoint)")
        return found


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through the allow-list above (the body is
    FileSystemReader.read_metadata's, torch 2.x, with its `pickle.load` replaced)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = _IndexUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values (the loop's counters, RNG and optimizer
    settings) read by torch.load(weights_only=True): DCP's own `load_bytes` unpickles them
    without restriction (torch 2.x default_planner.py; this body is its, with that one flag)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_planner() -> DefaultLoadPlanner:
    """The planner of both `local_load_plan` and the `dcp.load` that follows: one factory, so the
    files fetched are the files read."""
    return SafeLoadPlanner()


def read_metadata(folder: Path) -> Metadata:
    """DCP's index in `folder`, unpickled through the allow-list (`UnsafeCheckpoint` otherwise)."""
    return SafeReader(str(folder)).read_metadata()


def local_load_plan(state: dict, metadata: Metadata) -> LoadPlan:
    """This rank's reads for `dcp.load(state)`, built as `dcp.load` builds them before its first
    collective (torch/distributed/checkpoint/state_dict_loader.py: `load`, then
    `_load_state_dict`'s `local_step`): each `Stateful` value's state_dict, in key order, then
    `set_up_planner` and `create_local_plan`. The later steps keep the reads: FileSystemReader's
    `prepare_local_plan` and `prepare_global_plan` return the plans unchanged, and so does
    DefaultLoadPlanner's `create_global_plan`. No collective is issued: the sharded state dict
    of an FSDP2 model is its DTensors, as they are."""
    flat = {key: value.state_dict() if isinstance(value, Stateful) else value
            for key, value in sorted(state.items())}
    planner = load_planner()
    planner.set_up_planner(flat, metadata, is_coordinator=False)
    return planner.create_local_plan()


def files_needed(metadata: Metadata, plan: LoadPlan) -> set[str]:
    """The files (relative to the step folder) that `plan`'s reads touch, and `.metadata`. Tensor
    chunks and non-tensor values alike: both are `ReadItem`s located by `storage_data`."""
    return {METADATA} | {metadata.storage_data[item.storage_index].relative_path
                         for item in plan.items}


class SplitWriter(FileSystemWriter):
    """DCP's file writer with a rank's DTensor shards and its replicated values in two files (see
    the module docstring): `__<rank>_0.distcp` always, `__<rank>_1.distcp` when DCP gave the rank
    replicated values to write. Everything else (staging, serialization, fsync) is
    FileSystemWriter's own."""

    def write_data(self, plan, planner):
        prefix = plan.storage_data.prefix  # "__<rank>_", set by prepare_global_plan
        shards = [item for item in plan.items if item.type == WriteItemType.SHARD]
        replicated = [item for item in plan.items if item.type != WriteItemType.SHARD]
        files: queue.Queue = queue.Queue()
        for number, items in enumerate((shards, replicated)):
            if items or number == 0:
                name = f"{prefix}{number}{DEFAULT_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, items))
        # `_write_data` is private: it is the half of FileSystemWriter.write_data that writes a
        # queue of (path, name, items) files, which the public half fills by its own split rule
        # (by size, across `thread_count` files) with no way to ask for this one. A torch that
        # renames it fails every save at once, loudly, in the checkpoint tests.
        return self._write_data(planner, files)
