"""One error type for everything a user can get wrong.

Every user-facing failure is a :class:`GascanError` whose message is one line naming the problem
and the fix; the command line prints it as ``gascan: error: ...`` and exits with ``exit_code``:

====  ==========================  ==============================================================
code  class                       what
====  ==========================  ==============================================================
2     :class:`GascanError`        usage: a bad argument or number, an unreadable input file (a
                                  scan directory, a spec, labels, tables)
3     :class:`ModelLoadError`     the model: missing, not a recognised format, corrupt, unsafe
4     :class:`TaskError`          a task name, its options or its data file
5     :class:`DeviceError`        the device: malformed, or not available in this torch build
6     :class:`OutputError`        the output path: an existing file, or not writable
====  ==========================  ==============================================================
"""
from __future__ import annotations


class GascanError(Exception):
    """A problem with the user's input: one line, what went wrong and how to fix it."""

    exit_code: int = 2

    def __init__(self, problem: str, fix: str | None = None, *, exit_code: int | None = None) -> None:
        problem = " ".join(str(problem).split())
        message = problem if not fix else f"{problem.rstrip('.')}. Fix: {' '.join(fix.split())}"
        super().__init__(message)
        self.problem = problem
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code


class ModelLoadError(GascanError):
    """A checkpoint that cannot be loaded (missing, corrupt, unsupported, unsafe)."""

    exit_code = 3


class TaskError(GascanError):
    """A task specification or data file that cannot be turned into prompts."""

    exit_code = 4


class DeviceError(GascanError):
    """A device string that is malformed or names a device this machine (or torch build) lacks."""

    exit_code = 5


class OutputError(GascanError):
    """An output path that cannot be created or written (checked before any work)."""

    exit_code = 6
