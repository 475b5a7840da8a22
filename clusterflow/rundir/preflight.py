"""Checks before a run starts, shared by ``submit`` (on the login node) and ``run`` (in the
allocation), so that a bad path fails in a second with a sentence instead of on a compute node
with a traceback.

- :func:`check_paths`: ``run.dir`` can hold a run: it is a directory or can be made one (not a
  file, not under a file), on a filesystem this user can write, not inside ``/proc``, ``/sys`` or
  ``/dev``. ``checkpoint.dir``: the same when it is a path; when it is a URL, fsspec has the
  package for its protocol (s3fs for ``s3://``), checked here rather than on the compute node
  (the checks of one path or URL: ``config/paths.py``).

The checks write nothing (``submit --dry-run`` and ``run --check`` use them). Which config a
launch runs on, given the run dir's ``config.yaml``, is ``saved_config.resolve``.
"""

from __future__ import annotations

from clusterflow.config.job_config import Config
from clusterflow.config.paths import check_backend, check_local_dir
from clusterflow.config.sections import is_url


def check_paths(cfg: Config) -> None:
    check_local_dir("run.dir", cfg.run.dir)
    if cfg.task.init_from and is_url(cfg.task.init_from):
        check_backend("task.init_from", cfg.task.init_from)
    ckpt = cfg.checkpoint.dir
    if not ckpt:
        return
    if ckpt.startswith("file://") or not is_url(ckpt):
        check_local_dir("checkpoint.dir", ckpt.removeprefix("file://"))
    else:
        check_backend("checkpoint.dir", ckpt)
