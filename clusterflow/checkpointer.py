"""The one owner of checkpoints in a run: when one is due, what goes in it, writing and reading it.

The loop only says what happened (:data:`STEP`, :data:`EPOCH_END`, :data:`STOP`); the checkpointer
decides whether a save is due:

- every ``checkpoint.every_steps`` optimizer steps, except at the last step of an epoch, which is
  saved after its eval and mining instead (so the labels of a finished round are in it);
- at the end of every epoch (after eval and mining);
- on a stop (a signal agreed by every rank).

What is saved is registered, not listed (torchtitan's ``CheckpointManager(states=...)``): ``model``
goes to ``model.pt`` as a plain state_dict, and every object in ``states`` (anything with
``state_dict``/``load_state_dict``) to ``train_state.pt`` under its name, beside every rank's RNG
state. The manifest carries the train state's ``position``, so the state after the end-of-epoch
work supersedes a stop checkpoint taken at the same step before it (see store.py).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any, Callable, Mapping, Protocol

from clusterflow import config as cfgmod
from clusterflow import dist, phases
from clusterflow.saved_config import portable
from clusterflow.state import capture_rng, restore_rng
from clusterflow.store import CheckpointStore
from clusterflow.train_state import TrainState

log = logging.getLogger("clusterflow.checkpointer")

STEP, EPOCH_END, STOP = "step", "epoch end", "stop"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class Checkpointer:
    def __init__(self, cfg: Any, model: Any, states: Mapping[str, Stateful], progress: TrainState, steps_per_epoch: int,
                 attempt: int = 0, tracker: phases.Phases | None = None,
                 before_commit: Callable[[str], None] | None = None) -> None:
        c = cfg.checkpoint
        self.store = CheckpointStore(cfg.checkpoint_dir, c.keep_last, c.fsync)
        self.cfg, self.model, self.states, self.progress = cfg, model, dict(states), progress
        self.every_steps, self.steps_per_epoch, self.attempt = c.every_steps, steps_per_epoch, attempt
        self.phases = tracker or phases.Phases()
        self.before_commit = before_commit  # collective; raises to refuse a state (the trainer: non-finite)

    def due(self, event: str) -> bool:
        if event != STEP:
            return True
        p = self.progress
        return p.global_step % self.every_steps == 0 and p.step_in_epoch < self.steps_per_epoch

    def save(self, event: str) -> float | None:
        """Collective when due: every rank hands its RNG state to rank 0, which commits. Returns the
        seconds the commit took on rank 0, None elsewhere and when nothing was committed."""
        if not self.due(event):
            return None
        if self.before_commit is not None:
            self.before_commit(event)
        with self.phases.enter(phases.CHECKPOINT):
            rngs = dist.gather_object(capture_rng())
            seconds = self._commit(rngs) if dist.rank() == 0 else None
            dist.barrier()
        return seconds

    def _commit(self, rngs: list[Any] | None) -> float | None:
        t0 = time.perf_counter()
        p = self.progress
        train_state = {name: obj.state_dict() for name, obj in self.states.items()}
        train_state.update(rng=rngs, world_size=dist.world())  # one RNG entry per rank
        # Objects, not bytes: the store streams them through torch.save, hashing as it writes.
        files = {"model.pt": self.model.state_dict(), "train_state.pt": train_state}
        meta = {"epoch": p.epoch, "step_in_epoch": p.step_in_epoch, "global_step": p.global_step,
                "position": list(p.position), "config_hash": self.cfg.fingerprint(), "config": portable(self.cfg.to_dict()),
                "world_size": dist.world(), "attempt": self.attempt}
        path = self.store.save(p.global_step, files, meta)
        if not path:
            return None
        seconds = time.perf_counter() - t0
        log.info("checkpoint step %d committed at %s (%.2f s)", p.global_step, path, seconds)
        return seconds

    def restore(self) -> bool:
        """Collective, at the start of every attempt: rank 0 finishes what a killed writer left,
        then every rank loads the newest checkpoint that verifies *and* loads. Returns True when resumed.

        Every way a checkpoint can fail to load makes it damaged: the store skips a lying manifest
        or a bad hash, and here a model.pt that does not fit the model or a train state that the
        optimizer, scheduler or counters refuse is skipped with a warning naming it, and the previous
        one is tried. A skipped checkpoint leaves the model, the states and the RNG as they were,
        and every rank skips the same ones (they agree before anything is applied to the model)."""
        if dist.rank() == 0:
            removed = self.store.clean_debris()
            if removed:
                log.warning("removed unfinished checkpoint folders left by a killed writer: %s", ", ".join(removed))
        dist.barrier()
        for ckpt in self.store.candidates():
            problem, undo, model_state = self._stage(ckpt)
            if dist.any_rank(bool(problem)):
                if undo is not None:
                    undo()
                why = problem or "another rank could not load it (see its log)"
                log.warning("skipping damaged checkpoint %s: %s; falling back to the previous one", ckpt.path, why)
                self.store.refused[ckpt.step] = why  # set aside, like a bad hash, when the run gets there again
                continue
            self.model.load_state_dict(model_state)  # keys and shapes checked in _stage: it cannot half-apply
            p = self.progress
            log.info("resumed from %s: epoch %d, step %d of the epoch, global step %d", ckpt.path, p.epoch, p.step_in_epoch, p.global_step)
            return True
        return False

    def _stage(self, ckpt: Any) -> tuple[str, Callable[[], None] | None, Any]:
        """Check one checkpoint against the model and apply its registered states and RNG.
        Returns (problem, undo, model state): on a problem nothing is changed; otherwise ``undo``
        puts the states and RNG back (another rank may still refuse it)."""
        try:
            self._check_config(ckpt.path, ckpt.manifest)
            model_state, saved = ckpt.objects.get("model.pt"), ckpt.objects.get("train_state.pt")
            _check_fits(self.model, model_state)
            parts = self._parts(saved)
        except ValueError as exc:
            return str(exc), None, None
        before = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.states.items()}
        rng = capture_rng()

        def undo() -> None:
            for name, obj in self.states.items():
                obj.load_state_dict(before[name])
            restore_rng(rng)

        try:
            for name, obj in self.states.items():
                obj.load_state_dict(parts[name])
            if saved["world_size"] == dist.world():
                restore_rng(saved["rng"][dist.rank()])
            else:
                log.warning("resuming with %d ranks from a checkpoint of %d; per-rank RNG streams are re-derived",
                            dist.world(), saved["world_size"])
        except Exception as exc:  # noqa: BLE001 - any refusal of a saved state makes the checkpoint unloadable
            undo()
            return f"train_state.pt does not fit this run ({type(exc).__name__}: {exc})", None, None
        return "", undo, model_state

    def _parts(self, saved: Any) -> dict[str, Any]:
        """Each registered state's saved form; ValueError when one is missing."""
        if not isinstance(saved, dict):
            raise ValueError("the manifest lists no train_state.pt" if saved is None else "train_state.pt holds no mapping")
        parts = {}
        for name, obj in self.states.items():
            if name in saved:
                parts[name] = saved[name]
            elif obj is self.progress and "global_step" in saved:
                parts[name] = saved  # written before the train state was registered: its counters at the top level
            else:
                raise ValueError(f"train_state.pt has no {name!r} state")
        world = saved.get("world_size")
        if not isinstance(world, int) or not isinstance(saved.get("rng"), list) or len(saved["rng"]) != world:
            raise ValueError("train_state.pt has no RNG state for each of its ranks")
        return parts

    def _check_config(self, path: str, manifest: Mapping[str, Any]) -> None:
        if "config" in manifest:
            if not isinstance(manifest["config"], dict):
                raise ValueError("the manifest's config is not a mapping")
            now = json.loads(json.dumps(self.cfg.to_dict()))  # as the manifest holds it (JSON: string keys, lists)
            cfgmod.check_resume(manifest["config"], now, f"checkpoint {path}")
            return
        # Older manifests carry only a hash, which cannot say what differs (or whether a key was
        # merely added by a newer clusterflow): warn, as those versions did.
        want, got = self.cfg.fingerprint(), manifest.get("config_hash")
        if got and got != want:
            log.warning("checkpoint %s was written with a different config (hash %s, now %s); resuming anyway", path, got, want)

    def committed_epoch(self) -> int:
        """Epochs finished in the newest committed checkpoint, from its manifest (-1: none)."""
        manifest = self.store.newest_manifest()
        return int(manifest.get("epoch", -1)) if manifest else -1

    def close(self) -> None:
        """Leave no half-deleted old step behind at exit."""
        self.store.wait_for_pruning()


def _check_fits(model: Any, state: Any) -> None:
    """ValueError unless ``state`` has exactly the model's keys, each a tensor of its shape, so
    that ``load_state_dict`` cannot fail half-way (it copies matching entries before it raises)."""
    import torch

    if state is None:
        raise ValueError("the manifest lists no model.pt")
    if not isinstance(state, dict):
        raise ValueError(f"model.pt holds a {type(state).__name__}, not a state_dict")
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"model.pt does not fit the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                         f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for key, t in want.items():
        got = state[key]
        if not torch.is_tensor(got) or got.shape != t.shape:
            seen = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise ValueError(f"model.pt does not fit the model: {key} is {seen} in the checkpoint, {tuple(t.shape)} in the model")
