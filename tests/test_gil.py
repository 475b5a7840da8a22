"""Writers beside the loop lower the interpreter's switch interval while any of them runs, and
the last one to end puts the previous interval back."""

import sys
import threading

from clusterflow.checkpoint.background import BackgroundWrite
from clusterflow.storage import gil


def test_overlapping_writers_share_one_lowered_interval_and_restore_it():
    before = sys.getswitchinterval()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with gil.writing():
            seen["first"] = sys.getswitchinterval()
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with gil.writing():
            second_in.set()
            first_out.wait(10)
            seen["after first left"] = sys.getswitchinterval()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"first": gil.WRITING_SWITCH_S, "after first left": gil.WRITING_SWITCH_S}
    assert sys.getswitchinterval() == before


def test_a_background_checkpoint_write_runs_with_the_short_interval_even_when_it_fails():
    before = sys.getswitchinterval()
    seen = []

    def write():
        seen.append(sys.getswitchinterval())
        raise OSError("disk full")

    writer = BackgroundWrite()
    writer.start(3, write, lambda step, exc: f"step {step}: {exc}")
    outcome = writer.wait()
    assert seen == [gil.WRITING_SWITCH_S]
    assert outcome is not None and outcome.error == "step 3: disk full"
    assert sys.getswitchinterval() == before
