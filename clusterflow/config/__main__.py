"""``python -m clusterflow.config``: the configuration reference (docs/configuration.md)."""

from clusterflow.config.job_config import reference_markdown

print(reference_markdown())
