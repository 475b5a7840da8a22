"""The training loop and what it is made of.

- ``trainer.py``: :class:`Trainer`: epochs of steps, then eval, mining and the epoch's save; asks
  each component whether it is due;
- ``builders.py``: the model (DDP), optimizer, lr schedule, AMP dtype, ``task.init_from``;
- ``preemption.py``: signals to a flag, and the ranks' agreement to stop at a step boundary;
- ``window.py``: losses and metrics kept on the device between log steps;
- ``finite.py``: non-finite losses and weights (``train.on_nonfinite``);
- ``evaluate.py``: evaluation on every rank's shard, reduced exactly.
"""
