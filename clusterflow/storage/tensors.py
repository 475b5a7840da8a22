"""torch's file formats for the store and the durable writer: the one place storage meets torch.

Checkpoint files are ``torch.save`` pickles that ``torch.load(path, weights_only=True)`` reads
without clusterflow. The job side passes :data:`TORCH` to :class:`~clusterflow.storage.store.
CheckpointStore` and to ``durable.write_atomic``; the login side never imports this module, so
``durable.py`` and ``store.py`` stay free of torch (the forbidden contract in pyproject.toml).

Snapshots in memory (``storage/snapshots.py``), written every few steps and read only by
clusterflow, use :data:`PACKED`: ``torch.save`` spends tens of microseconds of Python on each
tensor it pickles, which for a state of a few hundred tensors is most of a snapshot's cost.
A packed file is the state's skeleton (``distributed/tree.py``: the nesting, and each tensor's
storage, dtype, shape, stride and offset) pickled once, then the bytes of every storage the
tensors view, each once and 64-byte aligned::

    MAGIC | header length (8 bytes, little-endian) | header | padding | storage bytes ...

Read back, the skeleton is unpickled by an unpickler that admits only the types
``torch.load(weights_only=True)`` admits in such a skeleton (containers, scalars, dtypes,
devices, and the classes given to ``torch.serialization.add_safe_globals``); each tensor is a
view of the bytes read, with a storage of its own (tensors that shared one come back as
separate tensors of equal values; a tensor that reaches past its storage is refused). A state
with a tensor this format does not carry as raw bytes (sparse, quantized, a subclass, one that
requires grad, one on a GPU) is written with ``torch.save`` instead; the reader tells the two
apart by the magic.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections import Counter, OrderedDict
from typing import IO, Any

import torch

from clusterflow.distributed import tree
from clusterflow.storage.durable import Codec, Sink

MAGIC = b"cfpack1\n"
_ALIGN = 64
_PAD = bytes(_ALIGN)


def _load(source: str | IO[bytes]) -> Any:
    return torch.load(source, map_location="cpu", weights_only=True)


TORCH = Codec(dump=torch.save, load=_load, versions={"torch": torch.__version__})


def serialize(obj: object) -> bytes:
    """``obj`` as the bytes ``torch.save`` writes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _packable(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.is_quantized
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dump_packed(obj: object, f: Sink) -> None:
    """``obj``: a state, or one already taken apart (:class:`~clusterflow.distributed.tree.Flat`,
    what snapshots hand over)."""
    if isinstance(obj, tree.Flat):
        skeleton, tensors = obj.skeleton, obj.tensors
    else:
        skeleton, listed = tree.flatten(obj)
        tensors = dict(enumerate(listed))
    if not all(_packable(t) for t in tensors.values()):
        whole = obj.whole() if isinstance(obj, tree.Flat) else obj
        torch.save(whole, f)  # type: ignore[arg-type]  # torch.save only calls write and flush
        return
    # Like torch.save, each storage once: views of one storage are its bytes once, and a state
    # whose buffers are views of one arena (a snapshot's) is one write.
    storages: dict[int, int] = {}  # data_ptr -> index
    blobs: list[torch.UntypedStorage] = []
    metas = {}
    for slot, t in tensors.items():
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        index = storages.get(ptr) if ptr else None
        if index is None:
            index = len(blobs)
            blobs.append(storage)
            if ptr:
                storages[ptr] = index
        metas[slot] = (index, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
    sizes = [b.nbytes() for b in blobs]
    header = pickle.dumps((skeleton, sizes, metas), protocol=pickle.HIGHEST_PROTOCOL)
    start = len(MAGIC) + 8 + len(header)
    f.write(MAGIC)
    f.write(len(header).to_bytes(8, "little"))
    f.write(header)
    f.write(_PAD[: _aligned(start) - start])
    for blob, n in zip(blobs, sizes):
        if n:
            f.write(torch.empty(0, dtype=torch.uint8).set_(blob).numpy().data)
            f.write(_PAD[: _aligned(n) - n])


# What a skeleton may name, beyond the pickle protocol's own containers and scalars: what
# torch.load(weights_only=True) admits there.
_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "Counter"): Counter,
    ("clusterflow.distributed.tree", "Slot"): tree.Slot,
    ("torch", "device"): torch.device,
    ("torch", "Size"): torch.Size,
    **{("builtins", c.__name__): c for c in (set, complex, bytearray)},
    **{
        ("torch", str(d).removeprefix("torch.")): d
        for d in vars(torch).values()
        if isinstance(d, torch.dtype)
    },
}


class _Skeleton(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        for safe in torch.serialization.get_safe_globals():
            cls = safe[0] if isinstance(safe, tuple) else safe
            if (getattr(cls, "__module__", ""), getattr(cls, "__qualname__", "")) == (module, name):
                return cls
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a type a snapshot holds (torch.load(weights_only=True) "
            "would refuse it too; torch.serialization.add_safe_globals admits a class of yours)"
        )


def _load_packed(source: str | IO[bytes]) -> Any:
    if isinstance(source, str):
        with open(source, "rb") as f:  # read into the buffer the tensors will view: one copy
            data = bytearray(os.fstat(f.fileno()).st_size)
            if f.readinto(data) != len(data):
                raise ValueError(f"{source} changed size while it was read")
    else:
        data = bytearray(source.read())
    if not data.startswith(MAGIC):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    start = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC) : start], "little")
    if start + length > len(data):
        raise ValueError(f"its header of {length} bytes runs past its end ({len(data)} bytes)")
    skeleton, sizes, metas = _Skeleton(io.BytesIO(data[start : start + length])).load()
    starts, offset = [], _aligned(start + length)
    for n in sizes:
        if offset + n > len(data):
            raise ValueError(f"a storage of {n} bytes at byte {offset} runs past its end")
        starts.append(offset)
        offset += _aligned(n)
    tensors = {}
    for slot, (index, dtype, shape, stride, storage_offset) in metas.items():
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{dtype!r} is not a torch dtype")
        numel = math.prod(shape)
        extent = (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * dtype.itemsize
        first = storage_offset * dtype.itemsize
        if numel and first + extent > sizes[index]:
            raise ValueError(
                f"a tensor of shape {tuple(shape)} reaches past its storage of {sizes[index]} bytes"
            )
        # A storage of its own, a view of the bytes read: torch's RNG setters, for one, misread
        # a tensor that starts inside a larger storage.
        storage = (
            torch.frombuffer(data, dtype=torch.uint8, count=extent, offset=starts[index] + first)
            if numel
            else torch.empty(0, dtype=torch.uint8)
        ).untyped_storage()
        tensors[slot] = torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)
    return tree.unflatten(skeleton, tensors)


PACKED = Codec(
    dump=_dump_packed,
    load=_load_packed,
    versions={"torch": torch.__version__, "format": "packed-1"},
)
