"""The training loop and what it is made of.

- ``session.py``: :class:`Run`, the library API's run (docs/own-loop.md): setup, the epoch plan's
  loader, the registered states and their restore, epochs, steps, mining, the end; each guarantee
  of the loop implemented once, for scripts and tasks alike;
- ``trainer.py``: :class:`Trainer`: a task's loop on a Run (its model, optimizer, schedule, AMP,
  accumulation, EMA, eval; then mining and the epoch's save, which the Run does);
- ``builders.py``: the model, optimizer, lr schedule, AMP dtype, ``task.init_from``;
- ``parallel.py``: DDP or FSDP2 (``train.parallel``), and the few places the loop touches a
  sharded model;
- ``ema.py``: the exponential moving average of the weights (``train.ema_decay``);
- ``preemption.py``: signals to a flag, and the ranks' agreement to stop at a step boundary;
- ``window.py``: losses and metrics kept on the device between log steps;
- ``finite.py``: non-finite losses and weights (``train.on_nonfinite``);
- ``evaluate.py``: evaluation on every rank's shard, reduced exactly.
"""
