"""The snapshots' file format (storage/tensors.py, PACKED): the skeleton pickled once and each
tensor's bytes, read back bitwise with each tensor's dtype, shape and stride; states it does not
carry as raw bytes go through torch.save; a damaged or foreign file is refused with a reason."""

import io
import pickle

import pytest
import torch

from clusterflow.distributed import tree
from clusterflow.storage import durable
from clusterflow.storage.tensors import MAGIC, PACKED, TORCH, serialize


def _dump(obj):
    buf = io.BytesIO()
    PACKED.dump(obj, buf)
    return buf.getvalue()


def _load(data):
    return PACKED.load(io.BytesIO(data))


def _same(a, b):
    """Equal nesting and leaves, tensors bitwise with their dtype, shape and stride."""
    sa, ta = tree.flatten(a)
    sb, tb = tree.flatten(b)
    assert sa == sb
    assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride())
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _state():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    sd = model.state_dict()
    return {
        "model": sd,  # an OrderedDict with _metadata
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous: its stride comes back
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "view": torch.arange(10)[2:7],  # a view with a storage offset
        "leaves": (1, 2.5, "x", b"\x00\xff", None, True, {3, 4}, bytearray(b"ab")),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "groups": [{"lr": 0.1, "params": [0, 1]}],
    }


def test_a_state_comes_back_bitwise_as_torch_save_gives_it():
    state = _state()
    data = _dump(state)
    assert data.startswith(MAGIC)
    back = _load(data)
    _same(back, torch.load(io.BytesIO(serialize(state)), weights_only=True))
    _same(back["model"], state["model"])
    assert back["t"].stride() == (1, 6)
    assert torch.isnan(back["nan"][0]) and str(back["nan"][1].item()) == "-0.0"


def test_the_tensors_bytes_are_written_without_torch_save(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("torch.save called for a state of plain tensors")

    monkeypatch.setattr(torch, "save", refuse)
    state = {f"w{i}": torch.full((8,), float(i)) for i in range(50)}
    back = _load(_dump(state))
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize(
    "odd",
    [
        torch.eye(3).to_sparse(),
        torch.ones(2, requires_grad=True),
        torch.nn.Parameter(torch.ones(2)),
        torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    ],
    ids=["sparse", "requires-grad", "parameter", "quantized"],
)
def test_a_tensor_it_cannot_carry_as_bytes_sends_the_state_through_torch_save(odd):
    state = {"odd": odd, "plain": torch.arange(4)}
    data = _dump(state)
    assert not data.startswith(MAGIC) and data == serialize(state)
    back = _load(data)
    assert type(back["odd"]) is type(odd) and torch.equal(back["plain"], state["plain"])


def test_a_file_torch_save_wrote_is_read_too():
    """Snapshots a version before this format wrote stay readable."""
    state = _state()
    _same(_load(serialize(state)), _load(_dump(state)))


class Foreign:
    def __init__(self):
        self.x = 1

    def __reduce__(self):
        return (print, ("never called",))


def _with_header(skeleton, sizes=(), metas=None):
    header = pickle.dumps((skeleton, list(sizes), dict(metas or {})))
    return MAGIC + len(header).to_bytes(8, "little") + header


def test_a_skeleton_naming_a_callable_is_refused_before_anything_runs(capsys):
    with pytest.raises(pickle.UnpicklingError, match="builtins.print is not a type"):
        _load(_with_header({"a": Foreign()}))
    assert "never called" not in capsys.readouterr().out


class Registered:
    def __init__(self, v=0):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Registered) and other.v == self.v


def test_a_class_given_to_add_safe_globals_is_read_as_torch_load_would():
    state = {"mine": Registered(7), "w": torch.ones(2)}
    data = _dump(state)
    with pytest.raises(pickle.UnpicklingError, match="add_safe_globals"):
        _load(data)
    with torch.serialization.safe_globals([Registered]):
        back = _load(data)
    assert back["mine"] == Registered(7) and torch.equal(back["w"], state["w"])


def test_views_of_one_storage_are_written_once_and_read_as_tensors_of_their_own():
    base = torch.arange(1000.0)
    arena = torch.cat([torch.zeros(64, dtype=torch.uint8), torch.get_rng_state()])
    state = {"a": base[10:20], "b": base.view(10, 100).t(), "c": base, "rng": arena[64:]}
    data = _dump(state)
    assert len(data) < 4000 + len(arena) + 2000  # the storage of a, b and c once
    back = _load(data)
    _same(back, torch.load(io.BytesIO(serialize(state)), weights_only=True))
    for t in back.values():
        assert t.storage_offset() == 0
    torch.set_rng_state(back["rng"])  # what a tensor inside a larger storage would crash


def test_a_truncated_or_lying_file_is_refused_with_a_reason():
    data = _dump({"w": torch.arange(100.0)})
    with pytest.raises(ValueError, match="runs past its end"):
        _load(data[:-64])
    lying = MAGIC + (10**12).to_bytes(8, "little") + data[len(MAGIC) + 8 :]
    with pytest.raises(ValueError, match="header of 1000000000000 bytes runs past its end"):
        _load(lying)
    header = _with_header({"w": tree.Slot(0, "w")}, [64], {0: (0, torch.float32, (17,), (1,), 0)})
    with pytest.raises(ValueError, match=r"shape \(17,\) reaches past its storage of 64 bytes"):
        _load(header + bytes(-len(header) % 64) + bytes(64))


def test_through_the_durable_writer_the_digest_covers_the_whole_file(tmp_path):
    state = _state()
    path = str(tmp_path / "train_state.pt")
    info = durable.write_file(path, state, fsync=False, codec=PACKED)
    with open(path, "rb") as f:
        assert f.read() == _dump(state)
    _same(durable.load_checked("train_state.pt", path, info, PACKED), state)
    with open(path, "r+b") as f:  # one bit flipped in a tensor's bytes
        f.seek(-70, 2)
        byte = f.read(1)
        f.seek(-70, 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="does not match its"):
        durable.load_checked("train_state.pt", path, info, PACKED)
    assert TORCH.versions["torch"] == PACKED.versions["torch"]


def test_a_state_handed_over_taken_apart_is_written_as_the_whole_would_be():
    """Snapshots hand each file over as the staging flattened it (tree.Flat, its slots numbered
    across every file): read back, it is the file's state."""
    files = {"model.pt": _state()["model"], "train_state.pt": _state()}
    skeleton, tensors = tree.flatten(files)
    for name, state in files.items():
        own = {s.index: tensors[s.index] for s in tree.slots(skeleton[name])}
        assert min(own) > 0 or name == "model.pt"
        _same(_load(_dump(tree.Flat(skeleton[name], own))), state)
    odd = {"w": torch.ones(2, requires_grad=True), "b": torch.arange(3)}
    skeleton, tensors = tree.flatten(odd)
    data = _dump(tree.Flat(skeleton, dict(enumerate(tensors))))
    assert data == serialize(odd)  # through torch.save, whole
