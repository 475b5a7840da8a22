"""Sharded checkpoints (``train.parallel=fsdp``): every rank writes and reads its own shards.

The model's and the optimizers' state are DTensor shards; they go through
``torch.distributed.checkpoint`` (DCP) into the step's staging folder: each rank writes
``__<rank>_<n>.distcp`` in parallel with the others, rank 0 also the global ``.metadata``, and
each rank then hashes the files it wrote (reading them back) so the manifest can list every
file with its size and digest. Everything else (scheduler, scaler, counters, labels, RNG) is
small and goes to ``train_state.pt`` as in a DDP checkpoint, written by rank 0, which commits the
folder only when every rank's files are written and hashed (``checkpointer.py``). Each rank's
file also holds the checkpoint's id and step (the entry ``checkpoint.rank<R>``), and
``.metadata`` records the id as DCP's ``save_id``: :func:`carried` reads them back for
``identity.check``.

Reading is collective too: DCP plans which saved shard pieces each rank needs for its current
shards, so a checkpoint of 4 ranks loads on 2 or 3 (resharding weights and optimizer state,
values unchanged). The shards are loaded into copies and applied only when every rank has
loaded them, so a checkpoint that fails to load on any rank leaves every rank's model as it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from clusterflow.distributed import comm as dist
from clusterflow.distributed import sharding
from clusterflow.storage import durable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import StorageMeta

METADATA = ".metadata"  # DCP's global plan, written by rank 0
TAGS = "checkpoint"  # the DCP state's entry of each rank's id and step: checkpoint.rank<R>


def _clone(obj: object) -> Any:
    """The same nesting with every tensor copied (DTensors keep their sharding)."""
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.detach().clone()
    return obj


def holds_shards(obj: object) -> bool:
    """Whether a registered state's ``state_dict`` holds DTensors (a second sharded model, a
    dict of sharded tensors): every rank saves and loads its own part of it."""
    if isinstance(obj, torch.optim.Optimizer) or not callable(getattr(obj, "state_dict", None)):
        return False

    def walk(v: object) -> bool:
        if sharding.is_dtensor(v):
            return True
        if isinstance(v, dict):
            return any(walk(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return any(walk(x) for x in v)
        return False

    return walk(obj.state_dict())  # type: ignore[union-attr]


class ShardedState:
    """The sharded part of a checkpoint: ``model`` (an FSDP2 module) and ``states`` by the names
    they are registered under: optimizers (each over the parameters of the model, or of another
    registered module, it steps), and states whose ``state_dict`` holds DTensors (the EMA
    weights, a second model)."""

    def __init__(self, model: torch.nn.Module, states: Mapping[str, Any]) -> None:
        self.model, self.states = model, dict(states)
        modules = [model, *(o for o in self.states.values() if isinstance(o, torch.nn.Module))]
        owner = {id(p): m for m in modules for p in m.parameters()}
        # Each optimizer's model: the module whose parameters it steps.
        self.model_of = {
            name: owner.get(id(opt.param_groups[0]["params"][0]), model)
            for name, opt in self.states.items()
            if isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["params"]
        }

    def state_dict(self) -> dict[str, Any]:
        """Collective: each rank's shards, keyed by parameter name (what DCP reshards by)."""
        state_dicts = sharding.state_dicts()
        out = {"model": state_dicts.get_model_state_dict(self.model)}
        for name, obj in self.states.items():
            out[name] = (
                state_dicts.get_optimizer_state_dict(self.model_of.get(name, self.model), obj)
                if isinstance(obj, torch.optim.Optimizer)
                else obj.state_dict()
            )
        return out

    def snapshot(self) -> dict[str, Any]:
        """Collective: a copy of this rank's shards, for a write in the background while the
        loop changes the live ones."""
        return _clone(self.state_dict())

    def write(
        self,
        folder: str,
        fsync: bool,
        state: dict[str, Any] | None = None,
        group: ProcessGroup | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Collective (over ``group``, default: the default group): write this rank's shards
        (``state``, a snapshot, or the live state) and ``tag`` (the checkpoint's id and step,
        the same on every rank) into ``folder`` (rank 0: the metadata too) and hash them.
        Returns this rank's files as manifest entries."""
        state = self.state_dict() if state is None else state
        if tag is not None:
            state = {**state, TAGS: {f"rank{dist.rank()}": dict(tag)}}
        writer = _writer_class()(folder, fsync, tag["id"] if tag is not None else None)
        with plain_errors():
            sharding.dcp().save(state, storage_writer=writer, process_group=group)
        mine = sorted(f for f in os.listdir(folder) if f.startswith(f"__{dist.rank()}_"))
        if dist.rank() == 0:
            mine.append(METADATA)
        return {name: _entry(os.path.join(folder, name)) for name in mine}

    def read(self, folder: str) -> Callable[[], None]:
        """Collective: load the shards this rank needs from ``folder`` into copies. Returns what
        puts them into the model and optimizers; raises when they do not load."""
        target = _clone(self.state_dict())
        dcp, state_dicts = sharding.dcp(), sharding.state_dicts()
        with plain_errors():
            dcp.load(target, storage_reader=dcp.FileSystemReader(folder))

        def apply() -> None:
            state_dicts.set_model_state_dict(self.model, target["model"])
            for name, obj in self.states.items():
                if isinstance(obj, torch.optim.Optimizer):
                    model = self.model_of.get(name, self.model)
                    state_dicts.set_optimizer_state_dict(model, obj, target[name])
                else:
                    obj.load_state_dict(target[name])

        return apply


@functools.cache
def _writer_class() -> type:
    """DCP's writer of one file per rank, whose ``.metadata`` records ``ident`` (the checkpoint's
    id) as its save id (a class made at the first write: its base is DCP's)."""

    class Writer(sharding.dcp().FileSystemWriter):
        def __init__(self, folder: str, fsync: bool, ident: str | None) -> None:
            super().__init__(folder, single_file_per_rank=True, sync_files=fsync, thread_count=1)
            self.ident = ident

        def storage_meta(self) -> StorageMeta | None:
            meta = super().storage_meta()
            if self.ident is not None and meta is not None:
                meta.save_id = self.ident
            return meta

    return Writer


def carried(
    folder: str, files: Mapping[str, Any]
) -> tuple[str | None, dict[str, dict[str, Any] | None]]:
    """(the save id ``.metadata`` records, each ``.distcp`` file in ``files`` -> the tag it holds,
    None for none), read in this process. ValueError when ``.metadata`` names a file that
    ``files`` (the manifest) does not list, or when they cannot be read."""
    dcp = sharding.dcp()
    reader = dcp.FileSystemReader(folder)
    try:
        meta = reader.read_metadata()
        named = {info.relative_path for info in meta.storage_data.values()}
        where = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
        keys = [k for k in meta.state_dict_metadata if k.startswith(f"{TAGS}.")]
        values: dict[str, Any] = dict.fromkeys(keys)
        if keys:
            with warnings.catch_warnings(), plain_errors():  # "... load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(values, storage_reader=reader, no_dist=True)
    except Exception as exc:  # noqa: BLE001 - whatever DCP raises on a damaged file
        raise ValueError(
            f"the checkpoint ids in {METADATA} and the shards cannot be read "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    unlisted = sorted(named - set(files))
    if unlisted:
        raise ValueError(
            f"{METADATA} names {', '.join(unlisted)}, which the manifest does not list"
        )
    tags: dict[str, dict[str, Any]] = {}
    for key in keys:  # checkpoint.rank<R>.id, checkpoint.rank<R>.step
        tags.setdefault(where[key], {})[key.rsplit(".", 1)[-1]] = values[key]
    save_id = getattr(meta.storage_meta, "save_id", None)
    return save_id, {name: tags.get(name) for name in files if name.endswith(".distcp")}


@contextlib.contextmanager
def plain_errors() -> Iterator[None]:
    """DCP reports a failure on any rank as a ``CheckpointException`` (a BaseException holding
    every failed rank's traceback) on every rank; raise the failure itself instead (this rank's,
    else the lowest failed rank's), so a full disk or a damaged file reads as what it is."""
    try:
        yield
    except BaseException as exc:
        if not sharding.is_checkpoint_failure(exc):
            raise
        failures = exc.failures
        mine = failures.get(dist.rank()) or failures[min(failures)]
        raise mine[0] from None


def _entry(path: str) -> dict[str, Any]:
    algorithm, _ = durable.new_hash()
    return {"size": os.path.getsize(path), algorithm: durable.hash_file(path, algorithm)}
