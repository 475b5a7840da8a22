"""What the dashboard shows of a run's config: rows with every secret masked by the one rule
(its cases: test_masking.py), and the keys that tell runs apart (the compare view's legend)."""

import json
import os

from clusterflow.config.masking import MASK
from clusterflow.rundir import RunPaths
from clusterflow.web import catalog, configs, discover


def test_rows_mask_every_secret_and_keep_the_rest():
    config = {
        "train": {"lr": 0.003, "epochs": 2},
        "trackers": {"wandb": {"api_key": "W", "project": "p"}, "mlflow": {}},
        "cluster": {"setup": ["export WANDB_API_KEY=S", "module load x"]},
        "script": {"path": "train.py", "args": ["--secret", "Z", "--n", "3"]},
        "task": {"params": {"dbs": [{"password": "Q"}], "max_tokens": 512}},
    }
    rows = dict(configs.rows(config))
    assert rows["train.lr"] == "0.003" and rows["trackers.wandb.project"] == "p"
    assert rows["trackers.wandb.api_key"] == MASK and rows["trackers.mlflow"] == "{}"
    assert rows["cluster.setup"] == f'["export WANDB_API_KEY={MASK}", "module load x"]'
    assert rows["script.args"] == f'["--secret", "{MASK}", "--n", "3"]'
    assert rows["task.params.dbs"] == f'[{{"password": "{MASK}"}}]'  # a mapping in a list
    assert rows["task.params.max_tokens"] == "512"
    assert not any(s in str(rows) for s in ('"W"', "=S", '"Z"', '"Q"'))


def test_the_keys_that_tell_runs_apart():
    a = {"run": {"dir": "/r/a"}, "train": {"lr": 0.1, "epochs": 2}, "task": {"params": {}}}
    b = {"run": {"dir": "/r/b"}, "train": {"lr": 0.3, "epochs": 2}, "task": {"params": {"d": 4}}}
    keys = configs.differing({"a": a, "b": b})
    assert keys == ["train.lr", "task.params", "task.params.d"]  # run.dir is each run's own
    assert configs.legend(b, keys) == {
        "train.lr": "0.3",
        "task.params": "(unset)",
        "task.params.d": "4",
    }
    secret = {"trackers": {"wandb": {"api_key": "x" * 80}}, "train": {"max_tokens": 64}}
    assert configs.legend(secret, ["trackers.wandb.api_key", "train.max_tokens"]) == {
        "trackers.wandb.api_key": MASK,
        "train.max_tokens": "64",  # a count tells runs apart
    }


def test_a_damaged_sweep_index_is_named_with_its_secrets_masked(tmp_path):
    """A sweep.json damaged so that its refusal quotes a member, secret and all: the Runs page's
    problem line names the damage, not the secret."""
    root = tmp_path / "sweep"
    root.mkdir()
    member = {"name": "a/b", "values": {"trackers.wandb.api_key": "hunter2-secret"}}
    index = {"version": 1, "keys": ["trackers.wandb.api_key"], "members": [member]}
    (root / os.path.basename(RunPaths(str(root)).sweep_index)).write_text(json.dumps(index))
    sweep = catalog.Sweep(discover.Found("sweep", str(root), "sweep"))
    sweep.update()
    assert "is damaged: a member is" in sweep.problem, sweep.problem
    assert "hunter2-secret" not in sweep.problem and MASK in sweep.problem, sweep.problem
