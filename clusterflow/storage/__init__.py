"""Bytes that survive: durable writes and the checkpoint store.

- ``durable.py``: the one durable writer: streamed, hashed, fsynced files, atomic replacement,
  files published once, checked loads;
- ``store.py``: committed checkpoints over fsspec: staged, verified, superseded, damaged ones set
  aside;
- ``manifest.py``: what a checkpoint's manifest must hold before any file it names is read;
- ``diskfull.py``: a full disk turned into one line naming the device, path, size and free space;
- ``confined.py``: the one opener of a file that other hands write into (a run dir's records, a
  store's manifests): a regular file, reached without a link, never blocking, within a size;
- ``private.py``: folders only this user may enter on a node others share (snapshots in
  ``/dev/shm``): made with exclusive creation and mode 0700, or used only when found so.
"""
