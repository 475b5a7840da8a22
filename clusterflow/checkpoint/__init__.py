"""Checkpoints of a training run: when one is due, what it holds, how it is written and restored.

- ``checkpointer.py``: the one owner: when a save is due (steps, epoch end, stop), the registered
  states, saving now or in the background;
- ``staging.py``: the host snapshot a background save writes from, and the optimizer-step gate;
- ``background.py``: one write at a time on a thread, its outcome never lost;
- ``restore.py``: which checkpoint to resume (the newest that verifies, fits and loads on every
  rank), read once and broadcast, applied everywhere or nowhere;
- ``memory.py``: snapshots in the nodes' memory: taking them (:class:`MemorySnapshots`) and
  restoring from them (:class:`MemoryRestore`, bounded by the run's history);
- ``train_state.py``: counters, pseudo-labels and mining history (:class:`TrainState`), and the
  one rule for a save every N steps (``save_due``);
- ``rng.py``: every random stream captured and restored in a ``weights_only``-safe form.

The commit protocol itself (staging folders, manifests, publishing) is ``storage/store.py``.
"""
