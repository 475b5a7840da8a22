"""The one masking rule (clusterflow/config/masking.py) that every place showing a config value or
a script argument uses: which names name a secret (whole words, so counts and sizes stay
readable), secrets inside text (URLs, assignments, headers, JSON), a script's arguments (flags
and their values), values of any shape (mappings inside lists), and the messages that name a
config value (a changed key, a refused value). The other places are tested where they are: the
dashboard (test_dashboard.py, test_dashboard_views.py), status and the names of sweep members
(test_secrets_shown.py)."""

import json
import os

import pytest
from conftest import REPO

from clusterflow import config
from clusterflow.config import fingerprint, masking
from clusterflow.errors import UserError

MASK = masking.MASK


@pytest.mark.parametrize(
    "name",
    [
        "trackers.wandb.api_key",
        "trackers.wandb.api_key_hint",  # api + key anywhere in the name
        "task.params.hf_token",
        "trackers.mlflow.password",
        "task.params.client-secret",
        "task.params.SECRET",
        "DB_PASS",  # an environment variable ending in PASS
        "db_pwd",
        "user_pwd",
        "credentials",
        "aws.credentials.file",  # a segment holding credential
        "auth",
        "--auth",
        "Authorization",
        "apiKey",  # camelCase
        "HFToken",
        "hf_token2",
        "access_token_ttl",
        "private_key",
        "passphrase",
        "-k",  # the short flag of a key (an argument's flag)
    ],
)
def test_names_that_name_a_secret(name):
    assert masking.is_secret_flag(name) if name == "-k" else masking.is_secret(name)


@pytest.mark.parametrize(
    "name",
    [
        "train.max_tokens",  # a count, not a token
        "num_tokens",
        "tokenizer",
        "task.params.key_dim",  # key not the last word
        "num_keys",
        "checkpoint.keep_best",
        "checkpoint.keep_last",
        "mining.k",  # a config key k is no flag
        "train.lr",
        "PWD",  # the working directory
        "author",
        "pass_rate",
        "bypass",
        "monkey",
        "pad_token",  # a tokenizer's tokens
        "eos_token",
        "--k",
        "--topk",
    ],
)
def test_names_that_do_not(name):
    assert not masking.is_secret(name) and not masking.is_secret_flag(name)


@pytest.mark.parametrize(
    "text, shown",
    [
        ("https://bob:hunter2@mlflow.example/x", f"https://{MASK}@mlflow.example/x"),
        # a password holding / and @: the userinfo ends at the last @ before the host
        ("https://bob:hu/nt@er2@mlflow.example/x", f"https://{MASK}@mlflow.example/x"),
        ("postgres://u:p@ss/w@db:5432/x and more", f"postgres://{MASK}@db:5432/x and more"),
        ("https://ghp_T0KEN@github.com/o/r.git", f"https://{MASK}@github.com/o/r.git"),
        # no userinfo: a / before any @ and :
        ("https://medium.com/@user/post", "https://medium.com/@user/post"),
        (
            "export WANDB_API_KEY=abc123; module load x",
            f"export WANDB_API_KEY={MASK}; module load x",
        ),
        ('HF_TOKEN="a b" lr=0.1', f"HF_TOKEN={MASK} lr=0.1"),
        ("export DB_PASS=hunter2", f"export DB_PASS={MASK}"),
        ("DB_PWD=x PWD=/home/u", f"DB_PWD={MASK} PWD=/home/u"),
        ("Authorization: Bearer abc.def", f"Authorization: {MASK}"),
        (
            "curl -H 'Authorization: Bearer abc.def' https://x",
            f"curl -H 'Authorization: {MASK}' https://x",
        ),
        ("token in a header: bearer abc.def", f"token in a header: bearer {MASK}"),
        ("x: password=c", f"x: password={MASK}"),
        ("credentials: u1,p1 rest", f"credentials: {MASK} rest"),
        ("python t.py --auth A --lr 0.1", f"python t.py --auth {MASK} --lr 0.1"),
        ("python t.py -k K1 -kK2", f"python t.py -k {MASK} -k{MASK}"),
        ("max_tokens=512 tokenizer=bpe", "max_tokens=512 tokenizer=bpe"),
        ("plain words: nothing to hide", "plain words: nothing to hide"),
    ],
)
def test_secrets_inside_text_are_masked(text, shown):
    assert masking.mask_text(text) == shown


def test_json_text_naming_a_secret_key_is_masked_as_a_mapping():
    text = json.dumps({"user": "a", "password": 'p"w@rd', "n": [{"token": 1, "k": 2}]})
    assert json.loads(masking.mask_text(text)) == {
        "user": "a",
        "password": MASK,
        "n": [{"token": MASK, "k": 2}],
    }
    assert masking.mask_text('[{"db": {"url": "pg://u:pw@h/x"}}]') == (
        f'[{{"db": {{"url": "pg://{MASK}@h/x"}}}}]'
    )
    assert masking.mask_text('{"lr": 0.1}') == '{"lr": 0.1}'  # nothing to mask: as written
    # Not JSON: the quoted name is still a name
    assert masking.mask_text("{'password': 'x y', 'n': 1}") == f"{{'password': {MASK}, 'n': 1}}"


def test_a_scripts_arguments_hide_each_secret_flags_value():
    args = [
        "--lr",
        "0.1",
        "--api-key",
        "-abc",  # a value starting with -
        "--token=T1",
        "--hf_token",
        "--db",  # a long flag after a secret flag: that flag had no value
        "pg://u:p/w@h/x",
        "-k",
        "K1",
        "-kK2",
        "-k=K3",
        "--auth",
        "A",
        "DB_PASS=P",
        '{"password": "J"}',
        "--max-tokens",
        "512",
        "--",
        "x",
    ]
    assert masking.mask_args(args) == [
        "--lr",
        "0.1",
        "--api-key",
        MASK,
        f"--token={MASK}",
        "--hf_token",
        "--db",
        f"pg://{MASK}@h/x",
        "-k",
        MASK,
        f"-k{MASK}",
        f"-k={MASK}",
        "--auth",
        MASK,
        f"DB_PASS={MASK}",
        f'{{"password": "{MASK}"}}',
        "--max-tokens",
        "512",
        "--",
        "x",
    ]
    assert masking.mask_argument("--api-key", "--x") == MASK  # a swept value is a value
    assert masking.mask_argument("-k", "K") == MASK
    assert masking.mask_argument("db_pass", "P") == MASK  # a key=value argument
    assert masking.mask_argument("--lr", "0.1") == "0.1"
    assert masking.mask_argument("--db", "pg://u:p@h/x") == f"pg://{MASK}@h/x"


def test_values_of_any_shape_keep_their_shape_and_lose_their_secrets():
    value = {
        "dbs": [{"name": "a", "password": "P1"}, {"name": "b", "url": "pg://u:P2@h"}],
        "cmd": ["--token", "T"],  # a list of words is a command line
        "use_auth": True,  # a switch holds no secret
        "api_key": "",  # unset stays unset
        "max_tokens": 512,
        "hf_token": 1234,
    }
    assert masking.mask_value("task.params", value) == {
        "dbs": [{"name": "a", "password": MASK}, {"name": "b", "url": f"pg://{MASK}@h"}],
        "cmd": ["--token", MASK],
        "use_auth": True,
        "api_key": "",
        "max_tokens": 512,
        "hf_token": MASK,
    }
    assert masking.mask_value("trackers.wandb.api_key", {"a": 1}) == MASK
    deep: object = "pg://u:P3@h"
    for _ in range(200):
        deep = [deep]
    assert "P3" not in json.dumps(masking.mask_value("x", deep))  # bounded: masked whole


def test_a_changed_key_and_a_refused_value_are_named_masked():
    """The notes on a resume's changed keys and a config value's refusal (a job's error record,
    shown by status and the dashboard) name values as the rule shows them."""
    change = fingerprint.Change(
        "trackers.mlflow.uri", "https://u:old-s3cr3t@h", "https://u:new-s3cr3t@h", "resource"
    )
    assert str(change) == f'trackers.mlflow.uri "https://{MASK}@h" -> "https://{MASK}@h"'
    assert str(fingerprint.Change("cluster.time_min", 60, 240, "resource")) == (
        "cluster.time_min 60 -> 240"
    )
    with pytest.raises(UserError) as refused:
        config.load(
            os.path.join(REPO, "configs", "tiny.yaml"),
            ["trackers.mlflow.uri=ftp://u:pw-s3cr3t@h/x"],
        )
    assert f"trackers.mlflow.uri = 'ftp://{MASK}@h/x': scheme 'ftp'" in str(refused.value)
