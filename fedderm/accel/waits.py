"""The accelerator's shortened waits: Flower's fixed sleeps and back-offs capped at
``FEDDERM_POLL_INTERVAL`` (default 0.05 s), and the SuperNode waking its SuperExec through a pipe
when a task exists instead of the SuperExec polling for tasks."""

from __future__ import annotations

import os
import time as _time

DEFAULT_POLL_INTERVAL = 0.05
#: set by fedderm-superlink for the processes it starts: server_app.py then calls fast_object_pulls
ACCELERATED_ENV = "FEDDERM_ACCELERATED"


def env_seconds(name: str, default: float, low: float, high: float, who: str) -> float:
    """The environment variable ``name`` as seconds in ``[low, high]`` (``default`` when unset);
    anything else stops ``who`` with one line naming the variable."""
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{who}: {name}={raw!r} is not a number of seconds") from None
    if not low <= value <= high:
        raise SystemExit(f"{who}: {name}={value} must be in [{low:g}, {high:g}] seconds")
    return value


def poll_interval() -> float:
    """``FEDDERM_POLL_INTERVAL`` in seconds (default 0.05), the cap on every idle wait patched here."""
    return env_seconds("FEDDERM_POLL_INTERVAL", DEFAULT_POLL_INTERVAL, 0.001, 10, "fedderm launcher")


def fast_object_pulls(interval: float | None = None) -> None:
    """Start Flower's object-pull retry back-off at ``interval`` and cap it at 4× that.

    Flower retries an object that is not there yet after 1, 2, 4, 8 s (``PULL_INITIAL_BACKOFF``,
    ``PULL_BACKOFF_CAP``); a message whose objects arrive a moment after its header then waits
    up to 15 s.  The defaults live on the function objects, shared by every caller.
    """
    interval = poll_interval() if interval is None else interval
    from flwr.supercore.inflatable import inflatable_utils

    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        fn.__kwdefaults__["initial_backoff"] = interval
        fn.__kwdefaults__["backoff_cap"] = 4 * interval


def self_test_short_wait(interval: float = 0.01) -> str | None:
    """A wait is shortened: after :func:`fast_object_pulls`, Flower's ``pull_objects`` retries an
    object that is not there yet after about ``interval`` seconds, not its 1 s back-off (Flower's
    defaults are restored afterwards).  Returns what failed, or ``None``."""
    from flwr.supercore.inflatable import inflatable_utils as flower

    functions = (flower.pull_objects, flower.pull_and_inflate_object_from_tree)
    saved = [dict(fn.__kwdefaults__ or {}) for fn in functions]
    tries: list[float] = []

    def pull(object_id: str) -> bytes:
        tries.append(_time.monotonic())
        if len(tries) == 1:
            raise flower.ObjectUnavailableError(object_id)
        return b"ready"

    try:
        fast_object_pulls(interval)
        flower.pull_objects(["object"], pull)
    except Exception as err:  # noqa: BLE001 - any failure means Flower's back-off moved
        return f"short wait: Flower's object pull with the shortened back-off failed ({err!r})"
    finally:
        for fn, defaults in zip(functions, saved):
            fn.__kwdefaults__ = defaults or None
    waited = tries[1] - tries[0]
    if waited > 0.5:
        return f"short wait: Flower's object pull retried after {waited:.3f} s, not {interval} s"
    return None


#: the SuperExec's task poll when the SuperNode wakes it (:class:`WakeableTime`): only a fallback
WOKEN_TASK_POLL = 1.0


class WakeableTime:
    """The ``time`` module of Flower's SuperExec loop, whose ``sleep`` ends as soon as the SuperNode
    writes to the pipe ``fd`` (:func:`wake_superexec`: a message's header came, its task exists).

    The SuperExec then asks for tasks once per wake-up (and every :data:`WOKEN_TASK_POLL` s as a
    fallback) instead of every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` s: a task's ClientApp is
    forked as soon as the task exists (while the SuperNode still pulls the message's objects, as
    with polling), and an idle SuperExec does not ask its SuperNode 10-20 times a second.  When
    the SuperNode is gone (end of file), ``sleep`` sleeps."""

    def __init__(self, fd: int, fallback: float = WOKEN_TASK_POLL):
        self.fd, self.fallback = fd, fallback

    def sleep(self, seconds: float) -> None:
        import select

        if self.fd < 0:
            _time.sleep(seconds)
            return
        ready, _, _ = select.select([self.fd], [], [], max(seconds, self.fallback))
        if ready:
            try:
                data = os.read(self.fd, 4096)  # every pending wake-up: one AcquireTask serves them
            except BlockingIOError:
                data = b"x"
            if not data:  # the SuperNode closed its end
                os.close(self.fd)
                self.fd = -1

    def __getattr__(self, name):
        return getattr(_time, name)


#: write ends of the pipes to the SuperExecs this SuperNode started (:class:`SuperExecPopen`)
WAKE_FDS: list[int] = []


def wake_superexec() -> None:
    """Tell this SuperNode's SuperExec that a task is waiting (a byte on its wake-up pipe)."""
    for fd in list(WAKE_FDS):
        try:
            os.write(fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups the SuperExec has not read yet: it will ask anyway
        except OSError:  # the SuperExec is gone
            WAKE_FDS.remove(fd)


def waking_object_pull(pull_objects):
    """Flower's ``pull_objects`` as the SuperNode's message loop calls it (right after it created
    the message's task), preceded by :func:`wake_superexec`: the ClientApp is forked while the
    SuperNode pulls the message's objects from the SuperLink."""

    def wake_then_pull_objects(*args, **kwargs):
        wake_superexec()
        return pull_objects(*args, **kwargs)

    return wake_then_pull_objects


class ClampedTime:
    """The ``time`` module with ``sleep`` clamped to an upper bound (the SuperNode's idle waits)."""

    def __init__(self, cap: float):
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        _time.sleep(min(seconds, self.cap))

    def __getattr__(self, name):
        return getattr(_time, name)
