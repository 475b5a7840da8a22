"""An exponential moving average of the weights (``train.ema_decay``): a teacher for mining and
a second set of weights to evaluate.

After every optimizer step that was taken, each parameter's average moves towards it:
``ema = decay * ema + (1 - decay) * weight``, on every rank, on the device. Under
``train.parallel=fsdp`` the averages are DTensors sharded like the parameters (each rank averages
its own shards), so they cost 1/world of a copy of the model per rank and are saved with the
shards (``SHARDED``); under ddp every rank keeps the whole average and rank 0 saves it in
``train_state.pt``. Buffers (BatchNorm statistics) are not averaged: the EMA weights are used
with the model's buffers.

:meth:`EMA.swapped` puts the averages into the model for a while (evaluation, the mining embed)
and the trained weights back after, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from clusterflow.distributed import sharding
from clusterflow.train import parallel


class EMA:
    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]
        # The checkpointer saves a sharded EMA with the model's shards.
        self.sharded = sharding.is_fsdp(module)

    def update(self) -> None:
        """After an optimizer step: every average moves towards its parameter."""
        with torch.no_grad():
            shadow, params = list(parallel.local(self.shadow)), list(parallel.local(self.params))
            torch._foreach_mul_(shadow, self.decay)
            torch._foreach_add_(shadow, params, alpha=1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            missing = sorted(set(self.names) - set(state))[:3]
            extra = sorted(set(state) - set(self.names))[:3]
            raise ValueError(f"the EMA weights do not fit: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, s in zip(self.names, self.shadow):
                s.copy_(state[name])

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averages in the model's parameters meanwhile; the trained weights back after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    def full_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective under fsdp: the model's whole state_dict with the averages in place of its
        parameters (rank 0; None elsewhere), the form of model.pt."""
        with self.swapped():
            state = parallel.full_state_dict(module)
            # Copies: a plain state_dict shares the parameters' storage, swapped back on exit.
            return None if state is None else {k: v.detach().clone() for k, v in state.items()}
