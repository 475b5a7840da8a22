"""Sweep expansion: --sweep parsing, the cartesian product, validation of every member, member
names."""

import os
import textwrap

import pytest

from clusterflow.errors import UserError
from clusterflow.sweeps import sweep


@pytest.fixture
def conf(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        textwrap.dedent(f"""
        run: {{dir: {tmp_path / "sw"}}}
        train: {{epochs: 2, batch_size: 8}}
    """)
    )
    return str(p)


@pytest.mark.parametrize(
    "text,values",
    [
        ("0.001,0.01", ["0.001", "0.01"]),
        ("7", ["7"]),
        ("[1,2],[3,4]", ["[1,2]", "[3,4]"]),
        ("{a: 1, b: [2,3]},{a: 4}", ["{a: 1, b: [2,3]}", "{a: 4}"]),
        ("'a,b',c", ["'a,b'", "c"]),
        ('"x]",y', ['"x]"', "y"]),
        (" a , b ", ["a", "b"]),
        ("''", ["''"]),
    ],
)
def test_values_split_at_top_level_commas(text, values):
    assert sweep.split_values(text, "k") == values


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[1,2", "unclosed ']'"),
        ("1,2]", "unbalanced ']'"),
        ("[1,2}", "unbalanced '}'"),
        ("'a,b", 'unclosed "\'"'),
        ("1,,2", "an empty value"),
        ("1,2,", "an empty value"),
    ],
)
def test_bad_value_lists_are_named(text, needle):
    with pytest.raises(UserError, match="--sweep k="):
        sweep.split_values(text, "k")
    with pytest.raises(UserError) as e:
        sweep.split_values(text, "k")
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "args,overrides,needle",
    [
        (["train.lr"], [], "must look like section.key=V1,V2"),
        (["lr=1,2"], [], "must look like section.key=V1,V2"),
        (["train.lr="], [], "must look like section.key=V1,V2"),
        (
            ["cluster.nodes=1,2"],
            [],
            "cannot vary cluster.nodes: a job array asks Slurm for one set of resources",
        ),
        (["run.dir=a,b"], [], "cannot vary run.dir"),
        (["checkpoint.dir=a,b"], [], "cannot vary checkpoint.dir"),
        (["train.lr=1,2", "train.lr=3"], [], "train.lr is also set by another --sweep"),
        (["train.lr=1,2"], ["train.lr=0.1"], "train.lr is also set by a KEY=VALUE override"),
        (
            ["task.params.a=1,2"],
            ["task.params={a: 3}"],
            "task.params is also set by a KEY=VALUE override",
        ),
        (
            ["task.params={a: 1},{a: 2}", "task.params.b=1,2"],
            [],
            "task.params is also set by another --sweep",
        ),
        ([], [], "at least one --sweep"),
        (
            [
                f"run.seed={','.join(map(str, range(40)))}",
                f"train.lr={','.join(str(i + 1) for i in range(30))}",
            ],
            [],
            "the sweep has 1200 members (40 x 30)",
        ),
    ],
)
def test_parse_refuses_what_cannot_be_one_sweep(args, overrides, needle):
    with pytest.raises(UserError) as e:
        sweep.parse(args, overrides)
    assert needle in str(e.value)


def test_expand_is_the_cartesian_product_in_a_stable_order(conf, tmp_path):
    sw = sweep.expand(conf, ["mining.threshold=0.6"], ["train.lr=0.001,1.0e-2", "mining.k=10,5"])
    assert sw.paths.root == str(tmp_path / "sw") and sw.keys == ["train.lr", "mining.k"]
    # the first --sweep varies slowest; values are resolved like overrides (1.0e-2 is the number
    # 0.01)
    assert [m.values for m in sw.members] == [
        {"train.lr": 0.001, "mining.k": 10},
        {"train.lr": 0.001, "mining.k": 5},
        {"train.lr": 0.01, "mining.k": 10},
        {"train.lr": 0.01, "mining.k": 5},
    ]
    assert [m.name.rsplit("-", 1)[0] for m in sw.members] == [
        "k=10,lr=0.001",
        "k=5,lr=0.001",
        "k=10,lr=0.01",
        "k=5,lr=0.01",
    ]
    for m in sw.members:
        assert m.run_dir == os.path.join(sw.paths.root, m.name)
        assert (
            m.config.train.lr == m.values["train.lr"] and m.config.mining.k == m.values["mining.k"]
        )
        assert m.config.mining.threshold == 0.6 and m.config.train.epochs == 2
        assert m.config.checkpoint_dir == os.path.join(m.run_dir, "checkpoints")
    # the base config is everything but the swept keys
    assert (
        "lr" not in sw.base["train"]
        and "k" not in sw.base["mining"]
        and sw.base["run"]["dir"] == sw.paths.root
    )
    # the order of the --sweep flags changes neither the members' names nor their dirs
    again = sweep.expand(conf, ["mining.threshold=0.6"], ["mining.k=10,5", "train.lr=0.001,1.0e-2"])
    assert sorted(m.name for m in again.members) == sorted(m.name for m in sw.members)


def test_types_follow_the_config(conf):
    sw = sweep.expand(
        conf,
        [],
        [
            "task.params.dims=[64,32],[128,64]",
            "mining.enabled=true,false",
            "mining.index=flat,'hnsw'",
        ],
    )
    assert sw.members[0].values == {
        "task.params.dims": [64, 32],
        "mining.enabled": True,
        "mining.index": "flat",
    }
    assert (
        sw.members[-1].config.task.params == {"dims": [128, 64]}
        and sw.members[-1].config.mining.index == "hnsw"
    )
    # keys in name order: sorted by the whole key (mining.* before task.*)
    assert sw.members[0].name.startswith("enabled=true,index=flat,dims=64_32-")


def test_every_invalid_member_is_reported_at_once_by_name(conf):
    with pytest.raises(UserError) as e:
        sweep.expand(conf, [], ["train.grad_accum=1,3", "mining.k=0,5"])
    msg = str(e.value)
    assert msg.startswith("3 of 4 sweep members are invalid (nothing was submitted)")
    assert "member train.grad_accum=1,mining.k=0: mining.k = 0: must be >= 1" in msg
    assert (
        "member train.grad_accum=3,mining.k=0:" in msg
        and "member train.grad_accum=3,mining.k=5: train.batch_size = 8" in msg
    )
    assert "member train.grad_accum=1,mining.k=5" not in msg


def test_an_error_every_member_shares_is_said_once(conf):
    with pytest.raises(UserError) as e:
        sweep.expand(conf, ["train.epochz=3"], ["train.lr=1,2"])
    assert str(e.value).startswith(
        "every member of the sweep fails:"
    ) and "unknown key train.epochz" in str(e.value)
    with pytest.raises(UserError, match="train.lr = 'x': expected a number"):
        sweep.expand(conf, [], ["train.lr=x,y"])


def test_two_spellings_of_one_value_are_refused(conf):
    with pytest.raises(
        UserError, match=r"--sweep train.lr: 0.1 and 0.10 are the same value \(0.1\)"
    ):
        sweep.expand(conf, [], ["train.lr=0.1,0.10"])


def test_members_get_their_own_checkpoint_dir_when_one_is_set(conf):
    sw = sweep.expand(conf, ["checkpoint.dir=memory://ck/"], ["run.seed=1,2"])
    assert [m.config.checkpoint.dir for m in sw.members] == [
        f"memory://ck/{m.name}" for m in sw.members
    ]
    assert sw.base["checkpoint"]["dir"] == "memory://ck/"


def test_names_are_filesystem_safe_and_never_collide():
    fp = "0" * 16
    weird = {"task.params.path": "data/Ünïcode set/%j..x", "train.lr": 1e-05}
    name = sweep.member_name(weird, fp)
    assert "/" not in name and "%" not in name and " " not in name and name.isascii()
    assert name.startswith("path=data_Unicode_set_j..x,lr=1e-05-")
    long_a = {"task.params.x": "a" * 300 + "1"}
    long_b = {"task.params.x": "a" * 300 + "2"}
    na, nb = sweep.member_name(long_a, fp), sweep.member_name(long_b, fp)
    assert len(na.encode()) <= 120 and na.rsplit("-", 1)[0] == nb.rsplit("-", 1)[0] and na != nb
    # names that differ only in case stay distinct on a case-insensitive filesystem
    assert (
        sweep.member_name({"task.params.m": "A"}, fp).casefold()
        != sweep.member_name({"task.params.m": "a"}, fp).casefold()
    )
    # clashing short labels fall back to the whole key
    assert sweep.member_name({"train.lr": 1, "task.params.lr": 2}, fp).startswith(
        "task.params.lr=2,train.lr=1-"
    )


def test_names_change_with_the_result_config_but_not_with_resources(conf):
    def names(*overrides):
        return [m.name for m in sweep.expand(conf, list(overrides), ["train.lr=0.1,0.2"]).members]

    assert names("cluster.time_min=240", "cluster.partition=high", "data.num_workers=2") == names()
    assert names("train.epochs=3") != names()
    # members that differ only in a resource key still get their own dirs
    sw = sweep.expand(conf, [], ["data.num_workers=0,2"])
    assert len({m.name for m in sw.members}) == 2


def test_workflow_modules_stay_light_on_the_login_node():
    import subprocess
    import sys

    modules = [
        "config.fingerprint",
        "sweeps.sweep",
        "sweeps.index",
        "manage.sweep_status",
        "slurm.sbatch",
        "slurm.commands",
        "slurm.jobids",
        "rundir.submissions",
        "rundir.frozen_code",
        "manage.logs",
        "manage.cancel",
        "launch.submit",
        "launch.sweep",
    ]
    imports = "".join(f"import clusterflow.{m}\n" for m in modules)
    code = f"import sys\n{imports}print('torch' in sys.modules, 'faiss' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["False", "False"], out.stderr
