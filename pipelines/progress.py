"""Progress of long work, wherever it runs: rich bars in a terminal, plain log lines everywhere else.

Every long-running command reports through one callback, ``progress(stage, done, total)`` (the
signature the pipeline, the sweep and the ablation engine already call). :func:`reporter` picks how
it is shown from ``sys.stderr.isatty()``:

- a terminal gets rich bars, one per stage, with elapsed time and ETA;
- a batch job, ``nohup``, CI or a pipe gets plain lines on stderr, no escape codes: one when a stage
  starts, one when it ends, and one every ``GASCAN_PROGRESS_INTERVAL`` seconds (default 30) while it
  runs, even when the work itself reports nothing in between (a heartbeat thread), e.g.::

      gascan: ablation (all)  120/270  elapsed 41s  eta 52s

An interval of 0 prints a line on every update. ``status`` (optional) is extra text for each line
(``gascan batch``: failed shards, worker deaths, resubmissions). ``eta_for`` (optional) maps a stage to a
better forecast of its time left than the rate so far (``gascan batch``: shards weighted by their predicted
seconds, :mod:`pipelines.batch.forecast`); it returns None when it cannot tell.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

Progress = Callable[[str, int, int], None]  # (stage, done, total)
Status = Callable[[], str]
Forecasts = Mapping[str, Callable[[], "float | None"]]  # stage -> seconds left (None: unknown)

INTERVAL_ENV = "GASCAN_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0


def interval_from_env(default: float = DEFAULT_INTERVAL) -> float:
    """Seconds between plain progress lines: ``GASCAN_PROGRESS_INTERVAL``, else ``default``."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return max(0.0, value)


def duration(seconds: float) -> str:
    """``41s``, ``3m05s``, ``2h04m``: short, fixed-form durations for log lines."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_seconds(elapsed: float, done: int, total: int, base: int = 0) -> float | None:
    """Time left at the rate so far (``base``: what was already done when the stage started)."""
    if done <= base or total <= done:
        return 0.0 if total <= done else None
    return elapsed * (total - done) / (done - base)


@dataclass
class _Stage:
    done: int
    total: int
    base: int  # done at the start (skipped work does not count towards the rate)
    started: float
    last_line: float
    ended: bool = False


class PlainProgress:
    """``progress(stage, done, total)`` as plain log lines (see the module docstring).

    ``clock`` is injectable for tests; :meth:`heartbeat` is what the background thread calls.
    """

    def __init__(self, stream: TextIO | None = None, *, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "gascan",
                 status: Status | None = None, eta_for: Forecasts | None = None) -> None:
        self.stream = stream
        self.eta_for = dict(eta_for or {})
        self.interval = interval_from_env() if interval is None else max(0.0, interval)
        self.clock = clock
        self.prefix = prefix
        self.status = status
        self.stages: dict[str, _Stage] = {}
        self.current: str | None = None
        self._lock = threading.Lock()

    def __call__(self, stage: str, done: int, total: int) -> None:
        with self._lock:
            now = self.clock()
            state = self.stages.get(stage)
            self.current = stage
            if state is None or (state.ended and done < total) or done < state.done:
                state = self.stages[stage] = _Stage(done, total, done, now, now)
                if done < total:
                    self._emit(stage, state, now, "started")
                    return
            moved = done != state.done
            state.done, state.total = done, total
            if done >= total and not state.ended:
                state.ended = True
                self._emit(stage, state, now, f"done in {duration(now - state.started)}")
            elif not state.ended and moved and (self.interval == 0 or now - state.last_line >= self.interval):
                self._emit(stage, state, now, None)

    def heartbeat(self) -> None:
        """A line for the running stage when ``interval`` has passed since its last one."""
        with self._lock:
            stage = self.current
            state = self.stages.get(stage) if stage is not None else None
            now = self.clock()
            if state is not None and not state.ended and self.interval > 0 and now - state.last_line >= self.interval:
                self._emit(stage, state, now, None)

    def line(self, stage: str, state: _Stage, now: float, note: str | None) -> str:
        """One progress line (no trailing newline)."""
        parts = [f"{self.prefix}: {stage}", f"{state.done}/{state.total}"]
        if note is not None:
            parts.append(note)
        else:
            elapsed = now - state.started
            forecast = self.eta_for.get(stage)
            eta = forecast() if forecast is not None else eta_seconds(elapsed, state.done, state.total, state.base)
            parts += [f"elapsed {duration(elapsed)}", f"eta {'?' if eta is None else duration(eta)}"]
        extra = self.status() if self.status is not None else ""
        if extra:
            parts.append(extra)
        return "  ".join(parts)

    def _emit(self, stage: str, state: _Stage, now: float, note: str | None) -> None:
        state.last_line = now
        stream = self.stream or sys.stderr
        print(self.line(stage, state, now, note), file=stream, flush=True)


class RichProgress:
    """``progress(stage, done, total)`` as rich bars, one per stage (a terminal). ``drop_finished``: a
    stage's bar goes once it is done (a batch runs many checkpoints' stages: kept, they would push the
    running ones off the screen)."""

    def __init__(self, bar: Any, status: Status | None = None, drop_finished: bool = False,
                 eta_for: Forecasts | None = None) -> None:
        self.bar = bar
        self.status = status
        self.drop_finished = drop_finished
        self.eta_for = dict(eta_for or {})
        self.ids: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        fields = {"status": self.status() if self.status is not None else ""}
        if stage not in self.ids:
            self.ids[stage] = self.bar.add_task(stage, total=total, completed=done, forecast=self.eta_for.get(stage),
                                                **fields)
        self.bar.update(self.ids[stage], completed=done, total=total, **fields)
        if self.drop_finished and done >= total:
            self.bar.remove_task(self.ids.pop(stage))


def _quiet(stage: str, done: int, total: int) -> None:
    """The reporter when progress is off."""


def _rich_bar(console: Any):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class ForecastColumn(TimeRemainingColumn):
        """Time left: the stage's forecast (``eta_for``) when it has one, asked at every refresh so it counts
        down between updates; else rich's rate so far."""

        def render(self, task: Any) -> Any:
            forecast = task.fields.get("forecast")
            if forecast is None:
                return super().render(task)
            left = forecast()
            if left is None:
                return Text("-:--:--", style="progress.remaining")
            minutes, seconds = divmod(round(left), 60)
            hours, minutes = divmod(minutes, 60)
            return Text(f"{hours:d}:{minutes:02d}:{seconds:02d}", style="progress.remaining")

    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), ForecastColumn(), TextColumn("{task.fields[status]}"))
    return Progress(*columns, console=console or Console(stderr=True, emoji=False), transient=False)


@contextlib.contextmanager
def reporter(console: Any = None, *, enabled: bool = True, plain: bool | None = None,
             stream: TextIO | None = None, interval: float | None = None,
             status: Status | None = None, drop_finished: bool = False,
             eta_for: Forecasts | None = None) -> Iterator[Progress]:
    """The ``progress(stage, done, total)`` callback for a block of long work.

    Rich bars (on ``console``, default a stderr console) when stderr is a terminal, plain lines on
    ``stream`` (default stderr) otherwise; ``plain`` forces the choice, ``enabled=False`` reports
    nothing. Plain lines keep coming every ``interval`` seconds while a stage runs; ``drop_finished``
    removes a rich bar once its stage is done; ``eta_for`` gives stages their own forecast of the time left.
    """
    if not enabled:
        yield _quiet
        return
    if plain is None:
        plain = not sys.stderr.isatty()
    if not plain:
        with _rich_bar(console) as bar:
            yield RichProgress(bar, status, drop_finished, eta_for)
        return
    lines = PlainProgress(stream, interval=interval, status=status, eta_for=eta_for)
    stop = threading.Event()
    thread = None
    if lines.interval > 0:
        def beat() -> None:
            while not stop.wait(min(1.0, lines.interval / 4)):
                lines.heartbeat()

        thread = threading.Thread(target=beat, name="gascan-progress", daemon=True)
        thread.start()
    try:
        yield lines
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def within(progress: Progress | None, name: str) -> Progress | None:
    """``progress`` for the work of one part of a larger job: its stages read ``NAME: stage``."""
    if progress is None:
        return None
    return lambda stage, done, total: progress(f"{name}: {stage}", done, total)


@contextlib.contextmanager
def stage(progress: Progress, name: str) -> Iterator[None]:
    """One step of work without counts (loading a model): ``name`` 0/1 on entry, 1/1 on exit."""
    progress(name, 0, 1)
    yield
    progress(name, 1, 1)
