"""The order of a run's calls as a table (train/call_order.py): for every phase and every call,
where the call leads or the one line that refuses it. A cell is the phase the call leads to, or
``-word``: refused, with the message of ``REFUSED[word]``."""

import pytest
from test_own_loop import Items, a_run, refused, set_up, train_step

from clusterflow.errors import UserError
from clusterflow.train.call_order import TRANSITIONS, Call, CallOrder, Phase, refusal

PHASES = {
    "open": Phase.OPEN,
    "rest": Phase.RESTORED,
    "btwn": Phase.BETWEEN,
    "epoch": Phase.EPOCH,
    "micro": Phase.MICRO,
    "due": Phase.STEP_DUE,
    "stepd": Phase.STEPPED,
    "done": Phase.LOOP_DONE,
    "fin": Phase.FINISHED,
    "stop": Phase.STOPPED,
}
CALLS = {
    "setup": Call.SETUP,
    "loader": Call.LOADER,
    "restore": Call.RESTORE,
    "epochs": Call.EPOCHS,
    "steps": Call.STEPS,
    "begin": Call.EPOCH_BEGIN,
    "iter": Call.ITERATE,
    "batch": Call.BATCH,
    "last": Call.LAST_BATCH,
    "counted": Call.COUNTED_STEP,
    "retake": Call.RETAKE,
    "step": Call.STEP,
    "mine": Call.MINE,
    "end": Call.EPOCH_END,
    "loopend": Call.LOOP_END,
    "finish": Call.FINISH,
    "stop": Call.STOP,
}
# What each refusal says (a part of its one line), and so the fix it names.
REFUSED = {
    "late": "came after run.restore",
    "twice": "run.restore was called twice: register every state in one call",
    "inloop": "came inside the",
    "early": "came before run.restore: register the model",
    "again": "came after the run's loop ended: one loop of run.epochs(n) or run.steps",
    "outside": "outside `for epoch in run.epochs(n):`",
    "iter": "run.loader is iterated inside `for epoch in run.epochs(n):`",
    "missing": "run.step() was not called after global step 7's batch of run.loader: call",
    "own": "no batch of run.loader came before this step; a DataLoader of your own",
    "double": "run.step() was called twice after one batch of run.loader",
    "part": "run.step() came after 2 of the 4 batches of a step",
    "minefirst": "run.mine(...) came before the end of epoch 2's steps (3 left)",
    "mineout": "run.mine(...) belongs inside `for epoch in run.epochs(n):`",
    "nofinish": "run.finish() came before run.restore(model=...)",
    "order": "the run's calls are out of order",
    "ended": "came after run.finish(): the run has ended (completed)",
    "caught": "came after the run stopped (requeued): the stop raised clusterflow.RunStopped",
}

# The calls around the loop ...
AROUND = """
       setup   loader  restore epochs  steps   finish    stop
open   open    open    rest    -early  -early  -nofinish stop
rest   -late   -late   -twice  btwn    btwn    fin       stop
btwn   -late   -late   -inloop -inloop -inloop fin       stop
epoch  -late   -late   -inloop -inloop -inloop fin       stop
micro  -late   -late   -inloop -inloop -inloop -missing  stop
due    -late   -late   -inloop -inloop -inloop -missing  stop
stepd  -late   -late   -inloop -inloop -inloop fin       stop
done   -late   -late   -twice  -again  -again  fin       stop
fin    -ended  -ended  -ended  -ended  -ended  -ended    -ended
stop   -caught -caught -caught -caught -caught -caught   -caught
"""
# ... and inside it.
INSIDE = """
       begin   iter     batch    last     counted  retake   step     mine       end      loopend
open   -order  -iter    -order   -order   -order   -order   -outside -mineout   -order   -order
rest   -order  -iter    -order   -order   -order   -order   -outside -mineout   -order   -order
btwn   epoch   -iter    -order   -order   -order   -order   -outside -mineout   -order   done
epoch  -order  epoch    micro    due      due      -order   -own     epoch      btwn     done
micro  -missing -missing micro   due      -missing epoch    -part    -minefirst -missing -missing
due    -missing -missing -missing -missing -missing epoch   stepd    -minefirst -missing -missing
stepd  -order  stepd    micro    due      due      -order   -double  stepd      btwn     done
done   -order  -iter    -order   -order   -order   -order   -outside -mineout   -order   -order
fin    -ended  -ended   -ended   -ended   -ended   -ended   -ended   -ended     -ended   -ended
stop   -caught -caught  -caught  -caught  -caught  -caught  -caught  -caught    -caught  -caught
"""

FACTS = {"step": 7, "micro": 2, "accumulate": 4, "epoch": 2, "left": 3}


def cells():
    columns = []
    for table in (AROUND, INSIDE):
        lines = [line.split() for line in table.strip().splitlines()]
        header = lines[0]
        columns += header
        assert [row[0] for row in lines[1:]] == list(PHASES), "every phase is a row"
        for row in lines[1:]:
            assert len(row) == len(header) + 1, row[0]
            for name, cell in zip(header, row[1:]):
                yield PHASES[row[0]], CALLS[name], cell
    assert sorted(columns) == sorted(CALLS), "every call is a column, once"


@pytest.mark.parametrize("phase, call, cell", list(cells()), ids=lambda v: getattr(v, "name", v))
def test_the_call_order_is_the_table(phase, call, cell):
    order = CallOrder(lambda: FACTS)
    order.phase = phase
    order.outcome = "requeued" if phase is Phase.STOPPED else "completed"
    if not cell.startswith("-"):
        assert TRANSITIONS.get((phase, call)) is PHASES[cell]
        assert order.enter(call) is PHASES[cell] and order.phase is PHASES[cell]
        return
    assert (phase, call) not in TRANSITIONS
    with pytest.raises(UserError) as e:
        order.enter(call)
    message = str(e.value)
    assert order.phase is phase, "a refused call moves nothing"
    assert "\n" not in message
    assert REFUSED[cell[1:]] in message, message
    assert message == refusal(phase, call, {**FACTS, "outcome": order.outcome})


def test_every_transition_is_in_the_table():
    listed = {(p, c) for p, c, cell in cells() if not cell.startswith("-")}
    assert listed == set(TRANSITIONS)


# -- the same order on a run: each out-of-order call of issue 48's list refused with one line ----


def test_restore_before_setup_a_second_restore_and_loops_twice_are_refused(tmp_path):
    run = a_run(tmp_path, "order")
    plain = __import__("torch").nn.Linear(4, 2)
    message = refused(run.restore, model=plain)  # before run.setup
    assert "was not passed to run.setup" in message and "run.setup(model, optimizer)" in message
    model, opt, _ = set_up(run)
    loader = run.loader(Items(), batch_size=8)
    assert not run.restore(model=model, optimizer=opt)  # the refused one registered nothing
    assert "run.restore was called twice" in refused(run.restore, model=model)
    assert "run.loader(...) came after run.restore" in refused(run.loader, Items(), 8)
    for _ in run.epochs(1):
        inner = refused(lambda: next(iter(run.epochs(1))))
        assert inner.startswith("run.epochs(...) came inside the loop"), inner
        assert "came inside the epochs loop" in refused(run.restore, model=model)
        for x, _i in loader:
            train_step(model, opt, x)
            run.step()
    message = refused(lambda: next(iter(run.epochs(2))))
    assert message.startswith("run.epochs(...) came after the run's loop ended"), message
    assert "run.finish()" in message
    run.finish()
    assert refused(run.step) == "run.step came after run.finish(): the run has ended (completed)"
