"""The sharded part of a checkpoint: model and optimizer state written by every process as its
own shards with torch.distributed.checkpoint (DCP), and read back under any process count, by
a sharded or an unsharded model.  The checkpoint folder around it (atomic rename, checksums,
RNG, data position, config, tokenizer) is checkpoint.py's, as for an unsharded run:

    step-XXXXXXXX/
      sharded/.metadata          DCP's index: which tensor chunk is in which file, where
      sharded/__<rank>_0.distcp  each process's own shards of the model and optimizer state
      trainer_state.pt, rng_state_rank<R>.pt, config.yaml, tokenizer/, trainer_state.json

Keys are parameter names (`model.<name>`, `optim.state.<name>.exp_avg`, ...), and every tensor
is stored as the chunks its owners held, with its global shape: a reader of another world size
(or an unsharded model) asks DCP for the chunks it needs, and DCP reads those byte ranges.  No
process ever holds the whole model to save or load it.

Loading runs no code from the files.  DCP pickles its `.metadata` and reads it back with an
unrestricted unpickler, and decodes non-tensor entries (the optimizer's param_groups) with an
unrestricted torch load.  Here `.metadata` goes through an unpickler that builds only DCP's own
metadata classes (dataclasses of names, shapes, offsets and dtypes), and non-tensor entries
through torch's weights-only loader; the tensors themselves DCP already reads weights-only.  A
planted `__reduce__` payload is refused with one line, never run.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
import torch

from ..errors import CheckpointError

SHARDED_DIR = "sharded"
METADATA = ".metadata"
SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # what DCP's FileSystemWriter names them
MAX_METADATA_BYTES = 256 << 20

# What DCP's .metadata may name: its own dataclasses and the torch values inside them.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and torch dtypes, refuses any other global (and so any
    callable a payload would name)."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(folder: str):
    """DCP's Metadata of the shards in `folder`, read without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(folder, METADATA)
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
        if len(data) > MAX_METADATA_BYTES:
            raise ValueError(f"{len(data)} bytes")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refusing to load {file}: it names Python objects other than DCP's metadata "
            f"({exc}), which could run code; it was not written by bert-train (or was "
            f"tampered with): delete this checkpoint") from None
    except Exception as exc:  # EOFError, OSError, a truncated or edited stream
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot read {file} ({reason}); the checkpoint is "
                              f"corrupt") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} is not DCP metadata; the checkpoint is corrupt")
    for info in (metadata.storage_data or {}).values():
        # DCP reads byte ranges of the files named here: only shard files beside .metadata,
        # never a path out of the checkpoint
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not SHARD_FILE.match(name):
            raise CheckpointError(f"{file} points outside its shard files ({name!r}); the "
                                  f"checkpoint was edited or is corrupt")
    return metadata


def _reader(folder: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _planner(allow_partial: bool = False):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Non-tensor entries (the optimizer's hyperparameters) as plain data only."""

        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception:  # (weights-only refusal: an object that could run code)
                raise CheckpointError(
                    f"refusing to load {read_item.dest_index.fqn} from the shards: it holds "
                    f"Python objects other than tensors and plain data, which could run code; "
                    f"it was not written by bert-train (or was tampered with): delete this "
                    f"checkpoint") from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner(allow_partial_load=allow_partial)


def _load(folder: str, state: dict, collective: bool, allow_partial: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(folder)  # refused here, in one line, before DCP wraps the error per rank
    try:
        with warnings.catch_warnings():  # (no_dist is meant: DCP says it assumes so)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_reader(folder), planner=_planner(allow_partial),
                     no_dist=not collective)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # (DCP's wraps each rank's error)
        text = str(exc)
        if "refusing to load" in text:
            start = text.index("refusing to load")
            end = text.find("delete this checkpoint", start)
            raise CheckpointError(text[start:end] + "delete this checkpoint" if end > 0
                                  else text[start:].splitlines()[0]) from None
        raise CheckpointError(f"cannot load the shards in {folder} "
                              f"({text.splitlines()[0] if text else type(exc).__name__}); the "
                              f"checkpoint is corrupt or from another model") from None


def _collective(model) -> bool:
    """A sharded model loads with all processes together (each reads the chunks of its shards);
    a whole model loads on each process alone."""
    from .sharding import is_sharded

    return is_sharded(model)


# ------------------------------------------------------------------------------ writing
def save_shards(folder: str, model: torch.nn.Module, optimizer) -> list:
    """Every process writes its own shards of `model` and `optimizer` into `folder` (collective:
    all call it; DCP's coordinator, rank 0, writes `.metadata` once all have written).  Returns
    the names this process wrote."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state},
                 storage_writer=FileSystemWriter(folder, single_file_per_rank=True,
                                                 sync_files=True))
    except (Exception, CheckpointException) as exc:  # one rank's failed write fails them all
        text = str(exc)
        raise OSError(text.splitlines()[0] if text else type(exc).__name__) from None
    return own_files(folder, dist.get_rank() if dist.is_initialized() else 0)


def own_files(folder: str, rank: int) -> list:
    """The files of `folder` that process `rank` wrote (`__<rank>_*.distcp`; rank 0 also
    `.metadata`), as names relative to the folder."""
    prefix = f"__{rank}_"
    return sorted(n for n in os.listdir(folder)
                  if n.startswith(prefix) or (rank == 0 and n == METADATA))


# ------------------------------------------------------------------------------ reading
def load_model_shards(folder: str, model: torch.nn.Module) -> None:
    """The model weights of the shards in `folder` into `model` (sharded or whole, any process
    count): for export, fine-tuning, init_from."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, \
        set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    _load(folder, state, _collective(model), allow_partial=True)
    set_model_state_dict(model, state["model"])


def load_training_shards(folder: str, model: torch.nn.Module, optimizer) -> None:
    """Model and optimizer state of the shards in `folder` into `model` and `optimizer`
    (sharded or whole: DCP reads the chunks each process needs, whatever the saving layout)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _load(folder, state, _collective(model))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load_whole_optimizer(model: torch.nn.Module, optimizer, saved: dict) -> None:
    """An unsharded checkpoint's optimizer state (`optimizer.pt`: keyed by position in the
    optimizer's parameter groups) into the optimizer of the sharded `model`.  The sharded
    optimizer was built from the same parameter list in the same order (optim.param_groups),
    so position i is the same parameter; keyed by name, DCP's helper shards each state tensor
    as its parameter is sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, \
        set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved_order = [i for g in saved["param_groups"] for i in g["params"]]
    if len(saved_order) != len(order):
        raise CheckpointError(f"the checkpoint's optimizer holds {len(saved_order)} parameters, "
                              f"this model {len(order)}; it is from another model")
    by_position = dict(zip(saved_order, order))
    state = {"state": {by_position[i]: s for i, s in saved["state"].items()},
             "param_groups": [{**g, "params": [by_position[i] for i in g["params"]]}
                              for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True))


def is_sharded_checkpoint(state: dict) -> bool:
    """Whether a checkpoint's train state lists sharded model/optimizer state."""
    return any(name.startswith(SHARDED_DIR + "/") for name in state.get("files", {}))
