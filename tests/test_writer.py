"""checkpoint.background.Writer: the snapshots' one long-lived writing thread."""

import threading

import pytest

from clusterflow.checkpoint.background import Writer


def test_writes_run_one_at_a_time_on_one_thread_that_close_ends():
    w = Writer("test-writer")
    seen, release = [], threading.Event()
    w.start(lambda: (release.wait(10), seen.append(threading.current_thread())))
    assert w.busy
    with pytest.raises(RuntimeError, match="still in flight"):
        w.start(lambda: None)
    release.set()
    w.wait()
    assert not w.busy
    for _ in range(5):
        w.start(lambda: seen.append(threading.current_thread()))
        w.wait()
    assert len(seen) == 6 and len(set(seen)) == 1 and seen[0].name == "test-writer"
    w.close()
    seen[0].join(10)
    assert not seen[0].is_alive()


def test_an_error_a_write_did_not_handle_is_logged_and_the_thread_goes_on(caplog):
    w = Writer("test-writer")
    threads = []

    def fail():
        threads.append(threading.current_thread())
        raise SystemExit  # not an Exception: what a write's own handler would not catch

    w.start(fail)
    w.wait()
    assert not w.busy
    assert "test-writer: work ended with an error it did not handle" in caplog.text
    done = threading.Event()
    w.start(lambda: (threads.append(threading.current_thread()), done.set()))
    assert done.wait(10) and threads[0] is threads[1]
    w.close()
