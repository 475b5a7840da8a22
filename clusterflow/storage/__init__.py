"""Bytes that survive: durable writes and the checkpoint store.

- ``durable.py``: the one durable writer: streamed, hashed, fsynced files, atomic replacement,
  files published once, checked loads;
- ``store.py``: committed checkpoints over fsspec: staged, verified, superseded, damaged ones set
  aside;
- ``manifest.py``: what a checkpoint's manifest must hold before any file it names is read;
- ``diskfull.py``: a full disk turned into one line naming the device, path, size and free space.
"""
