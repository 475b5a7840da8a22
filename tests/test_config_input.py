"""Config files and overrides as people really write them, and as they arrive broken: every one is
read, or refused with one line naming the file (and line), the value and the fix (issue 12)."""

import codecs
import os
import stat
import subprocess
import sys
import threading

import pytest

from clusterflow import config
from clusterflow.config import yaml_file as config_yaml
from clusterflow.errors import UserError


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(p)


def refused(*args, **kwargs):
    with pytest.raises(UserError) as e:
        config.load(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# -- numbers -----------------------------------------------------------------------------------

FLOATS = [
    "3e-4",
    "1e10",
    "1E-3",
    ".5",
    "5.",
    "+1e-3",
    "-1e-3",
    "1_000.5",
    "1.0e10",
    "1.0e+10",
    "7",
    "0.001",
]


@pytest.mark.parametrize("text", FLOATS)
def test_a_float_field_takes_every_float_python_reads(tmp_path, text):
    want = abs(float(text))
    key = "train.weight_decay"  # >= 0; the sign is tested with train.lr below
    assert (
        config.load(
            write(tmp_path, f"train: {{weight_decay: {text.lstrip('+-')}}}\n")
        ).train.weight_decay
        == want
    )
    assert config.load(None, [f"{key}={text.lstrip('+-')}"]).train.weight_decay == want
    if not text.startswith("-"):
        assert config.load(None, [f"train.lr={text}"]).train.lr == float(text)
    assert config.load(None, [f"train.lr='{text.lstrip('-')}'"]).train.lr == float(
        text.lstrip("-")
    )  # quoted: a string Python reads


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", ".inf", ".nan", "1e400", "Infinity"])
def test_non_finite_numbers_are_refused_by_name(tmp_path, text):
    assert refused(None, [f"train.lr={text}"]).startswith("train.lr = ")
    assert "must be a finite number" in refused(None, [f"train.weight_decay={text}"])
    assert "must be a finite number" in refused(write(tmp_path, f"mining: {{threshold: {text}}}\n"))


@pytest.mark.parametrize(
    "text,want",
    [
        ("1e3", 1000),
        ("1.5e3", 1500),
        ("1_000", 1000),
        ("1E2", 100),
        ("2.0", 2),
        ("'12'", 12),
        ("0x10", 16),
    ],
)
def test_an_integer_field_takes_whole_numbers_in_any_notation(text, want):
    assert config.load(None, [f"train.log_every_steps={text}"]).train.log_every_steps == want


@pytest.mark.parametrize(
    "text,needle",
    [
        ("1.5", "train.epochs = 1.5: expected an integer (a whole number"),
        ("1e-3", "train.epochs = 1e-3: expected an integer"),
        ("1e30", "train.epochs = 1e30: out of range; at most 9223372036854775807"),
        ("99999999999999999999", "out of range"),
        ("nan", "expected an integer"),
        ("true", "expected an integer, got bool"),
    ],
)
def test_an_integer_field_refuses_what_is_not_exactly_an_integer(text, needle):
    assert needle in refused(None, [f"train.epochs={text}"])


def test_a_5000_digit_integer_is_refused_with_its_line(tmp_path):
    msg = refused(write(tmp_path, "run:\n  name: x\n  seed: " + "9" * 5000 + "\n"))
    assert ":3:9: an integer of 5000 digits" in msg and "4300" in msg
    assert "an integer of 5000 digits" in refused(None, ["run.seed=" + "9" * 5000])
    assert (
        config.load(None, ["run.name=" + "9" * 5000]).run.name == "9" * 5000
    )  # a string may be that long


def test_strings_keep_the_text_as_written(tmp_path):
    cfg = config.load(
        write(
            tmp_path, "run: {name: 1e3, dir: 2024.10}\ncluster: {partition: 007, qos: 2024-01-01}\n"
        )
    )
    assert (cfg.run.name, cfg.run.dir, cfg.cluster.partition, cfg.cluster.qos) == (
        "1e3",
        "2024.10",
        "007",
        "2024-01-01",
    )
    assert (
        config.load(None, ["cluster.partition=007", "run.name='quoted'"]).cluster.partition == "007"
    )


def test_seed_bound_is_the_rng_bound(tmp_path):
    assert "must be between 0 and 2**32-1" in refused(None, [f"run.seed={2**32}"])
    assert "must be >= 0" not in refused(None, ["run.seed=-1"])
    assert config.load(None, [f"run.seed={2**32 - 1}"]).run.seed == 2**32 - 1


def test_the_largest_seed_works_everywhere_it_is_used():
    """run.seed < 2**32 is enough for every seed derived from it (checkpoint/rng.py,
    distributed/sampler.py, the tasks)."""
    from clusterflow.checkpoint.rng import rank_seed, seed_everything
    from clusterflow.distributed.sampler import epoch_permutation
    from clusterflow.tasks.pseudo_id import PseudoIDTask

    top = 2**32 - 1
    seed_everything(top)
    seed_everything(rank_seed(top, 1023))
    assert sorted(epoch_permutation(10, top, 10_000).tolist()) == list(range(10))
    assert len(PseudoIDTask(seed=top, identities=2, samples_per_identity=2).train_dataset()) == 4


# -- encodings and what a file may be -------------------------------------------------------------

CFG = "train:\n  epochs: 3\nrun:\n  name: café\n"


@pytest.mark.parametrize(
    "encoding,bom",
    [
        ("utf-8", b""),
        ("utf-8", codecs.BOM_UTF8),
        ("utf-16-le", codecs.BOM_UTF16_LE),
        ("utf-16-be", codecs.BOM_UTF16_BE),
        ("utf-16-le", b""),
        ("utf-16-be", b""),
        ("utf-32-le", codecs.BOM_UTF32_LE),
        ("utf-32-be", b""),
    ],
)
def test_utf8_16_32_with_or_without_bom_are_read(tmp_path, encoding, bom):
    cfg = config.load(write(tmp_path, bom + CFG.encode(encoding)))
    assert (cfg.train.epochs, cfg.run.name) == (3, "café")


@pytest.mark.parametrize(
    "data,needle",
    [
        (CFG.encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not"),
        (b"train: {epochs: 3}\n\x00\x00", "NUL character"),
        (b"train: {epochs: 3}\nrun: {name: \x07}\n", "line 2 holds the character '\\x07'"),
        (bytes(range(256)) * 4, "binary file"),
    ],
)
def test_binary_and_foreign_bytes_are_refused(tmp_path, data, needle):
    msg = refused(write(tmp_path, data))
    assert needle in msg and "c.yaml" in msg


def _without_dac_override():
    """In the child before exec: drop the capabilities that let root read any file (from the
    bounding set, so the exec'd process never has them)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP


def test_unreadable_file(tmp_path):
    path = write(tmp_path, CFG)
    os.chmod(path, 0)
    if os.geteuid() != 0:
        assert "not readable by this user (permission denied)" in refused(path)
        return
    # root reads any file: run the CLI without root's override, for real
    out = subprocess.run(
        [sys.executable, "-m", "clusterflow.submit", path, "--dry-run"],
        check=False,
        capture_output=True,
        text=True,
        preexec_fn=_without_dac_override,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (
        f"error: config file {path!r} is not readable by this user (permission denied)"
        in out.stderr
    )


def test_a_file_that_fails_to_read():
    # /proc/self/mem is a regular file whose first page is unmapped: read() fails with EIO
    assert "cannot read config file '/proc/self/mem': Input/output error" in refused(
        "/proc/self/mem"
    )


def test_endless_inputs_are_cut_off(tmp_path, monkeypatch):
    assert "is a character device (like /dev/zero), not a file" in refused("/dev/zero")
    big = write(tmp_path, "# " + "x" * config_yaml.MAX_BYTES + "\n")
    assert "larger than 1 MiB (or endless)" in refused(big)
    fifo = str(tmp_path / "pipe.yaml")
    os.mkfifo(fifo)

    def endless():
        try:
            with open(fifo, "wb") as f:
                while True:
                    f.write(b"# yes\n" * 4096)
        except BrokenPipeError:
            pass  # the reader stopped at its limit

    writer = threading.Thread(target=endless, daemon=True)
    writer.start()
    assert "larger than 1 MiB (or endless)" in refused(fifo)
    writer.join(10)
    monkeypatch.setattr(config_yaml, "PIPE_WAIT_S", 0.2)
    assert "is a named pipe and nothing wrote to it" in refused(fifo)


def test_a_pipe_that_is_written_to_is_read(tmp_path):
    """What `submit <(sed ... cfg.yaml)` passes: a pipe with a writer."""
    fifo = str(tmp_path / "pipe.yaml")
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: open(fifo, "w").write(CFG), daemon=True)
    writer.start()
    assert config.load(fifo).train.epochs == 3


# -- YAML structure -------------------------------------------------------------------------------


@pytest.mark.parametrize("loader", config_yaml._LOADERS, ids=lambda c: c.__name__)
def test_deep_nesting_is_refused_with_its_line(tmp_path, monkeypatch, loader):
    """The refusal is the project's own over either parser: libyaml stops at its own nesting limit
    (0.2.6: 1000 levels) before the composer counts 101, PyYAML's parser has none."""
    monkeypatch.setattr(config_yaml, "_Loader", loader)
    assert "nesting deeper than 100 levels" in refused(
        write(tmp_path, "train: " + "[" * 5000 + "]" * 5000 + "\n")
    )
    nested = "task:\n  params:\n    a: " + "{a: " * 150 + "1" + "}" * 150 + "\n"
    assert "c.yaml:3:" in refused(write(tmp_path, nested))
    assert "nesting deeper than" in refused(None, ["task.params.a=" + "[" * 3000])


def test_duplicate_keys_name_both_lines(tmp_path):
    msg = refused(write(tmp_path, "train:\n  epochs: 3\n  lr: 0.1\n  epochs: 4\n"))
    assert msg.startswith(f"{tmp_path}/c.yaml:4:3: duplicate key 'epochs' (first given at line 2)")
    assert "duplicate key 'train'" in refused(
        write(tmp_path, "train: {epochs: 3}\nrun: {}\ntrain: {epochs: 4}\n")
    )
    assert "duplicate key 'a'" in refused(write(tmp_path, "task: {params: {a: 1, b: 2, a: 1}}\n"))


def test_merge_keys_may_be_overridden(tmp_path):
    text = "defaults: &d {epochs: 2, lr: 0.5}\n"
    with pytest.raises(UserError, match="unknown section 'defaults'"):
        config.load(write(tmp_path, text))  # (a YAML anchor must live somewhere a config allows)
    cfg = config.load(
        write(
            tmp_path,
            "task:\n  params: &d {a: 1, b: 2}\ntrain: {epochs: 2}\ndata: {}\n"
            "mining:\n  <<: {k: 4, threshold: 0.2}\n  k: 5\n",
        )
    )
    assert (cfg.mining.k, cfg.mining.threshold, cfg.task.params) == (5, 0.2, {"a": 1, "b": 2})


def test_anchor_bombs_and_endless_aliases_are_refused(tmp_path):
    lines = ["task:", "  params:", '    a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    assert "expand to more than 100000 values" in refused(write(tmp_path, "\n".join(lines) + "\n"))
    assert "an alias refers to a value that contains it" in refused(
        write(tmp_path, "task: {params: &p {a: *p}}\n")
    )
    reuse = "cluster:\n  setup: &s [module load cuda, source env.sh]\n  srun_args: *s\n"
    assert config.load(write(tmp_path, reuse)).cluster.srun_args == [
        "module load cuda",
        "source env.sh",
    ]


def test_tabs_say_spaces(tmp_path):
    msg = refused(write(tmp_path, "train:\n\tepochs: 3\n"))
    assert "c.yaml:2:1" in msg and "YAML indents with spaces, not tabs" in msg


@pytest.mark.parametrize(
    "text,needle",
    [
        (
            "- train\n- run\n",
            (
                "the top level must be a mapping of sections (run, cluster, dist, train, "
                "checkpoint, mining, task, data, trackers, observe, script), got a list"
            ),
        ),
        ("hello\n", "got 'hello'"),
        ("0\n", "got 0"),
        ("false\n", "got false"),
        ("1: 2\n", "section 1 is not a name; sections are words: run, cluster"),
        ("null:\n", "section null is not a name"),
        ("train:\n  1: 2\n", "key 1 is not a name; keys of [train] are words: epochs, batch_size"),
        ("train:\n  null: 2\n", "key null is not a name"),
        ("task:\n  params: {1: 2}\n", "task.params has the key 1 (int); keys are names: quote it"),
        ("train: 5\n", "section 'train' must be a mapping of keys, got 5"),
        ("train:\n  lr:\n", "train.lr is empty; give it a value"),
        ('run: {name: "a\\nb"}\n', "holds the control character '\\n'"),
        ('run: {dir: "a\\x00b"}\n', "holds the control character '\\x00'"),
        ('run: {name: "\\ud800"}\n', "c.yaml:1:16: found invalid Unicode character escape code"),
        ("task: {params: {d: !!timestamp 2024-01-01}}\n", "expected a plain value"),
        ("task: {params: {d: !!binary aGVsbG8=}}\n", "expected a plain value"),
        (
            "task: {params: {d: !!timestamp 2001-02-30}}\n",
            "cannot read a value (day is out of range for month)",
        ),
        ("task: {params: {d: !!python/object:os.system ls}}\n", "malformed YAML at"),
    ],
)
def test_yaml_shapes_that_are_not_a_config(tmp_path, text, needle):
    assert needle in refused(write(tmp_path, text))


def test_empty_file_is_the_defaults(tmp_path):
    assert config.load(write(tmp_path, "")) == config.load(None)
    assert config.load(write(tmp_path, "# only a comment\n")) == config.load(None)


def test_dates_and_words_stay_strings_in_task_params():
    assert config.load(None, ["task.params.day=2024-01-01"]).task.params == {"day": "2024-01-01"}
    assert config.load(None, ["task.params.lr=3e-4"]).task.params == {"lr": 3e-4}
    assert (
        type(config.load(None, ["task.params.n=1_000"]).task.params["n"]) is int
    )  # plain types leave the config


def test_non_utf8_override_is_refused():
    bad = os.fsdecode(b"train.lr=\xff")  # what Python makes of bytes from a non-UTF-8 terminal
    assert refused(None, [bad]) == (
        "override b'train.lr=\\xff' is not UTF-8 text; type it in a UTF-8 terminal (check the "
        "locale: LANG=C.UTF-8)"
    )
    assert "is not UTF-8 text" in refused(None, [os.fsdecode(b"run.name=caf\xe9")])


def test_non_utf8_override_on_the_command_line(cli):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "clusterflow.submit",
            "configs/tiny.yaml",
            b"run.name=\xff",
            "--dry-run",
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: override b'run.name=\\xff' is not UTF-8 text" in out.stderr


def test_control_characters_never_reach_the_sbatch_script():
    assert "holds the control character" in refused(
        None, ['cluster.partition="gpu\\n#SBATCH --qos=high"']
    )
    assert "holds the control character" in refused(None, ['cluster.setup=["echo a\\necho b"]'])


def test_config_file_not_a_regular_path(tmp_path):
    assert "is a directory" in refused(str(tmp_path))
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert "is a character device" in refused("/dev/null")
