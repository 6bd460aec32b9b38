"""Progress off a terminal: plain lines at each stage's start and end and every interval while it runs,
with done/total, elapsed and ETA; ``gascan scan`` with stderr piped prints them without escape codes."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from pipelines.progress import PlainProgress, duration, eta_seconds, interval_from_env, reporter, within

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_interval_with_eta():
    clock, out = FakeClock(), io.StringIO()
    progress = PlainProgress(out, interval=30, clock=clock)
    progress("sweep mc", 0, 270)
    for t, done in ((10, 30), (20, 60), (31, 90), (45, 120), (50, 130)):
        clock.now = t
        progress("sweep mc", done, 270)
    clock.now = 65  # no update for 15 s: the heartbeat still reports
    progress.heartbeat()
    clock.now = 70
    progress.heartbeat()  # 5 s after the last line: nothing
    clock.now = 90
    progress("sweep mc", 270, 270)
    lines = out.getvalue().splitlines()
    assert lines == [
        "gascan: sweep mc  0/270  started",
        "gascan: sweep mc  90/270  elapsed 31s  eta 1m02s",  # 31 s for 90: 180 more take 62 s
        "gascan: sweep mc  130/270  elapsed 1m05s  eta 1m10s",  # heartbeat at 65 s, last count 130
        "gascan: sweep mc  270/270  done in 1m30s",
    ]
    progress.heartbeat()  # the stage ended: no more lines
    assert len(out.getvalue().splitlines()) == 4


def test_restart_totals_and_status():
    clock, out = FakeClock(), io.StringIO()
    failed = [0]
    progress = PlainProgress(out, interval=0, clock=clock, status=lambda: f"{failed[0]} failed")
    progress("patterns", 0, 1)
    progress("patterns", 0, 4)  # the total becomes known: no line
    clock.now = 2
    progress("patterns", 2, 4)
    failed[0] = 1
    progress("patterns", 4, 4)
    progress("patterns", 0, 4)  # the next task runs the stage again
    lines = out.getvalue().splitlines()
    assert lines == ["gascan: patterns  0/1  started  0 failed",
                     "gascan: patterns  2/4  elapsed 2s  eta 2s  0 failed",
                     "gascan: patterns  4/4  done in 2s  1 failed",
                     "gascan: patterns  0/4  started  1 failed"]


def test_eta_and_duration_math(monkeypatch):
    assert eta_seconds(41, 120, 270) == 41 * 150 / 120
    assert eta_seconds(10, 5, 10, base=5) is None  # only skipped work so far: no rate yet
    assert eta_seconds(10, 7, 10, base=5) == 10 * 3 / 2
    assert eta_seconds(3, 10, 10) == 0.0
    assert [duration(s) for s in (0.4, 41, 185, 7440)] == ["0s", "41s", "3m05s", "2h04m"]
    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "2.5")
    assert interval_from_env() == 2.5
    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "soon")
    assert interval_from_env() == 30.0


def test_reporter_heartbeat_thread_reports_a_silent_stage():
    out = io.StringIO()
    import time

    with reporter(plain=True, stream=out, interval=0.05) as progress:
        progress("attribution", 0, 1)
        time.sleep(0.4)  # the work says nothing for a while
        progress("attribution", 1, 1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "gascan: attribution  0/1  started" and lines[-1].startswith("gascan: attribution  1/1  done in")
    assert any("elapsed" in line and "eta ?" in line for line in lines[1:-1])


def test_scan_piped_prints_plain_progress_for_each_stage(tmp_path):
    env = {**os.environ, "GASCAN_PROGRESS_INTERVAL": "0", "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "scan", "--out", str(tmp_path / "scan"),
                           "--prompts", "4", "--no-report"], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr
    assert not ANSI.search(err)
    for stage, total in (("loading model", 1), ("patterns", 4), ("ablation \\(all\\)", 16),
                         ("ablation \\(query\\)", 16), ("attribution", 1), ("position effects", None),
                         ("group ablations \\(joint\\)", None), ("pairs: mediation", None),
                         ("pairs: patterns under ablation", None), ("pairs: verification \\(joint \\+ controls\\)", None)):
        n = str(total) if total else r"\d+"
        assert re.search(rf"^gascan: {stage}  0/\d+  started$", err, re.MULTILINE), stage
        assert re.search(rf"^gascan: {stage}  {n}/{n}  done in \d+s$", err, re.MULTILINE), stage
    assert re.search(r"^gascan: ablation \(all\)  \d+/16  elapsed \d+s  eta \d+s$", err, re.MULTILINE)

    # gascan report --rerun reruns stages as long as the scan's: the same lines
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "report", str(tmp_path / "scan"), "--rerun", "pairs"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not ANSI.search(proc.stderr)
    for stage in ("loading model", "pairs: mediation", "pairs: verification \\(joint \\+ controls\\)"):
        assert re.search(rf"^gascan: {stage}  \d+/\d+  done in \d+s$", proc.stderr, re.MULTILINE), stage


def test_batch_progress_shows_failures_worker_deaths_and_resubmissions(capsys, monkeypatch):
    from pipelines.batch.run import _progress_bar

    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "0")

    class RayLike:  # the Ray executor counts deaths and resubmissions in ``stats`` as it runs
        def __init__(self) -> None:
            self.stats = {"worker_deaths": 0, "resubmitted": 0}

    executor = RayLike()
    with _progress_bar(True, None, 3, 1, executor) as (tick, _):
        executor.stats.update(worker_deaths=1, resubmitted=1)
        tick(True)
        tick(False)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "gascan: batch shards  1/3  started  0 failed  1 already done  0 worker deaths  0 resubmitted"
    assert lines[1].startswith("gascan: batch shards  2/3  elapsed 0s  eta ")
    assert lines[-1].startswith("gascan: batch shards  3/3  done in 0s  1 failed  1 already done  1 worker deaths  "
                                "1 resubmitted")


def test_rich_bars_of_finished_stages_go_when_asked():
    """A batch's terminal shows the running stages: with ``drop_finished`` a stage's bar is removed once it
    is done (kept otherwise, as `gascan scan` keeps them); ``within`` names a part's stages after it."""
    import rich.console
    import rich.progress

    from pipelines.progress import RichProgress

    for drop in (True, False):
        bar = rich.progress.Progress(console=rich.console.Console(file=io.StringIO()))
        progress = within(RichProgress(bar, drop_finished=drop), "step-100")
        progress("evidence", 0, 4)
        progress("evidence", 2, 4)
        assert [t.description for t in bar.tasks] == ["step-100: evidence"]
        assert bar.tasks[0].completed == 2
        progress("evidence", 4, 4)
        progress("pairs", 1, 3)
        assert [t.description for t in bar.tasks] == (["step-100: pairs"] if drop else
                                                       ["step-100: evidence", "step-100: pairs"])
    assert within(None, "step-100") is None


def test_a_rich_bar_with_a_forecast_shows_its_time_left():
    """In a terminal the batch bar's eta column asks the stage's forecast at each refresh (so it counts down
    between shards): 4242 s reads 1:10:42, no forecast yet reads -:--:--; other bars keep rich's own."""
    import rich.console

    from pipelines.progress import RichProgress, _rich_bar

    left: list[float | None] = [4242.0]
    bar = _rich_bar(rich.console.Console(file=io.StringIO(), force_terminal=True, width=150))
    progress = RichProgress(bar, eta_for={"batch shards": lambda: left[0]})
    progress("batch shards", 1, 3)
    progress("sweep", 0, 10)
    column = bar.columns[5]
    batch_task, sweep_task = bar.tasks
    assert column.render(batch_task).plain == "1:10:42"
    left[0] = None
    assert column.render(batch_task).plain == "-:--:--"
    assert column.render(sweep_task).plain == "-:--:--"  # rich's: no rate yet


def test_a_piped_ray_batch_forwards_its_actors_stage_lines_uncoloured(tmp_path):
    """Off a terminal, ``gascan batch --executor ray`` shows what each actor's shards are doing: every stage's
    plain lines reach the driver's stderr through Ray's log forwarding, prefixed with the actor's pid and
    without Ray's colour codes (a real local Ray cluster, started by the command)."""
    spec = tmp_path / "spec.toml"
    spec.write_text('models = ["tiny:llama"]\ntasks = ["mc"]\n[scan]\nprompts = 8\nbootstrap = 20\n')
    env = {**os.environ, "GASCAN_PROGRESS_INTERVAL": "0", "PYTHONPATH": str(ROOT), "TERM": "dumb",
           "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_COLOR_PREFIX", None)
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "batch", str(spec), "--out", str(tmp_path / "out"),
                           "--executor", "ray", "--workers", "1", "--no-report"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr
    assert not ANSI.search(err)
    actor = r"\(ShardWorker pid=\d+\) gascan: tiny-llama"
    for stage in ("ablation \\(all\\)", "position effects", "pairs: verification \\(joint \\+ controls\\)"):
        assert re.search(rf"^{actor}: {stage}  0/\d+  started$", err, re.MULTILINE), (stage, err[-2000:])
        assert re.search(rf"^{actor}: {stage}  (\d+)/\1  done in \d+s$", err, re.MULTILINE), (stage, err[-2000:])
    # the driver's own line; Ray forwards the actors' lines asynchronously, so under load one may share its line
    assert re.search(r"gascan: batch shards  2/2  done in \d+s", err)


def test_a_ray_actor_prints_its_shards_stages_only_when_asked(capsys, monkeypatch):
    """The body of a Ray actor, called here directly (in a terminal the driver asks its actors for no lines:
    they would break its bars): with ``stage_lines`` its shard's stages are plain lines named by the
    checkpoint; without, it is silent and the shard function gets no progress."""
    import polars as pl

    from pipelines.batch.executors import ShardWorker
    from pipelines.batch.shards import Shard, ShardResult
    from pipelines.batch.spec import Checkpoint
    from pipelines.options import LoadOptions

    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "0")
    seen = []

    def shard_fn(shard, cache, progress):
        seen.append(progress)
        report = within(progress, shard.checkpoint.name)
        if report is not None:
            report("evidence", 0, 2)
            report("evidence", 2, 2)
        return ShardResult(pl.DataFrame(), {}, {})

    shard = Shard(Checkpoint("step-100", "tiny:llama", 100), "0" * 16, "*", {}, None, None, "1" * 64,
                  stage="finish")
    worker = ShardWorker(shard_fn, LoadOptions())
    assert worker.run(shard, stage_lines=True).ok
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "gascan: step-100: evidence  0/2  started"
    assert re.fullmatch(r"gascan: step-100: evidence  2/2  done in \d+s", lines[1])
    assert worker.run(shard).ok and capsys.readouterr().err == ""
    assert seen[0] is not None and seen[1] is None
