"""The package's version, in a module of its own: the package's face (``clusterflow/__init__.py``)
reaches the job's code through ``clusterflow.start``, so the store, which records the version in
each manifest, imports it from here and not from the package."""

__version__ = "0.1.0"
