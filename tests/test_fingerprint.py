"""Keys that change results vs keys a resume may change (clusterflow.config.fingerprint)."""

import pytest

from clusterflow import config
from clusterflow.config import fingerprint
from clusterflow.config.sections import NUMERICS, RESOURCE, RESULT, doc


def cfg(*overrides):
    return config.load(None, list(overrides)).to_dict()


def test_every_config_key_is_classified_and_none_is_stale():
    declared = {
        f"{name}.{key}" for name, cls in config.SECTIONS.items() for key in config.keys(cls)
    }
    missing = sorted(declared - set(fingerprint.KEYS))
    stale = sorted(set(fingerprint.KEYS) - declared)
    assert not missing, f"give these fields doc(kind=..., why=...) in config/sections/: {missing}"
    assert not stale, f"these keys are no longer in config.SECTIONS: {stale}"
    assert {k for k, _ in fingerprint.KEYS.values()} == {RESULT, NUMERICS, RESOURCE}
    assert all(why for _, why in fingerprint.KEYS.values())


def test_a_field_declares_a_known_kind_and_a_reason():
    with pytest.raises(ValueError, match="kind='fast'"):
        doc(1, "a key", kind="fast", why="speed")
    with pytest.raises(ValueError, match="why=''"):
        doc(1, "a key", kind=RESULT, why="")
    with pytest.raises(TypeError):
        doc(1, "a key")  # kind and why are required


@pytest.mark.parametrize(
    "override",
    [
        "cluster.time_min=240",
        "cluster.partition=high",
        "cluster.max_timeout_requeues=9",
        "cluster.mem_gb=16",
        "data.num_workers=4",
        "checkpoint.every_steps=7",
        "checkpoint.keep_last=5",
        "train.log_every_steps=3",
        "train.progress_bar=false",
        "run.name=other",
        "run.dir=elsewhere",
        "dist.timeout_s=30",
        "mining.timeout_s=60",
        "cluster.sbatch_extra={mail-type: END}",
        # numerics: the same experiment, computed in another order
        "cluster.nodes=2",
        "dist.bucket_cap_mb=50",
        "train.eval_every_epochs=2",
        "mining.embed_batch=64",
    ],
)
def test_resource_and_numerics_changes_keep_the_result_fingerprint(override):
    assert fingerprint.result_fingerprint(cfg(override)) == fingerprint.result_fingerprint(cfg())
    result, other = fingerprint.compare(cfg(), cfg(override))
    assert result == [] and other and other[0].key.startswith(override.split("=")[0])


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=0.01",
        "run.seed=1",
        "mining.k=5",
        "mining.threshold=0.7",
        "train.epochs=9",
        "train.grad_accum=2",
        "task.params.identities=50",
        "task.init_from=runs/stage1",
        "train.amp=bf16",
        "train.tf32=false",
        "dist.sync_batchnorm=true",
        "mining.index=hnsw",
    ],
)
def test_result_changes_change_the_fingerprint_and_are_named(override):
    assert fingerprint.result_fingerprint(cfg(override)) != fingerprint.result_fingerprint(cfg())
    result, _ = fingerprint.compare(cfg(), cfg(override))
    assert [c.key for c in result] == [override.split("=")[0]]


def test_messages_name_key_old_and_new_and_say_when_not_bitwise():
    _, other = fingerprint.compare(cfg("cluster.time_min=60"), cfg("cluster.time_min=240"))
    assert [str(c) for c in other] == ["cluster.time_min 60 -> 240"]
    _, other = fingerprint.compare(
        cfg("cluster.nodes=2", "train.batch_size=128"), cfg("cluster.nodes=1")
    )
    (c,) = other
    assert str(c).startswith(
        "cluster.nodes 2 -> 1 (resumes, not bitwise: the global-batch sampler keeps the data order"
    )
    result, _ = fingerprint.compare(cfg("train.lr=0.001"), cfg("train.lr=0.01"))
    assert fingerprint.summary(result) == "train.lr 0.001 -> 0.01"
    _, other = fingerprint.compare(cfg("cluster.partition=low"), cfg("cluster.partition=high"))
    assert str(other[0]) == 'cluster.partition "low" -> "high"'


def test_world_size_changes_the_result_when_the_learning_rate_scales_with_it():
    old, new = (
        cfg("cluster.nodes=2", "train.lr_scaling=linear"),
        cfg("cluster.nodes=1", "train.lr_scaling=linear"),
    )
    result, other = fingerprint.compare(old, new)
    assert [c.key for c in result] == ["derived.world_size"] and "lr_scaling" in str(result[0])
    assert [c.key for c in other] == ["cluster.nodes"]
    assert fingerprint.result_fingerprint(old) != fingerprint.result_fingerprint(new)
    # without scaling, the world size is numerics only
    assert fingerprint.compare(cfg("cluster.nodes=2"), cfg("cluster.nodes=1"))[0] == []


def test_amp_auto_on_gpu_vs_cpu_is_a_precision_change():
    cpu, gpu = cfg(), cfg("cluster.gpus_per_node=2", "cluster.tasks_per_node=2")
    result, _ = fingerprint.compare(cpu, gpu)
    assert [(c.key, c.old, c.new) for c in result] == [("derived.precision", "none", "bf16")]
    # gloo trains on CPU even where GPUs are: auto means no mixed precision again
    gloo = cfg("cluster.gpus_per_node=2", "cluster.tasks_per_node=2", "dist.backend=gloo")
    assert fingerprint.compare(cpu, gloo)[0] == []
    # an explicit precision keeps it whatever the device
    result, other = fingerprint.compare(
        cfg("train.amp=none"),
        cfg("train.amp=none", "cluster.gpus_per_node=2", "cluster.tasks_per_node=2"),
    )
    assert result == [] and {c.kind for c in other} == {NUMERICS}


def test_unknown_keys_count_as_result_and_sub_keys_are_named():
    assert (
        fingerprint.kind("newsection.key") == RESULT
        and fingerprint.kind("train.not_yet_classified") == RESULT
    )
    assert (
        fingerprint.kind("task.params.anything") == RESULT
        and fingerprint.kind("cluster.sbatch_extra.x") == RESOURCE
    )
    old, new = cfg(), cfg()
    new["train"]["brand_new"] = 1  # a key added to config/sections/ and forgotten here
    result, _ = fingerprint.compare(old, new)
    assert str(result[0]) == "train.brand_new (unset) -> 1"
    result, _ = fingerprint.compare(
        cfg("task.params={a: 1, b: 2}"), cfg("task.params={a: 1, b: 3}")
    )
    assert [str(c) for c in result] == ["task.params.b 2 -> 3"]
    # an empty mapping and a missing one are the same config
    assert fingerprint.result_fingerprint(cfg("task.params={}")) == fingerprint.result_fingerprint(
        cfg()
    )


def test_docs_table_is_generated_from_the_code():
    import os

    from conftest import REPO

    page = open(os.path.join(REPO, "docs", "workflows.md")).read()
    assert fingerprint.reference_markdown() in page, (
        "regenerate the table: python -c 'from clusterflow.config import fingerprint; "
        "print(fingerprint.reference_markdown())'"
    )
