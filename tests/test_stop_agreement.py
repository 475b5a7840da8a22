"""The asynchronous stop agreement on real gloo ranks, with real signals: every rank stops at the
same poll, one poll after the reduce that first carried a signal, whichever rank got it."""

import os
import signal

from multirank import run_ranks


def _polls(signals, polls=12, agree_at=None):
    """Polls like the loop does; ``signals`` maps a poll number to {rank: signal} sent to this
    process just before that poll. Returns (poll number, reason) of the first stop, or None."""
    from clusterflow import dist
    from clusterflow.preemption import Preemption, StopAgreement

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
    """Every case on the same ranks, one after the other (a fresh agreement each: new gloo groups)."""
    return [_polls(*case) for case in cases]


def test_one_signalled_rank_stops_every_rank_at_the_next_poll():
    cases = [({at: {rank: signal.SIGTERM}},) for rank, at in ((0, 0), (2, 3), (1, 7))]
    # Rank 1's SIGUSR2 (time limit) reaches the reduce of poll 4, rank 2's SIGTERM that of poll 5:
    # the strongest reason wins, and the later signal changes nothing.
    cases.append(({4: {1: signal.SIGUSR2}, 5: {2: signal.SIGTERM}},))
    per_rank = run_ranks(3, _cases, cases)
    assert all(got == per_rank[0] for got in per_rank)  # every rank, the same poll and reason
    # carried by the reduce started at poll `at`, read at `at + 1`
    assert per_rank[0] == [(1, "preempted"), (4, "preempted"), (8, "preempted"), (5, "timeout")]


def test_agree_answers_at_once_and_leaves_nothing_in_flight():
    # A blocking agreement right where the signal arrives (as after an epoch's last step), and one
    # with no signal, after which polling goes on in step.
    cases = [({6: {1: signal.SIGUSR1}}, 12, 6), ({8: {0: signal.SIGTERM}}, 12, 6), ({}, 5, 2)]
    assert run_ranks(2, _cases, cases) == [[(6, "timeout"), (9, "preempted"), None]] * 2


def test_one_process_stops_at_once():
    assert run_ranks(1, _cases, [({2: {0: signal.SIGTERM}},), ({},)]) == [[(2, "preempted"), None]]
