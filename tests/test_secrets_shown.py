"""Secrets on the login node's commands, in-process: ``clusterflow status`` of a script's run (its
arguments, text and ``--json``) and of a sweep dir (each member's values), and the names of a
sweep's members (``submit --sweep ... --dry-run``): a folder name that anyone listing the sweep
dir sees holds no secret, the names stay unique and stable, and a sweep dir whose index holds a
member under its unmasked name finds that member again. The rule itself: test_masking.py."""

import hashlib
import json
import os

import pytest
from conftest import write_status_record

from clusterflow import rundir
from clusterflow.config import fingerprint
from clusterflow.config.masking import MASK
from clusterflow.launch.submit import main as submit_main
from clusterflow.manage.status import main as status_main
from clusterflow.sweeps import index as sweep_index
from clusterflow.sweeps import sweep

# Each secret its own text, so that any trace of one is found wherever it leaks.
KEYS = ("K1-s3cr3t-api", "-K2-s3cr3t-dash", "K3-s3cr3t-api")
ARGS = [
    "--api-key",
    "-A1-s3cr3t",  # a value that starts with -
    "--lr",
    "0.1",
    "--token=A2-s3cr3t",
    "-k",
    "A3-s3cr3t",
    "-kA4-s3cr3t",
    "--auth",
    "A5-s3cr3t",
    "--db",
    "pg://bob:A6-s3/cr@t@db.example/x",  # a password holding / and @
    "DB_PASS=A7-s3cr3t",
    '{"password": "A8-s3cr3t"}',
    "--max-tokens",
    "512",
]


def _script_run(run_dir, args):
    """A completed run of the script t.py with ``args`` (its records only)."""
    paths = rundir.RunPaths(str(run_dir))
    os.makedirs(paths.root, exist_ok=True)
    with open(paths.config, "w") as f:
        f.write(
            json.dumps({"run": {"dir": str(run_dir)}, "script": {"path": "t.py", "args": args}})
        )
    write_status_record(paths.root, state="completed", epoch=1, global_step=4, world_size=1)
    return paths


def test_status_masks_a_scripts_secret_arguments_in_text_and_json(tmp_path, capsys):
    paths = _script_run(tmp_path / "run", ARGS)
    assert status_main([paths.root]) == 0
    text = capsys.readouterr().out
    assert status_main([paths.root, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["script"]
    assert "s3cr3t" not in text and "s3/cr" not in text and "s3cr3t" not in json.dumps(shown)
    assert shown["args"] == [
        "--api-key",
        MASK,
        "--lr",
        "0.1",
        f"--token={MASK}",
        "-k",
        MASK,
        f"-k{MASK}",
        "--auth",
        MASK,
        "--db",
        f"pg://{MASK}@db.example/x",
        f"DB_PASS={MASK}",
        f'{{"password": "{MASK}"}}',
        "--max-tokens",
        "512",
    ]
    line = next(n for n in text.splitlines() if n.startswith("script"))
    assert f"--api-key '{MASK}' --lr 0.1" in line and "--max-tokens 512" in line  # shell words


def _dry_run(capsys, sweep_dir, script, *axes):
    argv = ["--script", str(script), f"run.dir={sweep_dir}"]
    for a in axes:
        argv += ["--sweep", a]
    assert submit_main([*argv, "--dry-run", "--", "--lr", "0.1"]) == 0
    return capsys.readouterr().out


def test_sweep_members_are_named_without_their_secrets_unique_and_stable(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("")
    d = tmp_path / "sw"
    axes = (
        f"arg:--api-key={','.join(KEYS)}",
        "arg:--db=pg://u:p1-s3cr3t/x@h/db,pg://u:p2-s3cr3t@x@h/db",
        "arg:-k=k1-s3cr3t,k2-s3cr3t",
    )
    out = _dry_run(capsys, d, script, *axes)
    names = [line.split()[0] for line in out.splitlines() if line.endswith(" new")]
    assert len(names) == 12 and len(set(names)) == 12, out
    assert "s3cr3t" not in out  # neither in the names nor in the array's script
    assert all(n.startswith("api-key=masked,db=pg_masked_h_db,k=masked-") for n in names), names
    assert not d.exists()  # a dry run writes nothing
    assert _dry_run(capsys, d, script, *axes) == out  # stable: the same names again
    members = sweep.expand(None, [f"run.dir={d}"], list(axes), str(script), ["--lr", "0.1"]).members
    assert [m.name for m in members] == names
    assert members[0].config.script.args[:4] == ["--lr", "0.1", "--api-key", KEYS[0]]  # as typed


def _unmasked_name(values, result):
    """A member's name as the values read before they were masked (the reference, written out
    here): the label and the value as typed, then the hash of the result and the values."""
    readable = ",".join(f"{k[len('arg:') :].lstrip('-')}={v}" for k, v in sorted(values.items()))
    exact = json.dumps([result, values], sort_keys=True, default=str)
    return f"{readable}-{hashlib.sha256(exact.encode()).hexdigest()[:6]}"


def test_a_member_the_index_holds_under_its_unmasked_name_is_found_again(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("")
    d = tmp_path / "sw"
    first = sweep.expand(
        None, [f"run.dir={d}"], ["arg:--api-key=K1old"], str(script), ["--lr", "0.1"]
    )
    m = first.members[0]
    result = fingerprint.result_fingerprint(m.config.to_dict())
    old = _unmasked_name(m.values, result)
    assert old.startswith("api-key=K1old-") and m.name == f"api-key=masked-{old[-6:]}"
    # The sweep as a version that named members by their values left it: one member, completed.
    index, _ = sweep_index.merge(None, first)
    index["members"][0]["name"] = old
    os.makedirs(d)
    sweep_index.write_index(rundir.RunPaths(str(d)), index)
    _script_run(os.path.join(d, old), ["--lr", "0.1", "--api-key", "K1old"])
    out = _dry_run(capsys, d, script, "arg:--api-key=K1old,K2new")
    listed = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()[1:3]}
    assert listed[old] == "skip (completed)", out
    (new,) = (n for n in listed if n != old)
    assert new.startswith("api-key=masked-") and listed[new] == "new" and "K2new" not in out


def test_status_of_a_sweep_masks_each_members_secret_values(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("")
    d = tmp_path / "sw"
    sw = sweep.expand(
        None,
        [f"run.dir={d}"],
        [f"arg:--api-key={KEYS[0]},{KEYS[2]}", "trackers.mlflow.uri=https://u:P1-s3/cr@t@ml.ex"],
        str(script),
        [],
    )
    index, _ = sweep_index.merge(None, sw)
    sweep_index.write_index(sw.paths, index)
    assert status_main([sw.paths.root]) == 0
    text = capsys.readouterr().out
    assert status_main([sw.paths.root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for shown in (text, json.dumps(rows)):
        assert "s3cr3t" not in shown and "s3/cr" not in shown
    assert [(r["arg:--api-key"], r["trackers.mlflow.uri"]) for r in rows] == [
        (MASK, f"https://{MASK}@ml.ex")
    ] * 2
    assert text.splitlines()[1].split()[:3] == [MASK, f"https://{MASK}@ml.ex", "not"]


@pytest.mark.parametrize("value", ["0.1", "[64,32]"])
def test_a_sweep_without_secrets_keeps_its_names(value):
    """Names of values that hold no secret are as they always were."""
    values = {"train.lr": 0.1, "arg:--dims": value}
    result = "f" * 64
    assert sweep.member_name(values, result) == sweep.member_name(values, result, masked=False)
