"""The models ``run.setup`` placed and wrapped: one call per model (a GAN's generator and
discriminator, a teacher and a student), each on the run's device and wrapped for the world
(``parallel.py``: DDP, or FSDP2 with ``train.parallel=fsdp``), its optimizer following its
shards; and, for any of them, the plain module (what a checkpoint saves, what an embedding
calls) and the wrapper (what ``run.accumulate`` keeps from synchronizing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from clusterflow.config.job_config import Config
from clusterflow.distributed import comm as dist
from clusterflow.errors import UserError
from clusterflow.train import parallel

Units = Sequence[torch.nn.Module] | Callable[[torch.nn.Module], Sequence[torch.nn.Module]] | None


class Models:
    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        amp: torch.dtype | None,
        seed_ranks: Callable[[int], None],
    ) -> None:
        self.cfg, self.device, self.amp, self.seed_ranks = cfg, device, amp, seed_ranks
        self.world = dist.world()
        self._plain: dict[int, torch.nn.Module] = {}  # setup's input and output -> the module
        self._wrapper: dict[int, torch.nn.Module] = {}  # the module -> what setup returned
        self.modules: list[torch.nn.Module] = []  # every plain module, in setup's order
        self._seeded = False

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        shard_units: Units,
        hook: Callable[..., None],
    ) -> torch.nn.Module:
        """``model`` on the device, wrapped; ``hook`` a forward hook on the plain module. The
        first call gives every rank a random stream of its own from here on."""
        if not isinstance(model, torch.nn.Module):
            raise UserError(
                f"run.setup(model): expected a torch.nn.Module, got {type(model).__name__}"
            )
        if id(model) in self._plain or parallel.is_wrapped(model):
            raise UserError(
                "run.setup(model): this model is set up (wrapped) already; set each model up "
                "once and keep what run.setup returned"
            )
        cfg, world = self.cfg, self.world
        # A model compiled before run.setup: the compiled module runs, its original is what
        # is sharded, saved and embedded (its parameters are the same ones).
        compiled = model if isinstance(_original(model), torch.nn.Module) else None
        if cfg.dist.sync_batchnorm and world > 1 and compiled is None:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        runs = model.to(self.device)
        module = _original(runs) if compiled is not None else runs
        if cfg.train.parallel == "fsdp":
            units = shard_units(module) if callable(shard_units) else shard_units
            names = {id(p): n for n, p in module.named_parameters()}
            parallel.wrap_fsdp(
                module,
                list(parallel.default_units(module) if units is None else units),
                self.device,
                world,
                self.amp,
            )
            wrapped = runs
            if optimizer is not None:
                parallel.rebind(optimizer, names, module)
        elif world > 1:
            wrapped = parallel.wrap_ddp(runs, self.device, cfg.dist)
        else:
            wrapped = runs
        for m in (model, runs, module, wrapped):
            self._plain[id(m)] = module
        self._wrapper[id(module)] = wrapped
        self.modules.append(module)
        # On the compiled module, when there is one: the hook runs outside its graphs.
        runs.register_forward_hook(hook)
        if not self._seeded:
            # Distinct per-rank streams from here on (train/seeds.py: a script's own seeds kept).
            self.seed_ranks(dist.rank())
            self._seeded = True
        return wrapped

    def plain(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The plain module ``run.setup`` took (or returned) ``model`` for, also once compiled
        after it (``torch.compile(model)``); None for another."""
        found = self._plain.get(id(model))
        original = _original(model)
        if found is None and isinstance(original, torch.nn.Module):
            return self.plain(original)
        return found

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """As :meth:`plain`; UserError for a model not set up."""
        module = self.plain(model)
        if module is None:
            raise UserError(
                f"this {type(model).__name__} was not passed to run.setup, so it is not on the "
                "run's device nor wrapped for the world; call model, optimizer = "
                "run.setup(model, optimizer) first and pass what it returned"
            )
        return module

    def wrapper(self, model: torch.nn.Module) -> torch.nn.Module:
        """What ``run.setup`` returned for ``model`` (or for the module it wraps)."""
        return self._wrapper[id(self.unwrap(model))]


def _original(model: torch.nn.Module) -> object:
    """What ``torch.compile(model)`` compiled (an ``OptimizedModule``'s ``_orig_mod``); None for
    a module that is not compiled."""
    return getattr(model, "_orig_mod", None)
