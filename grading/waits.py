"""Bounded waits for the grader: a learner's exercise that never returns fails in seconds, with a message that
says which wait never returned and what usually causes it, instead of hanging the test run.

    result = run_bounded(lambda: collector_get_on_a_loop(), timeout=5, what="RequestOutputCollector.get",
                         likely="the event is set but never cleared, so `get` spins")
    join_or_fail(thread, 5, what="your run_busy_loop after SHUTDOWN", likely="SHUTDOWN ignored while busy")

A thread cannot be killed in Python. A stuck one is asked to stop by raising `Hung` inside it at its next bytecode
(`PyThreadState_SetAsyncExc`), which ends a spinning Python loop or a loop that polls with a timeout; a thread
blocked for ever in C (a `get()` without timeout) stays blocked, but it is a daemon and holds no core.
"""

import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from grading.impl import ExerciseError

T = TypeVar("T")
_STOP_GRACE_SECONDS = 1.0


class Hung(BaseException):
    """Raised inside a thread that ran past its bound (a BaseException, so `except Exception` cannot swallow it)."""


def stop_thread(thread: threading.Thread) -> bool:
    """Raise `Hung` inside `thread` and wait briefly for it to end; True if it ended."""
    if thread.ident is None or not thread.is_alive():
        return True
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Hung))
    thread.join(_STOP_GRACE_SECONDS)
    return not thread.is_alive()


def hang_message(what: str, timeout: float, likely: str) -> str:
    return f"{what} did not return within {timeout:g} s (the grader stopped waiting).\n  Likely cause: {likely}"


def join_or_fail(thread: threading.Thread, timeout: float, *, what: str, likely: str) -> None:
    """Join `thread` for at most `timeout` seconds; if it is still running, stop it and fail the exercise."""
    thread.join(timeout)
    if thread.is_alive():
        stop_thread(thread)
        raise ExerciseError(hang_message(what, timeout, likely))


def run_bounded(fn: Callable[[], T], timeout: float, *, what: str, likely: str) -> T:
    """`fn()` on a daemon thread: its result, or its exception re-raised here, or an ExerciseError after `timeout`."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn()
        except Hung:
            pass
        except BaseException as error:  # re-raised in the caller's thread, where the test reports it
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"bounded: {what}", daemon=True)
    thread.start()
    join_or_fail(thread, timeout, what=what, likely=likely)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
