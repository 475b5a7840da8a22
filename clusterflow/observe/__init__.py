"""What each rank is doing, seen from outside: metrics, heartbeats, the stall watchdog.

- ``observer.py``: wires heartbeats and the watchdog to the config around the run (a task's or a
  script's);
- ``phases.py``: what a rank is doing now (train, eval, mining, checkpoint) and since when;
- ``heartbeat.py``: per-rank heartbeat files, read back for ``status --ranks``;
- ``watchdog.py``: a rank whose loop stops moving: stacks, first cause, flight recorder, exit;
- ``metrics.py``: TensorBoard on rank 0 (a null writer elsewhere), metrics.jsonl, throughput;
- ``nvml.py``: an NVML snapshot of the GPUs (optional: nvidia-ml-py);
- ``profiling.py``: ``train.profile``'s torch.profiler trace of a window of steps;
- ``trackers/``: MLflow and W&B, one tracker run per clusterflow run, each step once.

This package re-exports nothing: the login side reads heartbeats, the goodput ledger and tracker
state through their modules, and must not load ``observer.py`` (and with it torch) on the way.
"""
