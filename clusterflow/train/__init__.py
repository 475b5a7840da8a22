"""The training loop and what it is made of.

- ``trainer.py``: :class:`Trainer`: epochs of steps, then eval, mining and the epoch's save; asks
  each component whether it is due;
- ``builders.py``: the model (DDP or sharded), optimizer, lr schedule, AMP dtype,
  ``task.init_from``;
- ``parallel.py``: DDP or FSDP2 (``train.parallel``), and the few places the loop touches a
  sharded model;
- ``ema.py``: the exponential moving average of the weights (``train.ema_decay``);
- ``preemption.py``: signals to a flag, and the ranks' agreement to stop at a step boundary;
- ``window.py``: losses and metrics kept on the device between log steps;
- ``finite.py``: non-finite losses and weights (``train.on_nonfinite``);
- ``evaluate.py``: evaluation on every rank's shard, reduced exactly.
"""
