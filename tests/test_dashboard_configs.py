"""What the dashboard shows of a run's config: every secret masked (by its key, inside text, in a
script's arguments), and the keys that tell runs apart (the compare view's legend)."""

import pytest

from clusterflow.web import configs

MASK = configs.MASK


@pytest.mark.parametrize(
    "key, secret",
    [
        ("trackers.wandb.api_key", True),
        ("task.params.hf_token", True),
        ("trackers.mlflow.password", True),
        ("task.params.client-secret", True),
        ("task.params.SECRET", True),
        ("checkpoint.keep_best", False),
        ("checkpoint.keep_last", False),
        ("mining.k", False),
        ("train.lr", False),
    ],
)
def test_which_keys_name_a_secret(key, secret):
    assert configs.is_secret(key) is secret


def test_secrets_inside_text_are_masked():
    assert configs.mask_text("https://bob:hunter2@mlflow.example/x") == (
        f"https://{MASK}@mlflow.example/x"
    )
    assert configs.mask_text("export WANDB_API_KEY=abc123; module load cuda") == (
        f"export WANDB_API_KEY={MASK}; module load cuda"
    )
    assert configs.mask_text('HF_TOKEN="a b" lr=0.1') == f"HF_TOKEN={MASK} lr=0.1"
    assert configs.mask_text("plain words: nothing to hide") == "plain words: nothing to hide"


def test_a_scripts_secret_arguments_are_masked():
    args = ["--lr", "0.1", "--api-key", "K1", "--token=T1", "--hf_token", "--db", "pg://u:p@h/x"]
    assert configs.mask_args(args) == [
        "--lr",
        "0.1",
        "--api-key",
        MASK,
        f"--token={MASK}",
        "--hf_token",  # a flag without a value: the next word is another flag
        "--db",
        f"pg://{MASK}@h/x",
    ]


def test_rows_mask_every_secret_and_keep_the_rest():
    config = {
        "train": {"lr": 0.003, "epochs": 2},
        "trackers": {"wandb": {"api_key": "W", "project": "p"}, "mlflow": {}},
        "cluster": {"setup": ["export WANDB_API_KEY=S", "module load x"]},
        "script": {"path": "train.py", "args": ["--secret", "Z", "--n", "3"]},
    }
    rows = dict(configs.rows(config))
    assert rows["train.lr"] == "0.003" and rows["trackers.wandb.project"] == "p"
    assert rows["trackers.wandb.api_key"] == MASK and rows["trackers.mlflow"] == "{}"
    assert rows["cluster.setup"] == f'["export WANDB_API_KEY={MASK}", "module load x"]'
    assert rows["script.args"] == f'["--secret", "{MASK}", "--n", "3"]'
    assert not any(s in str(rows) for s in ('"W"', "=S", '"Z"'))


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
    secret = {"trackers": {"wandb": {"api_key": "x" * 80}}}
    assert configs.legend(secret, ["trackers.wandb.api_key"]) == {"trackers.wandb.api_key": MASK}
