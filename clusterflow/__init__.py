"""clusterflow: Slurm-native multi-node PyTorch training with exact resume and pseudo-label mining.

Importing the package is cheap on purpose: the login-node commands (submit, status) must not load
torch or faiss. Heavy modules are imported where they are used, inside the job.

The library API for a training loop of the user's own (docs/own-loop.md)::

    import clusterflow
    run = clusterflow.start()

``clusterflow.start`` and ``clusterflow.Run`` live in the job's code, which imports torch: they
are looked up when first used (PEP 562), so ``import clusterflow`` stays as light as the login
node needs.
"""

from __future__ import annotations

from clusterflow import at_import  # noqa: F401 - the random stream as the script had it
from clusterflow.version import __version__

__all__ = ["Run", "RunStopped", "__version__", "start"]


def __getattr__(name: str) -> object:
    # The job side (torch) only when a script asks for it, never on `import clusterflow`.
    if name == "start":
        from clusterflow.job.script import start

        return start
    if name in ("Run", "RunStopped"):
        from clusterflow.train import session

        return getattr(session, name)
    raise AttributeError(f"module 'clusterflow' has no attribute {name!r}")
