"""Each rank fetches only the checkpoint files its part of the load reads (checkpoint_fetch.py).

The mapping from DCP's load plan to files is checked on its own (synthetic index, then a real
DCP save in this process with one file per value); two torchrun resumes against the stack's S3
show what each rank downloads when the world size stays the same (about half) and when it grows
(everything: both new slices cut across the one old shard file), and that training continues as
a straight run does.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo  # what FileSystemWriter records
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from crucible.trainer.checkpoint_fetch import (METADATA, files_needed, load_planner,
                                               local_load_plan, read_metadata)
from tests.support.training import job_config, write_config
from tests.trainer.chaos import BATCH, TrainProcess, config, train_records
from tests.trainer.chaos import ckpt  # noqa: F401 - a fixture: pytest finds it by its name here

STEPS = 16


def _read(fqn: str, offset: tuple[int, ...] | None, kind=LoadItemType.TENSOR) -> ReadItem:
    index = MetadataIndex(fqn, offset)
    size = torch.Size([4]) if offset is not None else torch.Size([])
    return ReadItem(kind, index, torch.Size([0]), index, torch.Size([0]), size)


def test_files_needed_maps_every_read_through_the_index():
    """An 8-row weight saved by two ranks (rows 0-3 in rank 0's file, 4-7 in rank 1's) and a step
    counter saved once, in rank 1's file of replicated values."""
    w = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([8]), [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
        ChunkStorageMetadata(torch.Size([4]), torch.Size([4]))])
    metadata = Metadata({"w": w, "step": BytesStorageMetadata()}, storage_data={
        MetadataIndex("w", (0,)): _StorageInfo("__0_0.distcp", 0, 64),
        MetadataIndex("w", (4,)): _StorageInfo("__1_0.distcp", 0, 64),
        MetadataIndex("step"): _StorageInfo("__1_1.distcp", 0, 9)})
    rank0 = LoadPlan([_read("w", (0,)), _read("step", None, LoadItemType.BYTE_IO)])
    assert files_needed(metadata, rank0) == {METADATA, "__0_0.distcp", "__1_1.distcp"}
    one_rank_now = LoadPlan([_read("w", (0,)), _read("w", (4,))])  # resharded: both chunks
    assert files_needed(metadata, one_rank_now) == {METADATA, "__0_0.distcp", "__1_0.distcp"}
    assert files_needed(metadata, LoadPlan([])) == {METADATA}


class _Part:
    """A `Stateful` like the loop's parts: the plan must ask it for its state, as dcp.load does."""

    def __init__(self, **state):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True: on purpose
def test_the_files_of_the_load_plan_are_enough_to_load(tmp_path):
    """A real DCP save with one file per value: a state that reads some values needs exactly their
    files, and dcp.load succeeds from a folder holding only those."""
    saved = {"app": {"model": {"w": torch.arange(6.0), "b": torch.ones(2)},
                     "train": {"step": 7, "tokens": 700}}}
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path / "all", single_file_per_rank=False),
             no_dist=True)
    metadata = read_metadata(tmp_path / "all")
    file_of = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    assert len(set(file_of.values())) == 4

    wanted = {"app": _Part(model={"w": torch.zeros(6)}, train={"step": 0})}
    needed = files_needed(metadata, local_load_plan(wanted, metadata))
    assert needed == {METADATA, file_of["app.model.w"], file_of["app.train.step"]}

    (tmp_path / "some").mkdir()
    for name in needed:
        shutil.copy(tmp_path / "all" / name, tmp_path / "some" / name)
    dcp.load(wanted, storage_reader=FileSystemReader(tmp_path / "some"), planner=load_planner(),
             no_dist=True)
    assert torch.equal(wanted["app"].state["model"]["w"], torch.arange(6.0))
    assert wanted["app"].state["train"] == {"step": 7}
    everything = {"app": _Part(model={"w": torch.zeros(6), "b": torch.zeros(2)},
                               train={"step": 0, "tokens": 0})}
    assert files_needed(metadata, local_load_plan(everything, metadata)) == \
        {METADATA, *file_of.values()}


# --- two ranks on the stack's S3 ------------------------------------------------------------------
FETCHED = re.compile(r"restore of \S+/step_(\d+): rank (\d+) fetched (\d+) of (\d+) bytes "
                     r"\(\d+%\): (.*)")


def fetched(log: str) -> dict[int, tuple[int, int, list[str]]]:
    """{rank: (bytes fetched, bytes in the commit, files)} from rank 0's restore log lines."""
    return {int(m[2]): (int(m[3]), int(m[4]), m[5].split(", ")) for m in FETCHED.finditer(log)}


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> list[dict]:
    """The train records of 16 steps on 2 ranks without a break (and without checkpoints)."""
    out = tmp_path_factory.mktemp("straight")
    cfg = job_config(corpus, out / "run", name="chaos", steps=STEPS, batch_tokens=BATCH,
                     evalTokens=4096)
    run = TrainProcess(write_config(cfg, out / "straight.yaml"), out / "straight.log")
    assert run.finish() == 0, run.text()[-3000:]
    return train_records(out / "run" / "metrics.jsonl")


def _stop_and_resume(corpus, tmp_path, uri: str, env: dict, *, save_nproc: int) -> tuple[str, list]:
    """Train 8 of 16 steps on `save_nproc` ranks, then resume on 2: (resume's log, records)."""
    cfg = config(corpus, tmp_path, "run", uri, steps=STEPS, every=8)
    first = TrainProcess(cfg, tmp_path / "first.log", nproc=save_nproc, env=env,
                         extra_args=["--max-steps", "8"])
    assert first.finish() == 0, first.text()[-3000:]
    second = TrainProcess(cfg, tmp_path / "second.log", env=env)
    assert second.finish() == 0, second.text()[-3000:]
    log = second.text()
    assert f"(step 8, saved by {save_nproc} ranks, now 2)" in log, log[-3000:]
    return log, train_records(tmp_path / "run" / "metrics.jsonl")


def test_on_the_same_world_size_each_rank_fetches_its_own_shards(corpus, tmp_path, ckpt, straight):
    uri, env = ckpt
    log, records = _stop_and_resume(corpus, tmp_path, uri, env, save_nproc=2)
    ranks = fetched(log)
    assert sorted(ranks) == [0, 1], log[-3000:]
    for rank, (count, total, files) in ranks.items():
        print(f"rank {rank} fetched {count} of {total} bytes ({100 * count / total:.1f}%): {files}")
        assert count <= 0.6 * total
        assert f"__{rank}_0.distcp" in files and f"__{1 - rank}_0.distcp" not in files
        assert METADATA in files
    # Both ranks fetch only the index and the replicated values (kilobytes); the rest once.
    assert sum(count for count, _, _ in ranks.values()) < 1.1 * ranks[0][1]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # fp32 on CPU, same world size and seeds: the resumed run is the straight run, bitwise.
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in records] == \
           [(r["loss"], r["grad_norm"], r["lr"]) for r in straight]


def test_on_more_ranks_each_rank_fetches_what_its_new_slice_cuts_across(
        corpus, tmp_path, ckpt, straight):
    """Saved by 1 rank, resumed on 2: each new half of every tensor lies in the one old shard
    file, so both ranks need all of it; the run continues as 2 ranks from the start would."""
    uri, env = ckpt
    log, records = _stop_and_resume(corpus, tmp_path, uri, env, save_nproc=1)
    ranks = fetched(log)
    assert sorted(ranks) == [0, 1], log[-3000:]
    for rank, (count, total, files) in ranks.items():
        print(f"rank {rank} fetched {count} of {total} bytes: {files}")
        assert count == total and "__0_0.distcp" in files
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # 8 steps on 1 rank then 8 on 2 vs 16 on 2: only float summation order differs.
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in straight],
                               rtol=0, atol=1e-3)



def _index_bytes(obj, *, members_by_name: bool) -> bytes:
    """`obj` pickled as DCP writes `.metadata`; with `members_by_name`, every Enum member the way
    newer Pythons pickle them (`getattr(EnumClass, "NAME")`), whatever this Python does
    (`reducer_override`: the pickle docs, "Custom Reduction for Types, Functions, and Other
    Objects")."""
    import enum
    import io
    import pickle

    class Writer(pickle.Pickler):
        def reducer_override(self, value):
            if members_by_name and isinstance(value, enum.Enum):
                return getattr, (type(value), value.name)
            return NotImplemented

    out = io.BytesIO()
    Writer(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


class _GetattrOnAClass:
    """Pickles as getattr(PosixPath, "home"): an allow-listed class, but not an enum member."""

    def __reduce__(self):
        import pathlib

        return getattr, (pathlib.PosixPath, "home")


@pytest.mark.parametrize("by_name", [False, True], ids=["by_value", "by_name"])
def test_the_index_reader_takes_enum_members_however_python_pickles_them(tmp_path, by_name):
    """A real index (DCP's own save) read back through the allow-list, with its enum members
    pickled by value (older Pythons) and by name (newer ones: getattr(cls, name))."""
    import pickle

    from crucible.trainer.checkpoint_fetch import SafeReader, UnsafeCheckpoint

    dcp.save({"w": torch.ones(4, 4)}, storage_writer=FileSystemWriter(str(tmp_path)))
    with open(tmp_path / METADATA, "rb") as file:
        metadata = pickle.load(file)
    (tmp_path / METADATA).write_bytes(_index_bytes(metadata, members_by_name=by_name))
    assert (b"getattr" in (tmp_path / METADATA).read_bytes()) == by_name
    read = SafeReader(str(tmp_path)).read_metadata()
    assert read.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    # getattr for anything but an enum member is still refused.
    (tmp_path / METADATA).write_bytes(pickle.dumps(_GetattrOnAClass(), protocol=pickle.HIGHEST_PROTOCOL))
    with pytest.raises(UnsafeCheckpoint, match="not an enum member"):
        SafeReader(str(tmp_path)).read_metadata()
