"""Resuming a run from its checkpoints: which one, read once, applied on every rank or on none.

Rank 0 alone reads, verifies and loads the newest committed checkpoint (one read of the shared
filesystem per job, and one decision on which step is good); the others receive the state over
the process group (``dist.broadcast_state``) and their own RNG state (``dist.scatter_object``).
With snapshots in memory (``memory.py``), the newest complete snapshot set at least as new as the
newest shared checkpoint is the first candidate, checked and applied as any checkpoint; the
shared filesystem is read only when it does not load.

A checkpoint that cannot be loaded is damaged, whatever the reason: the store skips a lying
manifest or a bad digest; here rank 0 skips a model.pt that does not fit the model, a train state
without a registered state or without an RNG state per rank, and every rank undoes a state that
its optimizer, scheduler or counters refuse (when any rank refuses, all undo). Each is skipped
with a warning naming it and set aside when the run reaches its step again; the previous one is
tried. When every committed checkpoint is damaged the run is refused (``RunFailed``, one line
naming each step and why, and how to start from step 0 on purpose): starting afresh would train
over the run's work and end with exit 0. A config that differs from the checkpoint's is refused
(``config.check_resume``), and so is other data than the checkpoint trained on, unless the launch
asks for it at an epoch boundary (``data_identity.judge_resume``; the pseudo-labels are dropped
then).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from clusterflow import config as cfgmod
from clusterflow.checkpoint.data_identity import DataIdentity, Position, judge_resume
from clusterflow.checkpoint.memory import SHARED, MemoryRestore, Restored
from clusterflow.checkpoint.rng import RngState, capture_rng, restore_rng
from clusterflow.checkpoint.sharded import ShardedState
from clusterflow.checkpoint.train_state import TrainState
from clusterflow.config.job_config import Config
from clusterflow.distributed import comm as dist
from clusterflow.errors import RunFailed, UserError
from clusterflow.rundir import saved_config
from clusterflow.storage.names import DCP, MODEL, TRAIN_STATE
from clusterflow.storage.store import Checkpoint, CheckpointStore, position

log = logging.getLogger("clusterflow.checkpointer")


@dataclasses.dataclass(frozen=True)
class Found:
    """What rank 0 tells every rank about this try (one broadcast): the checkpoint to resume, or
    nothing to resume (``path`` None), or why the run cannot resume (one of the three texts)."""

    path: str | None = None
    step: int = 0
    world_size: int = 0
    folder: str = ""  # the step's folder in the store (sharded checkpoints read from it)
    refused: str = ""  # every committed checkpoint damaged: the RunFailed line
    user_error: str = ""  # a config the checkpoint refuses: the UserError line
    error: str = ""  # rank 0 could not read at all (any other exception)
    new_data: bool = False  # resumed on other data (data.allow_change): drop the pseudo-labels
    tier: str = SHARED  # where the state comes from: memory, replica or shared


class Restorer:
    """One restore: ``states`` are the checkpointer's registered states (``state`` among
    them); ``data``: the identity of the data this attempt trains on (None: not compared)."""

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        states: Mapping[str, Any],
        state: TrainState,
        store: CheckpointStore,
        *,
        sharded: ShardedState | None = None,
        data: DataIdentity | None = None,
        memory: MemoryRestore | None = None,
    ) -> None:
        self.cfg, self.model, self.states, self.progress, self.store = (
            cfg,
            model,
            states,
            state,
            store,
        )
        # train.parallel=fsdp: the model and optimizers come from every rank's shards.
        self.sharded = sharded
        self.data = data
        self.memory = memory
        # Where the state came from: (tier, where, step), None when nothing was resumed.
        self.restored_from: tuple[str, str, int] | None = None
        self._first_tier = SHARED

    def restore(self) -> bool:
        """Collective, at the start of every attempt. Returns True when resumed.

        Rank 0 finishes what a killed writer left, then reads the newest checkpoint that verifies
        and fits the model, once; every rank receives it and applies it. Every way a checkpoint can
        fail to load makes it damaged: the store skips a lying manifest or a bad digest, rank 0 a
        model.pt that does not fit the model or a train state without a registered state, and a
        state that the optimizer, scheduler or counters refuse on any rank is undone everywhere.
        Each is skipped with a warning naming it (and set aside when the run reaches its step
        again), and the previous one is tried; a skipped checkpoint leaves the model, the states
        and the RNG as they were."""
        newest = self._newest_committed()
        first, restored = self.memory.assemble(newest) if self.memory else (None, None)
        self._first_tier = restored.tier if restored else SHARED
        skips = _Skips(self.store)
        while True:
            head, state, mine = self._receive_candidate(skips, first)
            if head.path is None:
                self.progress.data = self.data
                return False
            assert state is not None
            problem, undo, load_model = self._apply_everywhere(head, state, mine)
            if dist.any_rank(bool(problem)):
                if undo is not None:
                    undo()
                why = problem or "another rank could not load it (see its log)"
                skips.skip(head.path, head.step, why, head.tier)
                if head.tier != SHARED:
                    first = None  # the shared filesystem next
                continue
            load_model()
            self._resumed(head, mine is not None, restored)
            return True

    def _newest_committed(self) -> tuple[int, tuple[int, ...]] | None:
        """Collective: rank 0 finishes what a killed writer left; every rank learns the newest
        committed step and its position (None when there is none), or raises rank 0's error."""
        newest, failure = self._prepare() if dist.rank() == 0 else (None, None)
        newest = dist.broadcast_object(newest)
        if failure is not None:
            raise failure
        if isinstance(newest, str):
            raise RuntimeError(f"rank 0 could not read the checkpoints: {newest}")
        return newest

    def _receive_candidate(
        self, skips: _Skips, first: Checkpoint | None
    ) -> tuple[Found, dict[str, Any] | None, RngState | None]:
        """Collective: the next checkpoint to try, as rank 0 read it (``_read``), on every rank:
        what it is, its state, and this rank's RNG state (None on another world size); ``path``
        None when there is none. Raises on every rank what rank 0 found that refuses the run."""
        head, state, rngs, failure = (
            self._read(skips, first) if dist.rank() == 0 else (Found(), None, None, None)
        )
        head = dist.broadcast_object(head)
        if failure is not None:
            raise failure
        if head.user_error:
            raise UserError(head.user_error)
        if head.refused:
            raise RunFailed(head.refused)
        if head.error:
            raise RuntimeError(f"rank 0 could not read the checkpoint: {head.error}")
        if head.path is None:
            return head, None, None
        mine = dist.scatter_object(rngs) if head.world_size == dist.world() else None
        return head, dist.broadcast_state(state), mine

    def _apply_everywhere(
        self, head: Found, state: Mapping[str, Any], mine: RngState | None
    ) -> tuple[str, Callable[[], None] | None, Callable[[], None]]:
        """Collective: this rank applies the registered states and its RNG, and reads its shards
        when sharded. Returns (this rank's problem, "" when none; how to undo what was applied;
        how to load the model once every rank has applied without a problem)."""
        problem, undo = self._apply(state[TRAIN_STATE], mine)
        if self.sharded is None:
            # Keys and shapes were checked by rank 0: it cannot half-apply.
            return problem, undo, lambda: self.model.load_state_dict(state[MODEL])
        load_shards: Callable[[], None] = lambda: None  # never run: a problem skips the load
        try:  # collective: every rank reads, whatever its own states said
            load_shards = self.sharded.read(head.folder)
        except Exception as exc:  # noqa: BLE001 - any failure makes it unloadable
            problem = problem or (
                f"its shards do not load on rank {dist.rank()} ({type(exc).__name__}: "
                f"{str(exc)[:300]})"
            )
        return problem, undo, load_shards

    def _resumed(self, head: Found, own_rng: bool, restored: Restored | None) -> None:
        """After the checkpoint ``head`` loaded on every rank: its data and labels settled, the
        resume said, and where it came from recorded."""
        if not own_rng:
            log.warning(
                "resuming with %d ranks from a checkpoint of %d; "
                "per-rank RNG streams are re-derived",
                dist.world(),
                head.world_size,
            )
        p = self.progress
        if head.new_data:
            dropped = len(p.labels) if p.labels is not None else 0
            p.labels = None
            log.warning(
                "resumed on new data (data.allow_change=true): the pseudo-labels of %d "
                "samples dropped; epoch %d trains as before the first mining round",
                dropped,
                p.epoch + 1,
            )
        if self.data is not None:
            p.data = self.data
        log.info(
            "resumed from %s: epoch %d, step %d of the epoch, global step %d",
            head.path,
            p.epoch + 1,  # counted from 1, as the log lines of the steps count it
            p.step_in_epoch,
            p.global_step,
        )
        where = restored.where if head.tier != SHARED and restored else head.path
        self.restored_from = (head.tier, where, head.step)

    def _apply(
        self, saved: Mapping[str, Any], rng: RngState | None
    ) -> tuple[str, Callable[[], None] | None]:
        """Apply the registered states and this rank's RNG. Returns (problem, undo): on a problem
        nothing is changed; otherwise ``undo`` puts them back (another rank may still refuse)."""
        parts = self._parts(saved)
        before = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.states.items()}
        rng_before = capture_rng()

        def undo() -> None:
            for name, obj in self.states.items():
                obj.load_state_dict(before[name])
            restore_rng(rng_before)

        try:
            for name, obj in self.states.items():
                obj.load_state_dict(parts[name])
            if rng is not None:
                restore_rng(rng)
        # Any refusal of a saved state makes the checkpoint unloadable.
        except Exception as exc:  # noqa: BLE001
            undo()
            return f"train_state.pt does not fit this run ({type(exc).__name__}: {exc})", None
        return "", undo

    def _parts(self, saved: object) -> dict[str, Any]:
        """Each registered state's saved form; ValueError when one is missing."""
        if not isinstance(saved, dict):
            raise ValueError(
                "the manifest lists no train_state.pt"
                if saved is None
                else "train_state.pt holds no mapping"
            )
        parts = {}
        for name, obj in self.states.items():
            if name in saved:
                parts[name] = saved[name]
            elif obj is self.progress and "global_step" in saved:
                # A train_state.pt from before the train state was registered: its counters
                # are at the top level.
                parts[name] = saved
            else:
                raise ValueError(f"train_state.pt has no {name!r} state")
        return parts

    def _prepare(self) -> tuple[tuple[int, tuple[int, ...]] | str | None, BaseException | None]:
        """Rank 0: finish what a killed writer left; returns the newest committed step and its
        position (None when there is none, the error's text when the store cannot be read), and
        the error itself."""
        try:
            removed = self.store.clean_debris()
            if removed:
                log.warning(
                    "removed unfinished checkpoint folders left by a killed writer: %s",
                    ", ".join(removed),
                )
            steps = self.store.steps()
            if not steps:
                return None, None
            return (steps[-1], position(self.store.manifest(steps[-1]))), None
        # The other ranks must not wait for a broadcast that never comes.
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}", exc

    def _read(
        self, skips: _Skips, first: Checkpoint | None = None
    ) -> tuple[Found, dict[str, Any] | None, list[RngState] | None, BaseException | None]:
        """Rank 0: ``first`` (a snapshot set from memory), then the newest committed step not
        skipped yet that verifies and fits; each one that does not is skipped (``skips``).
        Returns (what every rank needs to know, the state without RNG, each rank's RNG, rank 0's
        error)."""
        try:
            from_memory = [first] if first is not None else []
            for ckpt in itertools.chain(
                from_memory, self.store.candidates(skip=skips.steps, damaged=skips.damaged)
            ):
                memory = ckpt is first
                tier = self._first_tier if memory else SHARED
                try:
                    model_state, saved = self._verify(ckpt)
                except ValueError as exc:
                    skips.skip(ckpt.path, ckpt.step, str(exc), tier)
                    continue
                new_data = self._check_data(ckpt.path, self._parts(saved)[self._progress_name()])
                saved = dict(saved)
                rngs = saved.pop("rng")
                return (
                    Found(
                        ckpt.path,
                        ckpt.step,
                        saved["world_size"],
                        self.store.step_path(ckpt.step),
                        new_data=new_data,
                        tier=tier,
                    ),
                    {MODEL: model_state, TRAIN_STATE: saved},
                    rngs,
                    None,
                )
            if skips.damaged:
                return Found(refused=self._refusal(skips.damaged)), None, None, None
            return Found(), None, None, None
        except UserError as exc:
            return Found(user_error=str(exc)), None, None, exc
        # The other ranks must not wait for a broadcast that never comes.
        except Exception as exc:  # noqa: BLE001
            return Found(error=f"{type(exc).__name__}: {exc}"), None, None, exc

    def _verify(self, ckpt: Checkpoint) -> tuple[object, dict[str, Any]]:
        """Rank 0: ``ckpt``'s model state and train state, when its config, its kind and its model
        fit this run and its train state holds every registered state and an RNG state per rank;
        ValueError naming what does not (UserError for a config the resume refuses)."""
        self._check_config(ckpt.path, ckpt.manifest)
        model_state, saved = ckpt.objects.get(MODEL), ckpt.objects.get(TRAIN_STATE)
        self._check_format(ckpt.manifest, model_state)
        self._parts(saved)
        assert isinstance(saved, dict)  # _parts refuses anything else
        world = saved.get("world_size")
        if (
            not isinstance(world, int)
            or not isinstance(saved.get("rng"), list)
            or len(saved["rng"]) != world
        ):
            raise ValueError("train_state.pt has no RNG state for each of its ranks")
        return model_state, saved

    def _refusal(self, damaged: Mapping[int, str]) -> str:
        """One line: every checkpoint is damaged, each step and why, and the way to start afresh
        on purpose (the damaged folders are left as they are, for inspection)."""
        root = self.store.root if self.store.local else self.store.url
        each = "; ".join(
            f"step-{step} ({_short(why)})" for step, why in sorted(damaged.items(), reverse=True)
        )
        aside = f"mv {root} {root}.damaged" if self.store.local else f"move them out of {root}"
        return (
            f"every checkpoint in {root} is damaged, so the run cannot resume from any: {each}. "
            f"Nothing was trained over them or deleted. To start from step 0 on purpose, set "
            f"them aside ({aside}) and launch the run again, or use a new run.dir"
        )

    def _progress_name(self) -> str:
        return next(name for name, obj in self.states.items() if obj is self.progress)

    def _check_data(self, path: str, train: object) -> bool:
        """Whether the checkpoint at ``path`` (its train state ``train``) trained on the data of
        this attempt: False when it did (or cannot say), True when it did not and the launch takes
        the new data at an epoch boundary; otherwise UserError naming both."""
        if self.data is None or not isinstance(train, dict):
            return False
        saved = DataIdentity.from_record(train.get("data"))
        ledger = train.get("ledger")
        if saved is None and isinstance(ledger, list) and ledger and isinstance(ledger[-1], dict):
            # A checkpoint of before data identities: the ledger's count of its last epoch.
            saved = DataIdentity.from_record({"samples": ledger[-1].get("samples")})
        step, sample = int(train.get("step_in_epoch", 0)), train.get("sample_in_epoch")
        if not isinstance(sample, int):  # a checkpoint that counted steps of train.batch_size
            sample = step * self.cfg.train.batch_size
        position = Position(int(train.get("epoch", 0)), sample, step)
        return judge_resume(
            saved, self.data, f"checkpoint {path}", position, self.cfg.data.allow_change
        )

    def _check_format(self, manifest: Mapping[str, Any], model_state: object) -> None:
        """ValueError unless the checkpoint is of this run's kind (sharded or one model.pt) and,
        for one model.pt, fits the model (a sharded one is checked by every rank as it loads)."""
        sharded = manifest.get("format") == DCP
        if sharded != (self.sharded is not None):
            raise ValueError(
                "it is a sharded checkpoint (train.parallel=fsdp) and this run is not"
                if sharded
                else "it holds one model.pt (train.parallel=ddp) and this run is sharded"
            )
        if not sharded:
            check_fits(self.model, model_state)

    def _check_config(self, path: str, manifest: Mapping[str, Any]) -> None:
        if "config" in manifest:
            if not isinstance(manifest["config"], dict):
                raise ValueError("the manifest's config is not a mapping")
            # As the manifest holds it (JSON: string keys, lists).
            now = json.loads(json.dumps(self.cfg.to_dict()))
            # A run's last checkpoint may train on (more epochs, a script's new arguments).
            end = saved_config.ends_run(manifest)
            cfgmod.check_resume(manifest["config"], now, f"checkpoint {path}", completed=end)
            return
        # Manifests of older versions carry only a hash, which cannot say what differs (or whether
        # a key was merely added by a newer clusterflow): a mismatch is a warning, not a refusal.
        want, got = self.cfg.fingerprint(), manifest.get("config_hash")
        if got and got != want:
            log.warning(
                "checkpoint %s was written with a different config (hash %s, now %s); "
                "resuming anyway",
                path,
                got,
                want,
            )


class _Skips:
    """The checkpoints one restore skipped as damaged, and the one way each is skipped: a warning
    naming it and what comes next; a shared step is also set aside in the store (moved away,
    like a bad digest, when the run reaches its step again), not tried again (``steps``) and
    named with its reason in the refusal when none is left (``damaged``, rank 0's)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.steps: set[int] = set()
        self.damaged: dict[int, str] = {}  # step -> why

    def skip(self, path: str, step: int, why: str, tier: str) -> None:
        """Skip the checkpoint at ``path`` (``step``, read from ``tier``) because of ``why``."""
        if tier != SHARED:  # a snapshot set: the shared filesystem is next
            log.warning("skipping %s: %s; falling back to the shared filesystem", path, why)
            return
        log.warning(
            "skipping damaged checkpoint %s: %s; %s",
            path,
            why,
            self.store.fallback(step, self.steps),
        )
        self.store.refuse(step, why)
        self.steps.add(step)
        self.damaged[step] = why


def check_fits(model: torch.nn.Module, state: object) -> None:
    """ValueError unless ``state`` has exactly the model's keys, each a tensor of its shape, so
    that ``load_state_dict`` cannot fail half-way (it copies matching entries before it raises)."""
    if state is None:
        raise ValueError("the manifest lists no model.pt")
    if not isinstance(state, dict):
        raise ValueError(f"model.pt holds a {type(state).__name__}, not a state_dict")
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(
            "model.pt does not fit the model: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    for key, t in want.items():
        got = state[key]
        if not torch.is_tensor(got) or got.shape != t.shape:
            seen = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise ValueError(
                f"model.pt does not fit the model: {key} is {seen} in the checkpoint, "
                f"{tuple(t.shape)} in the model"
            )


def _short(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut at ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
