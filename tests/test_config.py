import dataclasses
import importlib
import textwrap

import pytest
import yaml

from clusterflow import config
from clusterflow.config import SECTIONS
from clusterflow.config.job_config import task_keys_set
from clusterflow.config.sections import APPLIES, SCRIPT, TASK
from clusterflow.errors import UserError


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_defaults_file_overrides_precedence(tmp_path):
    path = write(
        tmp_path,
        """
        train: {epochs: 7, lr: 0.01}
        cluster: {nodes: 2}
    """,
    )
    cfg = config.load(
        path,
        [
            "train.epochs=3",
            "cluster.partition=007",
            "task.params={identities: 5}",
            "train.amp=bf16",
        ],
    )
    assert cfg.train.epochs == 3  # override beats file
    assert cfg.train.lr == 0.01  # file beats default
    assert cfg.train.batch_size == config.TrainConfig().batch_size  # default
    assert cfg.cluster.partition == "007"  # a string stays a string
    assert cfg.task.params == {"identities": 5}
    assert cfg.cluster.nodes == 2


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.epochz=3", "unknown key train.epochz; valid keys of [train]: epochs, batch_size"),
        ("trian.epochs=3", "unknown section 'trian'; valid sections: run, cluster"),
        ("train.epochs=three", "train.epochs = 'three': expected an integer, got str"),
        ("train.lr=abc", "train.lr = 'abc': expected a number"),
        ("cluster.exclusive=maybe", "expected true or false"),
        ("cluster.nodes=0", "cluster.nodes = 0: must be >= 1"),
        ("train.amp=fp8", "must be one of auto, none, bf16, fp16"),
        ("checkpoint.keep_last=1", "must be >= 2"),
        ("epochs", "must look like section.key=value"),
        ("cluster.tasks_per_node=3", "must be divisible by world size x grad_accum = 3 x 1"),
        (
            "train.epochs.x=3",
            "train.epochs is a single value, not a mapping; write train.epochs=VALUE",
        ),
        ("mining.search=everywhere", "must be one of rank0, all, sharded"),
    ],
)
def test_bad_overrides_name_key_value_and_fix(override, needle):
    with pytest.raises(UserError) as e:
        config.load(None, [override])
    assert needle in str(e.value)


def test_unknown_key_in_file_lists_valid_keys(tmp_path):
    path = write(tmp_path, "mining:\n  kk: 3\n")
    with pytest.raises(
        UserError, match=r"unknown key mining.kk; valid keys of \[mining\]: enabled, every_epochs"
    ):
        config.load(path)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 3\n  lr: [1, 2\nmining:\n  k: 3\n")
    with pytest.raises(UserError) as e:
        config.load(path)
    assert path in str(e.value) and ":4:" in str(e.value) or ":5:" in str(e.value)


def test_missing_file_names_path(tmp_path):
    with pytest.raises(UserError, match="config file not found: '.*nope.yaml'"):
        config.load(str(tmp_path / "nope.yaml"))


def test_gpus_set_tasks_per_node():
    cfg = config.load(None, ["cluster.gpus_per_node=4", "train.batch_size=128"])
    assert cfg.cluster.tasks_per_node == 4
    with pytest.raises(UserError, match="one process per GPU"):
        config.load(None, ["cluster.gpus_per_node=4", "cluster.tasks_per_node=3"])


def test_round_trip_and_fingerprint_ignores_run_dir(tmp_path):
    cfg = config.load(None, ["train.epochs=2", "run.dir=a"])
    again = config.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
    moved = config.load(None, ["train.epochs=2", "run.dir=b"])
    assert moved.fingerprint() == cfg.fingerprint()
    assert config.load(None, ["train.epochs=3"]).fingerprint() != cfg.fingerprint()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["configs/nope.yaml"], "config file not found"),
        (["configs/demo.yaml", "train.epochz=1"], "unknown key train.epochz"),
        (["configs/demo.yaml", "cluster.nodes=0"], "cluster.nodes = 0"),
        (["configs/demo.yaml", "cluster.tasks_per_node=0"], "cluster.tasks_per_node = 0"),
        (
            ["configs/demo.yaml", "mining.search=sharded", "mining.method=finch"],
            "which mining.search=sharded never gathers; set mining.search=rank0",
        ),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(cli, args, needle):
    out = cli("clusterflow.submit", *args, "--dry-run")
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_malformed_yaml(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 3\n   lr: 1\n")
    out = cli("clusterflow.submit", str(bad), "--dry-run")
    assert (
        out.returncode == 2 and "malformed YAML at" in out.stderr and "Traceback" not in out.stderr
    )


def test_reference_doc_is_current():
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "docs", "configuration.md")) as f:
        assert f.read().strip() == config.reference_markdown().strip(), (
            "docs/configuration.md is stale: python -m clusterflow.config > docs/configuration.md"
        )


def test_login_node_import_is_light(cli):
    out = cli("clusterflow.cli", "--help")
    assert out.returncode == 0
    import subprocess
    import sys

    code = (
        "import sys, clusterflow.submit, clusterflow.status, clusterflow.logs, "
        "clusterflow.cancel, clusterflow.config; "
        "print('torch' in sys.modules, 'faiss' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert res.stdout.strip() == "False False", res.stderr


def test_one_task_param_overrides_keep_the_others(tmp_path):
    path = write(tmp_path, "task:\n  params: {identities: 24, hidden: 64}\n")
    cfg = config.load(path, ["task.params.hidden=128", "task.params.extra=x"])
    assert cfg.task.params == {"identities": 24, "hidden": 128, "extra": "x"}


def test_spread_search_needs_the_exact_torch_engine():
    with pytest.raises(
        UserError, match="mining.engine = 'faiss': cannot run with mining.search=all"
    ):
        config.load(None, ["mining.search=all", "mining.engine=faiss"])
    with pytest.raises(UserError, match="mining.search=all is exact"):
        config.load(None, ["mining.search=all", "mining.index=hnsw"])
    assert config.load(None, ["mining.search=all"]).mining.search == "all"


def test_sharded_search_takes_any_engine_and_index():
    for index in ("flat", "ivf", "hnsw"):
        cfg = config.load(
            None, ["mining.search=sharded", "mining.engine=faiss", f"mining.index={index}"]
        )
        assert (cfg.mining.search, cfg.mining.index) == ("sharded", index)
    assert (
        config.load(None, ["mining.search=sharded", "mining.threshold=auto"]).mining.search
        == "sharded"
    )


def test_one_resume_rule_for_submit_run_and_restore(tmp_path, capsys):
    """config.check_resume: a differing key is refused with its old and new value, except a
    relaunch of the same job (a Slurm requeue re-reading an edited YAML), which keeps the saved
    config with a note; where the run dir is may change; keys one side lacks are not differences."""
    saved = config.load(None, ["run.dir=/a", "train.epochs=3"]).to_dict()
    config.check_resume(
        saved, config.load(None, ["run.dir=/moved", "train.epochs=3"]).to_dict(), "run dir '/a'"
    )
    edited = config.load(None, ["run.dir=/a", "train.epochs=5", "mining.k=7"]).to_dict()
    with pytest.raises(
        UserError,
        match=r"run dir '/a' holds a run with a different config \(train.epochs 3 -> 5; "
        r"mining.k 10 -> 7\); to resume it, use the same values",
    ):
        config.check_resume(saved, edited, "run dir '/a'")
    config.check_resume(saved, edited, "run dir '/a'", relaunch=True)
    assert "runs on the config of run dir '/a'" in capsys.readouterr().err
    older = {
        s: {k: v for k, v in keys.items() if k != "eval_every_epochs"} for s, keys in saved.items()
    }
    config.check_resume(
        older, saved, "a checkpoint"
    )  # written before a key existed: not a difference
    resumed = config.resume_config(
        config.from_dict(saved), config.from_dict(edited | {"run": {**saved["run"], "dir": "/b"}})
    )
    assert resumed.run.dir == "/b" and resumed.train.epochs == 3


def test_run_refuses_a_different_config_in_an_existing_run_dir(cli, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text(config.load("configs/tiny.yaml", [f"run.dir={d}"]).to_yaml())
    (d / "checkpoints" / "step-4").mkdir(
        parents=True
    )  # a committed step: the run has something to resume
    (d / "checkpoints" / "step-4" / "manifest.json").write_text("{}")
    out = cli("clusterflow.run", "configs/tiny.yaml", f"run.dir={d}", "train.epochs=9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds a run with a different config (train.epochs 3 -> 9)" in out.stderr


def test_each_key_says_whom_it_applies_to_and_a_scripts_job_names_the_task_keys_it_sets():
    applies = {}
    for name, cls in SECTIONS.items():
        # Each section in a module of its own that names the code reading it.
        module = importlib.import_module(cls.__module__)
        assert module.__name__ == f"clusterflow.config.sections.{name}"
        assert "Read by" in module.__doc__ or "read by" in module.__doc__, name
        for f in dataclasses.fields(cls):
            assert f.metadata["applies"] in APPLIES, (name, f.name)
            applies[f"{name}.{f.metadata.get('key', f.name)}"] = f.metadata["applies"]
    assert applies["train.batch_size"] == applies["task.target"] == TASK
    assert applies["script.path"] == SCRIPT and applies["train.parallel"] not in (TASK, SCRIPT)
    cfg = config.load(
        None,
        ["run.dir=/tmp/x", "script.path=t.py", "train.batch_size=256", "train.parallel=fsdp"],
    )
    assert task_keys_set(cfg) == ["train.batch_size = 256"]
