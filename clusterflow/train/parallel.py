"""How the model is spread over the ranks: DDP (a whole replica each) or FSDP2 (sharded).

``train.parallel=fsdp`` applies ``torch.distributed.fsdp.fully_shard`` on a one-dimensional
device mesh over every rank: first to each unit the task names (``Task.shard_units(model)``, or
the default below), then to the whole model, which keeps whatever no unit holds. Parameters,
gradients and optimizer state then live as shards (DTensors), 1/world of each on every rank.
With ``train.amp=bf16`` the parameters are gathered in bf16 for the forward and backward and the
gradients are reduced in fp32 (FSDP2's ``MixedPrecisionPolicy``).

The loop touches the sharded model in four more places, all here: the gradient sync of the last
micro-batch only (:func:`gradient_sync`), local shards for the non-finite checks
(:func:`local`), the whole model gathered on every rank for evaluation and the mining embed
(:func:`gathered`: no collective inside, so ranks may run different numbers of batches), and the
full state dict of the final ``model.pt`` (:func:`full_state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterflow.config.sections import DistConfig
from clusterflow.distributed import comm as dist
from clusterflow.distributed import sharding
from clusterflow.errors import UserError
from clusterflow.tasks import Task, check_can_shard

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList)


def wrap_ddp(module: torch.nn.Module, device: torch.device, d: DistConfig) -> DDP:
    """DDP over ``module``, as the dist section ``d`` says. DDP reduces an attempt's first step in
    one bucket and then rebuilds its buckets in the order gradients became ready; the layout
    decides in which order ranks' gradients are summed (with 3+ ranks), so a resumed attempt's
    first step would sum differently from the uninterrupted run's same step.
    ``dist.fixed_buckets`` builds the final layout before the first step instead
    (:func:`_fix_buckets`): every step of every attempt then uses the same one, at no cost per
    step. DDP never rebuilds when it looks for unused parameters (``dist.find_unused_parameters``):
    its first layout stays."""
    ddp = DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=d.find_unused_parameters,
        bucket_cap_mb=d.bucket_cap_mb,
    )
    if d.fixed_buckets and not d.find_unused_parameters:
        _fix_buckets(ddp)
    return ddp


def _fix_buckets(ddp: DDP) -> None:
    """Rebuild ``ddp``'s buckets now (collective), as its first backward would: DDP's reducer
    records the order in which parameters' gradients arrive during a backward and rebuilds its
    buckets in that order, once. Here the backward is of a sum of zeros over the parameters, so
    they arrive in reverse order of definition (the order a plain network's backward produces,
    what DDP itself assumes before it has seen one), on every rank and in every attempt. Nothing
    else changes: no forward, no data, no random draw; the zero gradients it all-reduces are
    dropped, any gradient a parameter held is put back, and the weights are untouched."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if not params:
        return
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    # Weights whose gradient DDP expects sparse (as DDP tells them): a sparse lookup's zero.
    sparse = {
        id(m.weight)
        for m in ddp.module.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    }
    total = None
    for p in params:  # the last term's gradient is computed first
        if id(p) in sparse:
            first = torch.zeros(1, dtype=torch.long, device=p.device)
            term = torch.nn.functional.embedding(first, p, sparse=True).sum() * 0
        else:
            term = p.sum() * 0
        total = term if total is None else total + term
    ddp.reducer.prepare_for_forward()
    ddp.reducer.prepare_for_backward([total])
    total.backward()
    for p, g in zip(params, held):
        p.grad = g
    ddp.reducer._rebuild_buckets()


def is_wrapped(model: torch.nn.Module) -> bool:
    """A DDP wrapper or a sharded module: a model set up already."""
    return isinstance(model, DDP) or sharding.is_fsdp(model)


def rebind(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], module: torch.nn.Module
) -> None:
    """After ``fully_shard`` replaced ``module``'s parameters with sharded ones: the optimizer's
    parameter groups hold the new parameters (``names``: each old parameter's id -> its name).
    Only an optimizer that has not stepped can follow: its state would be for the old ones."""
    if optimizer.state:
        raise UserError(
            "run.setup(model, optimizer): the optimizer has stepped already, and its state "
            "cannot follow the parameters into their shards (train.parallel=fsdp); set the "
            "model up before the first optimizer step"
        )
    now = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now.get(names.get(id(p), ""), p) for p in group["params"]]


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements holding parameters of the model's outermost ``Sequential``/``ModuleList``
    containers (a transformer's blocks, a ResNet's stages' blocks); empty when it has none (the
    whole model is then one unit)."""
    units: list[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        if isinstance(m, _CONTAINERS):
            units.extend(c for c in m.children() if any(True for _ in c.parameters()))
            return
        for child in m.children():
            visit(child)

    visit(model)
    return [u for u in units if u is not model]


def shard_units(task: Task, model: torch.nn.Module, target: str) -> list[torch.nn.Module]:
    """The task's units, checked: submodules of ``model``, none of them the model itself."""
    check_can_shard(target, type(task))
    hook = getattr(task, "shard_units", None)
    units = list(hook(model)) if hook is not None else default_units(model)
    inside = {id(m) for m in model.modules()}
    for u in units:
        if not isinstance(u, torch.nn.Module) or id(u) not in inside or u is model:
            raise UserError(
                f"task {target!r}: shard_units(model) returned {type(u).__name__} "
                f"{str(u)[:60]!r}, which is not a submodule of the model; return the "
                "submodules to shard (e.g. list(model.blocks)), not the model itself"
            )
    return units


def wrap_fsdp(
    module: torch.nn.Module,
    units: list[torch.nn.Module],
    device: torch.device,
    world: int,
    amp: torch.dtype | None,
) -> torch.nn.Module:
    """Shard ``module`` in place over all ``world`` ranks; returns it (now an FSDPModule).
    ``amp``: bf16 gathers the parameters in bf16 and reduces the gradients in fp32."""
    if world == 1:
        dist.init_alone(device)
    mesh = init_device_mesh(device.type, (world,))
    fsdp = sharding.fsdp()
    mp = (
        fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if amp == torch.bfloat16
        else fsdp.MixedPrecisionPolicy()
    )
    for unit in units:
        fsdp.fully_shard(unit, mesh=mesh, mp_policy=mp)
    fsdp.fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
    """Around one micro-batch's backward: gradients are reduced across ranks only when ``sync``
    (the last micro-batch of an optimizer step)."""
    if isinstance(model, DDP) and not sync:
        return model.no_sync()
    if sharding.is_fsdp(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    return contextlib.nullcontext()


@overload
def local(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]: ...


@overload
def local(tensors: Iterable[object]) -> Iterator[object]: ...


def local(tensors: Iterable[object]) -> Iterator[object]:
    """This rank's part of each tensor (a DTensor's local shard; a plain tensor, or anything
    else an optimizer's state holds, itself)."""
    for t in tensors:
        yield t.to_local() if sharding.is_dtensor(t) else t  # type: ignore[attr-defined]


def local_grads(params: Iterable[torch.nn.Parameter]) -> Iterator[_Grad]:
    """Parameters as the non-finite guard sees them: objects whose ``grad`` is this rank's
    shard."""
    for p in params:
        g = p.grad
        yield _Grad(g.to_local() if sharding.is_dtensor(g) else g)  # type: ignore[union-attr]


class _Grad:
    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor | None) -> None:
        self.grad = grad


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """The whole model on every rank for a while (evaluation, the mining embed): every sharded
    module is gathered once and kept gathered, so its forwards run no collective and ranks may
    run different numbers of batches; sharded again on exit. A no-op for an unsharded model."""
    units: list[Any] = [m for m in model.modules() if sharding.is_fsdp(m)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            # FSDP2's defaults: the root keeps its parameters after the forward (the backward
            # needs them at once), every other unit frees them.
            m.set_reshard_after_forward(m is not model, recurse=False)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any] | None:
    """Collective for a sharded model: its whole state_dict on CPU on rank 0 (None elsewhere);
    the plain ``state_dict()`` otherwise."""
    if not sharding.is_fsdp(model):
        return model.state_dict()
    state_dicts = sharding.state_dicts()
    sd = state_dicts.get_model_state_dict(
        model, options=state_dicts.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return sd or None
