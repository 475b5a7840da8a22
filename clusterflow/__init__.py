"""clusterflow: Slurm-native multi-node PyTorch training with exact resume and pseudo-label mining.

Importing the package is cheap on purpose: the login-node commands (submit, status) must not load
torch or faiss. Heavy modules are imported where they are used, inside the job.
"""

__version__ = "0.1.0"
