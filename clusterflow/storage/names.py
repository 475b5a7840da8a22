"""The names of a checkpoint's files and of its sharded format: the one definition that the
store, the checkpointer, restore, export, ``status`` and the run dir's final weights share.

A committed ``step-<N>/`` folder holds ``MODEL`` and ``TRAIN_STATE`` (or, when the manifest's
``format`` is ``DCP``, torch.distributed.checkpoint's shards) and ``MANIFEST``, written last
(``store.py``). A completed run's final weights are ``RUN_DIR/model.pt``, the same plain
state_dict as a checkpoint's ``MODEL`` (``rundir/paths.py``). Here, in the lowest layer that
every reader and writer of these files may import; no imports, so ``status`` reads it on the login
node for nothing.
"""

MANIFEST = "manifest.json"  # written last: what makes a step folder a committed checkpoint
MODEL = "model.pt"  # the weights, a plain state_dict (torch.load(..., weights_only=True))
TRAIN_STATE = "train_state.pt"  # optimizer, scheduler, scaler, counters, RNG states, ...
DCP = "dcp"  # the manifest's "format" of a sharded checkpoint (train.parallel=fsdp)
