"""The asynchronous stop agreement on real gloo ranks, with real signals: every rank stops at the
same poll, one poll after the reduce that first carried a signal, whichever rank got it."""

import os
import signal

import pytest
from multirank import SharedRanks


def _polls(signals, polls=12, agree_at=None):
    """Polls like the loop does; ``signals`` maps a poll number to {rank: signal} sent to this
    process just before that poll. Returns (poll number, reason) of the first stop, or None."""
    from clusterflow.distributed import comm as dist
    from clusterflow.train.preemption import Preemption, StopAgreement

    preemption = Preemption().install()
    stop = StopAgreement(preemption, timeout_s=60)
    try:
        for p in range(polls):
            sig = signals.get(p, {}).get(dist.rank())
            if sig is not None:
                os.kill(os.getpid(), sig)  # the real handler sets the flag
            reason = stop.agree() if p == agree_at else stop.poll()
            if reason:
                return p, reason
        return None
    finally:
        preemption.uninstall()


def _cases(cases):
    """Every case on the same ranks, one after the other (a fresh agreement each: new gloo
    groups)."""
    return [_polls(*case) for case in cases]


SIGNALLED_CASES = [({at: {rank: signal.SIGTERM}},) for rank, at in ((0, 0), (2, 3), (1, 7))]
# Rank 1's SIGUSR2 (time limit) reaches the reduce of poll 4, rank 2's SIGTERM that of poll 5:
# the strongest reason wins, and the later signal changes nothing.
SIGNALLED_CASES.append(({4: {1: signal.SIGUSR2}, 5: {2: signal.SIGTERM}},))


def test_one_signalled_rank_stops_every_rank_at_the_next_poll(ranks):
    per_rank = ranks["signalled"]
    assert all(got == per_rank[0] for got in per_rank)  # every rank, the same poll and reason
    # carried by the reduce started at poll `at`, read at `at + 1`
    assert per_rank[0] == [(1, "preempted"), (4, "preempted"), (8, "preempted"), (5, "timeout")]


# A blocking agreement right where the signal arrives (as after an epoch's last step), and one
# with no signal, after which polling goes on in step.
AGREE_CASES = [({6: {1: signal.SIGUSR1}}, 12, 6), ({8: {0: signal.SIGTERM}}, 12, 6), ({}, 5, 2)]


def test_agree_answers_at_once_and_leaves_nothing_in_flight(ranks):
    assert ranks["agree"] == [[(6, "timeout"), (9, "preempted"), None]] * 2


def test_one_process_stops_at_once(ranks):
    assert ranks["one process"] == [[(2, "preempted"), None]]


class _Clock:
    """A clock the test moves: each rank's steps take ``step_s`` of it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


INTERVAL_S = 5 / 128  # binary fractions: the test clock's sums and ratios are exact


def _paced(signals, polls, step_s, interval_s=INTERVAL_S):
    """Like ``_polls``, with the cadence on: this rank's steps take ``step_s[rank]`` of a test
    clock. Returns (poll, reason) of the first stop or None, the cadence then, and the reduces."""
    from clusterflow.distributed import comm as dist
    from clusterflow.train.preemption import Preemption, StopAgreement

    clock = _Clock()
    preemption = Preemption().install()
    stop = StopAgreement(preemption, timeout_s=60, interval_s=interval_s, clock=clock)
    try:
        for p in range(polls):
            clock.t += step_s[dist.rank()]
            sig = signals.get(p, {}).get(dist.rank())
            if sig is not None:
                os.kill(os.getpid(), sig)
            reason = stop.poll()
            if reason:
                return (p, reason), stop.every, stop.reduces
        return None, stop.every, stop.reduces
    finally:
        preemption.uninstall()


def _paced_cases(cases):
    return [_paced(*case) for case in cases]


# Steps of a fifth of the interval: reduces start at polls 0, 1, 2 (the first proposals need a
# pace), then every 5 polls: 7, 12, 17, ... A signal before poll 3 rides in the reduce of 7,
# read at 12; one before poll 7 rides in that same reduce. One rank slower (2.5 times)
# proposes 2: the smallest proposal is everyone's cadence, reduces at 0, 1, 2, 4, 6, ...
STEP, SLOW, FAST = 1 / 128, 2.5 / 128, 1 / 1024
PACED_CASES = [
    ({3: {1: signal.SIGTERM}}, 40, (STEP, STEP, STEP)),
    ({7: {2: signal.SIGUSR1}}, 40, (STEP, STEP, STEP)),
    ({}, 40, (STEP, STEP, STEP)),
    ({5: {0: signal.SIGTERM}}, 40, (STEP, SLOW, STEP)),
    ({}, 40, (FAST, FAST, FAST)),
]  # 40 steps would fill the interval: the cap, 16


def test_the_cadence_fills_the_interval_and_every_rank_stops_at_the_same_poll(ranks):
    per_rank = ranks["paced"]
    assert all(got == per_rank[0] for got in per_rank)
    stops = [(stopped, every) for stopped, every, _ in per_rank[0]]
    assert stops == [
        ((12, "preempted"), 5),
        ((12, "timeout"), 5),
        (None, 5),
        ((8, "preempted"), 2),
        (None, 16),
    ]
    assert per_rank[0][2][2] == 3 + len(range(7, 40, 5))  # 10 reduces for 40 polls
    assert per_rank[0][4][2] == 3 + len(range(18, 40, 16))


def _agree_mid_cadence(_):
    from clusterflow.train.preemption import Preemption, StopAgreement

    clock = _Clock()
    stop = StopAgreement(Preemption(), timeout_s=60, interval_s=INTERVAL_S, clock=clock)
    seen = []
    for p in range(20):
        clock.t += 1 / 128
        seen.append(stop.agree() if p == 9 else stop.poll())
    return seen, stop.every, stop.reduces


def test_agree_keeps_the_cadence_in_step(ranks):
    # A blocking agreement in the middle of a cadence (as after an epoch's last step) reads the
    # reduce in flight early; polling resumes with a fresh reduce at the next boundary.
    per_rank = ranks["agree mid cadence"]
    assert per_rank[0] == per_rank[1]
    seen, every, reduces = per_rank[0]
    assert seen == [""] * 20 and every == 5
    assert reduces == 3 + 1 + 1 + len([10, 15])  # 0, 1, 2, 7; agree's own at 9; 10, 15


@pytest.fixture(scope="module")
def ranks():
    """The cases of this module with one spawn per world size (each case makes a fresh agreement,
    with its own gloo groups, as ``_cases`` always did)."""
    return SharedRanks(
        {
            "signalled": (3, _cases, (SIGNALLED_CASES,)),
            "paced": (3, _paced_cases, (PACED_CASES,)),
            "agree": (2, _cases, (AGREE_CASES,)),
            "agree mid cadence": (2, _agree_mid_cadence, (None,)),
            "one process": (1, _cases, ([({2: {0: signal.SIGTERM}},), ({},)],)),
        }
    )
