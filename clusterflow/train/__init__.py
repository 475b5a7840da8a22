"""The training loop and what it is made of.

- ``session.py``: :class:`Run`, the library API's run (docs/own-loop.md), a facade: each guarantee
  of the loop implemented once, for scripts and tasks alike, in the parts below and in
  ``observe/reporter.py``, ``mining/adapter.py``, ``checkpoint/registered.py``;
- ``call_order.py``: which call may come when (named phases, a transition table), and the one
  line that refuses a call out of order;
- ``accounting.py``: the epoch's plan of global batches, the step each batch belongs to, what
  ``run.step`` counts;
- ``loader.py``: ``run.loader``'s DataLoader over the epoch plan, and the checks of its arguments;
- ``stream.py``: ``run.loader`` over an ``IterableDataset`` (torchdata's ``StatefulDataLoader``),
  each rank's position saved per rank;
- ``models.py``: the models ``run.setup`` placed and wrapped, one call per model, compiled or not;
- ``seeds.py``: whose seeds the global random streams carry: a script's own kept, the others
  ``run.seed`` at ``start`` and per rank at ``run.setup``;
- ``saves.py``: when the loop's events commit a checkpoint, how an agreed stop ends the job
  (:class:`RunStopped`), the run's end;
- ``trainer.py``: :class:`Trainer`: a task's loop on a Run (its model, optimizer, schedule,
  accumulation, EMA, eval, in the run's precision; then mining and the epoch's save, which the
  Run does);
- ``builders.py``: the model, optimizer, lr schedule, ``task.init_from``, and the run's one
  :class:`Precision` (autocast dtype and GradScaler);
- ``parallel.py``: DDP or FSDP2 (``train.parallel``), and the few places the loop touches a
  sharded model;
- ``ema.py``: the exponential moving average of the weights (``train.ema_decay``);
- ``preemption.py``: signals to a flag, and the ranks' agreement to stop at a step boundary;
- ``window.py``: losses and metrics kept on the device between log steps;
- ``finite.py``: non-finite losses and weights (``train.on_nonfinite``);
- ``evaluate.py``: evaluation on every rank's shard, reduced exactly.
"""
