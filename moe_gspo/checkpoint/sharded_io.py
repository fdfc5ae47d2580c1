"""megatron-core `dist_checkpointing` (torch DCP underneath) with nothing in a checkpoint unpickled as code.

    save_sharded({"model": model_sd, "optimizer": optim_sd}, DIR)    # collective; every rank writes its shards
    state = load_sharded(sharded_state_dict, DIR)                     # collective; each rank reads what it needs

`save_sharded` hands megatron's `dist_checkpointing.save` (torch_dist format) the ShardedTensors of a sharded state
dict, which writes
    DIR/__<rank>_<i>.distcp   this rank's shards (each tensor a `torch.save` blob, read back with weights_only=True)
    DIR/.metadata             torch DCP's global index (key -> global shape, dtype, chunk offsets), a pickle
    DIR/metadata.json         megatron's format name and version
and megatron's common.pt (a pickle of the non-tensor rest, empty here) is removed. The non-tensor state of an
optimizer (param groups, step) depends on the layout (one optimizer, or a dense and an expert one), so it is not
restored from the checkpoint: `load_sharded` keeps the values of the objects being loaded into and fills in only
the tensors (the caller restores the Adam step from its own JSON).

On load the pickled `.metadata` is read by `RestrictedUnpickler`, which resolves exactly the DCP metadata classes,
torch.Size, torch dtypes and torch's layout lookup and refuses any other global, so a `__reduce__` payload is never
called. Tensor blobs go through torch DCP's reader, which unpickles each with `torch.load(weights_only=True)`; any
failure there is reported with the file's name. ShardedObjects (opaque pickled objects: the `_extra_state` of
megatron's linear layers, None without Transformer Engine) are neither saved nor loaded.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import queue
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, extract_matching_values, merge,
                                                        nested_values)
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                     ShardedTensorFactory, is_main_replica)
from megatron.core.dist_checkpointing.strategies import filesystem_async as fs_async
from megatron.core.dist_checkpointing.strategies import torch as mtorch
from megatron.core.dist_checkpointing.strategies.base import LoadCommonStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.planner import LoadPlan

from moe_gspo.config import UserError

class UnsafeCheckpoint(UserError, RuntimeError):
    """A checkpoint file holds something that would run code, or is not what its name says (the message names
    the file)."""


# ------------------------------------------------------------------ the restricted unpickler
def _allowed() -> dict[tuple[str, str], object]:
    """(module, name) -> object: every global a torch DCP `.metadata` file written by megatron may name."""
    out: dict[tuple[str, str], object] = {("torch", "Size"): torch.Size,
                                          # rebuilds a layout (torch.strided) from its name; torch's own
                                          # weights_only unpickler allows it too
                                          ("torch.serialization", "_get_layout"): torch.serialization._get_layout}
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            out[("torch", name)] = getattr(torch, name)
    for mod, names in ((dcp_md, ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                 "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
                       (dcp_fs, ("_StorageInfo",)),
                       # megatron keeps every rank's save plan in the metadata (to reuse it on the next save)
                       (dcp_planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"))):
        for n in names:
            out[(mod.__name__, n)] = getattr(mod, n)
    return out


_ALLOWED = _allowed()


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals of a DCP metadata file (dataclasses and enums of torch.distributed.checkpoint,
    torch.Size, dtypes, torch's layout lookup); any other global is refused before anything is called."""

    def find_class(self, module: str, name: str):
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"refused to load global {module}.{name}")
        return obj


def read_metadata(path: Path) -> dcp_md.Metadata:
    """Unpickle a DCP `.metadata` file with RestrictedUnpickler; UnsafeCheckpoint if it names anything else or
    does not hold DCP metadata."""
    try:
        with open(path, "rb") as f:
            md = RestrictedUnpickler(f).load()
    except OSError as e:
        raise UnsafeCheckpoint(f"{path}: cannot be read ({e.strerror or e})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise UnsafeCheckpoint(f"{path}: not a torch DCP metadata file ({e})") from None
    if not isinstance(md, dcp_md.Metadata):
        raise UnsafeCheckpoint(f"{path}: holds a {type(md).__name__}, not torch DCP metadata")
    return md


class SafeReader(FileSystemReader):
    """torch DCP's file reader with the metadata read by RestrictedUnpickler (cached: megatron asks twice) and
    every failure to read a data file named by that file."""

    def __init__(self, path):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        if self._metadata is None:
            md = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_md.StorageMeta()
            md.storage_meta.load_id = self.load_id
            self._metadata = md
        return self._metadata

    def read_data(self, plan: LoadPlan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(LoadPlan(items, plan.storage_data, plan.planner_data), planner).wait()
            except Exception as e:  # noqa: BLE001 - weights_only refusals, truncation, bad offsets: all name the file
                raise UnsafeCheckpoint(f"{Path(self.path) / rel}: {_reason(e)}") from None
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _reason(e: Exception) -> str:
    """One line saying why a tensor blob did not load (torch's weights_only refusal names the global it blocked)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    if isinstance(e, pickle.UnpicklingError) and lines and lines[0].startswith("Weights only load failed"):
        named = [x for x in lines if "GLOBAL" in x or "Unsupported" in x]
        return f"refused by torch.load(weights_only=True): {named[0] if named else lines[-1]}"
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def failure_in(e: BaseException) -> UnsafeCheckpoint | None:
    """The UnsafeCheckpoint raised by a SafeReader on any rank, out of torch DCP's CheckpointException (which
    gathers every rank's failure), or None."""
    if isinstance(e, UnsafeCheckpoint):
        return e
    for exc, _trace in getattr(e, "failures", {}).values():
        if isinstance(exc, UnsafeCheckpoint):
            return exc
    return None


class SafeTorchDistLoad(mtorch.TorchDistLoadShardedStrategy):
    """megatron's torch_dist load strategy whose DCP readers are SafeReaders."""

    def load(self, sharded_state_dict, checkpoint_dir):
        with _safe_readers():
            return super().load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        with _safe_readers():
            return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        with _safe_readers():
            return super().load_sharded_metadata(checkpoint_dir)


@contextlib.contextmanager
def _safe_readers():
    """megatron's torch_dist strategy builds its DCP reader in `_get_filesystem_reader`; for the duration of one
    load that function returns a SafeReader."""
    original = mtorch._get_filesystem_reader
    mtorch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: SafeReader(checkpoint_dir)
    try:
        yield
    finally:
        mtorch._get_filesystem_reader = original


class NoCommonLoad(LoadCommonStrategy):
    """megatron's load with no common state read from disk: megatron's common.pt is a pickle, and the non-tensor
    state it would hold (the optimizer's param groups) is taken from the objects being loaded into."""

    def load_common(self, checkpoint_dir):
        return {}

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        raise UnsafeCheckpoint(f"{checkpoint_dir}: sharded objects are pickles; these checkpoints hold none")

    def load_sharded_metadata(self, checkpoint_dir):
        return {}

    def check_backend_compatibility(self, loaded_version):
        pass

    def check_version_compatibility(self, loaded_version):
        pass


@contextlib.contextmanager
def _in_process_results_queue():
    """megatron's writer forks a process per output file (two per rank) and collects their results through a queue that it otherwise takes
    from a `spawn` multiprocessing Manager: a server process that re-imports `__main__` and, when its rank is
    SIGKILLed, lives on (holding the job's stdout and stderr open). A synchronous save collects the results in
    this process, where a plain queue does."""
    original = fs_async._results_queue
    fs_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        fs_async._results_queue = original


@contextlib.contextmanager
def _writer_log_off():
    """megatron's writer logs a failed shard writer's exception ("Local process 1 encountered an error: ...")
    before raising it inside a CheckpointException; the raised one says the same, so the log is off while saving
    and the caller decides how much of the failure the user sees."""
    log = logging.getLogger(fs_async.__name__)
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


# ------------------------------------------------------------------ save / load
def _is_tensor(v) -> bool:
    return isinstance(v, (ShardedTensor, ShardedTensorFactory))


def bytes_to_write(sharded_state_dict: dict) -> int:
    """Bytes of tensor data this rank writes in `save_sharded`: the main replicas of its ShardedTensors (torch.save's
    framing of each tensor, about 1.5 KiB, comes on top)."""
    return sum(v.data.numel() * v.data.element_size() for v in nested_values(sharded_state_dict)
               if _is_tensor(v) and is_main_replica(v.replica_id))


def save_sharded(sharded_state_dict: dict, directory: Path) -> None:
    """Collective: every rank writes its shards of the ShardedTensors in `sharded_state_dict` into `directory`
    (which must exist and be empty); everything else in it is left out."""
    tensors, _ = extract_matching_values(sharded_state_dict, _is_tensor)
    with _in_process_results_queue(), _writer_log_off():
        dist_checkpointing.save(tensors, str(directory))
    if torch.distributed.get_rank() == 0:
        (directory / "common.pt").unlink(missing_ok=True)  # megatron's (empty) common dict, a pickle
    torch.distributed.barrier()  # every rank then sees the directory's final contents


def load_sharded(sharded_state_dict: dict, directory: Path) -> dict:
    """Collective: `sharded_state_dict` with every ShardedTensor replaced by its slice read from `directory` (each
    rank reads what its ShardedTensors ask for), ShardedObjects by None, LocalNonpersistentObjects unwrapped, and
    every other value kept as given."""
    tensors, rest = extract_matching_values(sharded_state_dict, _is_tensor)
    dict_list_map_inplace(_plain, rest)
    loaded = dist_checkpointing.load(tensors, str(directory), sharded_strategy=SafeTorchDistLoad(),
                                     common_strategy=NoCommonLoad())
    return merge(rest, loaded)


def _plain(v):
    if isinstance(v, ShardedObject):
        return None
    if isinstance(v, LocalNonpersistentObject):
        return v.unwrap()
    return v


def tensor_keys(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """key -> (global shape, dtype) of every tensor in a checkpoint directory (its `.metadata`, read safely)."""
    md = read_metadata(directory / ".metadata")
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, dcp_md.TensorStorageMetadata)}


def load_full(directory: Path, keys=None) -> dict[str, torch.Tensor]:
    """Whole (unsharded) tensors of a checkpoint directory by their sharded keys (all of them, or `keys`), on
    every rank: for tests and inspection. Collective."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    want = {k: ShardedTensor.from_rank_offsets(k, torch.empty(shape, dtype=dtype), replica_id=rank)
            for k, (shape, dtype) in tensor_keys(directory).items() if keys is None or k in keys}
    return dist_checkpointing.load(want, str(directory), sharded_strategy=SafeTorchDistLoad(),
                                   common_strategy=NoCommonLoad(), validate_access_integrity=False)
