"""The state of a save, copied into host memory off the training loop's path.

A save in the background needs its own copy of the state, because the loop goes on changing the
weights and the optimizer state in place while the writer serialises. :class:`Staging` copies it
into host buffers that it keeps between saves: one extra host copy of rank 0's state at most
(reused while shapes and dtypes stay the same; pinned for GPU tensors).

- At the step boundary (:meth:`Staging.take`, on the loop's thread) it records an event on the
  training stream and copies what may change before the next optimizer step: the model's
  buffers (BatchNorm statistics change in every forward), the small states (scheduler, scaler,
  counters, labels) and any tensor whose changes it cannot see. GPU tensors are copied on a side
  stream that waits for that event; the training stream then waits for the side stream on the
  device (the host does not wait).
- The model's parameters and the optimizers' state change only in ``optimizer.step``: the
  writer's thread copies them (:meth:`Staging.copy_rest`), and a step pre-hook on every optimizer
  holds the next step until they are copied (on a GPU the hook makes the training stream wait
  for the side stream's event; the host waits only until the copies are queued). Where other
  code may change them next (a script's own code after its epoch's loop), :meth:`Staging.settle`
  holds the loop the same way at once.
- Every deferred tensor's version counter (bumped by any in-place change) is compared with its
  value at the boundary: a tensor changed by something other than a gated ``optimizer.step``
  (a task updating a teacher network by hand) tears the snapshot, and that write fails
  (:class:`TornSnapshot`) instead of committing a state that never existed.

One GPU per rank (clusterflow's layout): tensors on another GPU, sparse or subclassed tensors are
copied to the host at the boundary, the plain blocking way. The first background save allocates
the buffers (pinned allocation is slow); later ones reuse them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from clusterflow.distributed import tree

# Each buffer's place in the arena (``one_storage``): aligned for any dtype's view.
_ALIGN = 64


class TornSnapshot(RuntimeError):
    """A deferred tensor changed before it was copied."""


@dataclass(eq=False)
class Snapshot:
    skeleton: Any  # tree.flatten's skeleton of the state
    paths: list[str]  # each tensor's place in the state, for messages
    sources: list[torch.Tensor]  # the live tensors, held until copied
    copies: list[torch.Tensor | None]
    # A tensor that is another one's view -> that one.
    alias: dict[int, int] = field(default_factory=dict)
    # Sparse, subclassed or on a second GPU: copied at once, no buffer.
    odd: set[int] = field(default_factory=set)
    rest: list[int] = field(default_factory=list)  # copied by the writer's thread
    versions: dict[int, int] = field(default_factory=dict)
    device: torch.device | None = None  # the GPU of the state's CUDA tensors, if any
    ready: torch.cuda.Event | None = None  # CUDA event on the training stream at the boundary
    done: torch.cuda.Event | None = None  # CUDA event on the side stream after the last copy
    copied: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    checked: bool = False
    gated: bool = False
    torn: str = ""


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and type(t) in (torch.Tensor, torch.nn.Parameter)


class Staging:
    """``one_storage``: every buffer a view of one arena, which the snapshots' codec writes in
    one piece (``storage/tensors.py``, PACKED); not for ``torch.save``, which refuses a storage
    viewed as two dtypes and would write the whole arena into each file."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Iterable[torch.optim.Optimizer],
        one_storage: bool = False,
    ) -> None:
        self.model, self.optimizers, self.one_storage = model, list(optimizers), one_storage
        self._buffers: dict[str, torch.Tensor] = {}  # by path (one_storage: views of one arena)
        self._layout: tuple[Any, ...] = ()  # what the buffers were arranged for
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: Snapshot | None = None
        # Time the loop waited in the hook, summed until read (and reset) by the owner.
        self.gate_s = 0.0
        self._hooks = [opt.register_step_pre_hook(self._gate) for opt in self.optimizers]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._buffers, self._layout, self._pending = [], {}, (), None

    # -- on the loop's thread -----------------------------------------------------------------
    def take(self, state: dict[str, Any]) -> Snapshot:
        """Start a snapshot of ``state`` (file name -> nested dicts/lists of tensors and small
        objects, as the checkpointer commits them)."""
        skeleton, tensors = tree.flatten(state, copy_leaves=True)
        paths = [s.path for s in tree.slots(skeleton)]
        snap = Snapshot(skeleton, paths, tensors, [None] * len(tensors))
        snap.device = next((t.device for t in tensors if t.is_cuda), None)
        if snap.device is not None:
            snap.ready = torch.cuda.Event()
            snap.ready.record(torch.cuda.current_stream(snap.device))
        # One GPU per rank is what the events cover; anything else is copied the plain, blocking
        # way.
        snap.odd = {
            i
            for i, t in enumerate(tensors)
            if not _plain(t) or (t.is_cuda and t.device != snap.device)
        }
        deferred = self._deferred_ptrs() if self.optimizers else set()
        first: dict[Any, int] = {}
        now = []
        for i, t in enumerate(tensors):
            key = (
                ("odd", i)
                if i in snap.odd
                else (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            )
            if key in first:
                snap.alias[i] = first[key]
                continue
            first[key] = i
            version = _version(t)
            if i not in snap.odd and t.data_ptr() in deferred and version is not None:
                snap.rest.append(i)
                snap.versions[i] = version
            else:
                now.append(i)
        self._arrange(snap, sorted(set(range(len(tensors))) - snap.odd - snap.alias.keys()))
        self._copy(snap, now)
        if snap.device is not None and any(snap.sources[i].is_cuda for i in now):
            done = torch.cuda.Event()
            done.record(self._stream(snap.device))
            torch.cuda.current_stream(snap.device).wait_event(done)
        self._pending = snap
        return snap

    def settle(self) -> None:
        """Hold the loop until the pending snapshot is copied whole: from here on anything, not
        only an optimizer step, may change the state in place."""
        self._gate()

    def _gate(self, *_: object) -> None:
        """Optimizer step pre-hook: the step changes deferred tensors, so they must be copied
        first."""
        snap = self._pending
        if snap is None or snap.gated:
            return
        t0 = time.perf_counter()
        snap.copied.wait()
        self._check(snap)  # before this step's kernels are queued (on a GPU the copy may still run)
        if snap.done is not None:
            torch.cuda.current_stream(snap.device).wait_event(snap.done)
        snap.gated = True
        self.gate_s += time.perf_counter() - t0
        return

    # -- on the writer's thread ---------------------------------------------------------------
    def copy_rest(self, snap: Snapshot) -> None:
        try:
            self._copy(snap, snap.rest)
            if snap.device is not None:
                done = torch.cuda.Event()
                done.record(self._stream(snap.device))
                snap.done = done
            else:
                self._check(snap)  # CPU copies are complete
        finally:
            snap.copied.set()  # never leave the loop waiting, even when a copy failed

    def result(self, snap: Snapshot) -> dict[str, Any]:
        """The state as host copies, once every copy is done; raises TornSnapshot."""
        return tree.unflatten(snap.skeleton, self._copies(snap))

    def parts(self, snap: Snapshot) -> dict[str, tree.Flat]:
        """The same, each file (the state's top-level key) still taken apart, for a codec that
        takes a :class:`~clusterflow.distributed.tree.Flat` (the snapshots')."""
        copies = self._copies(snap)
        parts: dict[str, dict[int, torch.Tensor]] = {name: {} for name in snap.skeleton}
        for i, path in enumerate(snap.paths):
            parts[path.split("/", 1)[0]][i] = copies[i]
        return {name: tree.Flat(snap.skeleton[name], parts[name]) for name in snap.skeleton}

    def _copies(self, snap: Snapshot) -> list[torch.Tensor]:
        if snap.done is not None:
            snap.done.synchronize()
        self._check(snap)
        snap.sources = []
        if snap.torn:
            raise TornSnapshot(snap.torn)
        return [snap.copies[snap.alias.get(i, i)] for i in range(len(snap.copies))]

    # -- helpers ------------------------------------------------------------------------------
    def _copy(self, snap: Snapshot, indices: list[int]) -> None:
        host: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (buffers, sources)
        with torch.no_grad():
            for i in indices:
                t = snap.sources[i]
                if i in snap.odd:
                    snap.copies[i] = t.detach().to("cpu", copy=True)
                    continue
                buf = self._buffers[snap.paths[i]]
                if t.is_cuda:
                    stream = self._stream(t.device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(snap.ready)
                        buf.copy_(t, non_blocking=True)
                        # The allocator must not reuse it before the copy ran.
                        t.record_stream(stream)
                else:
                    host[0].append(buf)
                    host[1].append(t)
                snap.copies[i] = buf
            if host[0]:
                # One call for every host tensor: a copy_ each costs more in dispatch than in
                # bytes for the small tensors most states hold.
                torch._foreach_copy_(*host)

    def _arrange(self, snap: Snapshot, indices: list[int]) -> None:
        """The host buffers of the tensors at ``indices``, kept while the tensors' layout stays
        the same (one copy of the state, no more); with ``one_storage``, views of one arena."""
        layout = tuple(
            (snap.paths[i], snap.sources[i].dtype, snap.sources[i].shape, snap.sources[i].stride())
            for i in indices
        )
        if layout == self._layout:
            return
        places, size = [], 0
        for i in indices:
            t = snap.sources[i]
            stride = torch.empty_like(t, device="meta").stride()  # t's when dense, else contiguous
            places.append((size, stride))
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pinned = any(snap.sources[i].is_cuda for i in indices)
        arena = None
        if self.one_storage:
            arena = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

        def buffer(t: torch.Tensor, start: int, stride: tuple[int, ...]) -> torch.Tensor:
            if arena is None:
                return torch.empty_strided(t.shape, stride, dtype=t.dtype, pin_memory=pinned)
            end = start + t.numel() * t.element_size()
            return arena[start:end].view(t.dtype).as_strided(t.shape, stride)

        self._buffers = {
            snap.paths[i]: buffer(snap.sources[i], start, stride)
            for i, (start, stride) in zip(indices, places)
        }
        self._layout = layout

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _deferred_ptrs(self) -> set[int]:
        """Storage of what changes only in optimizer.step: parameters and optimizer state."""
        ptrs = {p.data_ptr() for p in self.model.parameters()}
        for opt in self.optimizers:
            for per_param in opt.state.values():
                ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _check(self, snap: Snapshot) -> None:
        with snap.lock:
            if snap.checked:
                return
            snap.checked = True
            changed = [
                snap.paths[i] for i in snap.rest if _version(snap.sources[i]) != snap.versions[i]
            ]
        if changed:
            snap.torn = (
                f"{len(changed)} tensor(s) of the state changed before they were copied for the "
                f"background save, first {changed[0]}: something other than optimizer.step "
                "changes them in place; such a state cannot be saved in the background: "
                "set checkpoint.async=false"
            )
