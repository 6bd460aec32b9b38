"""Scans resume (issue 24) and record what each stage cost (issue 23, item 1).

A scan of the bundled toy is stopped in each stage, once with SIGINT and once with SIGKILL, by the test
hook ``GASCAN_TEST_INTERRUPT=STAGE:SIGNAL[:start]``: SIGINT after the stage wrote its files, before its
completion marker (the worst moment), SIGKILL at the stage's start (so the chain of runs computes each
stage once). Each rerun of the same command must continue at the
stopped stage without recomputing the finished ones (their records, run ids included, are unchanged), and
the last run's tables and verdict must equal those of an uninterrupted scan. The SIGKILL chain runs
``gascan scan`` as a subprocess; the SIGINT chain runs ``pipelines.cli.main`` in this process (the same code
path, the signal is real: Python turns it into KeyboardInterrupt, the CLI exits 130), which saves an
interpreter start per run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from discovery.artifacts import EVIDENCE_TABLES, read_marker
from discovery.errors import OutputError
from pipelines.cli import main
from pipelines.pipeline import STAGES
from pipelines.resume import TEST_HOOK

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = "4"
TABLES = ("heads", *EVIDENCE_TABLES, "pairs")

pytestmark = pytest.mark.slow


def scan_args(out: Path, *extra: str, prompts: str = PROMPTS) -> list[str]:
    return ["scan", "--prompts", prompts, "--out", str(out), *extra]


def in_process(args: list[str], monkeypatch, stop: str | None = None) -> int:
    """``gascan`` in this process, with Python's own SIGINT handler (KeyboardInterrupt) whatever an earlier
    test in this worker left installed (once, on CI, a SIGINT stop here ran to the end and exited 0)."""
    if stop:
        monkeypatch.setenv(TEST_HOOK, stop)
    else:
        monkeypatch.delenv(TEST_HOOK, raising=False)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return main(args)
    finally:
        signal.signal(signal.SIGINT, previous)


def subprocess_scan(args: list[str], stop: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != TEST_HOOK}
    env.update({"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", **({TEST_HOOK: stop} if stop else {})})
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def tables(out: Path) -> dict[str, pl.DataFrame | None]:
    return {name: pl.read_parquet(out / f"{name}.parquet") if (out / f"{name}.parquet").is_file() else None
            for name in TABLES}


def assert_same_results(out: Path, reference: Path) -> None:
    got, want = tables(out), tables(reference)
    for name in TABLES:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            assert got[name].equals(want[name]), f"{name}.parquet differs from the uninterrupted scan's"
    a, b = summary(out), summary(reference)
    assert a["verdict"] == b["verdict"]
    assert a["top_pairs"] == b["top_pairs"]
    assert a["complete"] is True and all(s["complete"] for s in a["stages"].values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted scan, written with --force over a finished scan of other options (the refusal of
    those options and the start-over are checked in test_other_options_are_refused_and_force_starts_over)."""
    out = tmp_path_factory.mktemp("reference") / "scan"
    mp = pytest.MonkeyPatch()
    try:
        assert in_process(scan_args(out, "--ablation", "none", "--no-report", prompts="3"), mp) == 0
        stale = summary(out)
        refused = subprocess_scan(scan_args(out))
        assert in_process(scan_args(out, "--force"), mp) == 0
    finally:
        mp.undo()
    return out, stale, refused


def test_other_options_are_refused_and_force_starts_over(reference):
    out, stale, refused = reference
    assert refused.returncode == 6  # OutputError: the output path
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert lines == [(f'gascan: error: --out {out} holds a scan with ablation "none", not "auto". Fix: pass '
                      "--force to start over, or choose another --out")]
    new = summary(out)
    assert new["fingerprint"]["key"] != stale["fingerprint"]["key"]
    assert new["options"]["ablation"] == "auto" and new["tasks"]["mc"]["n_prompts"] == int(PROMPTS)
    assert new["tasks"]["mc"]["ablation"] == "exact"  # auto on a 16-head toy: the exact sweep
    runs = {s["run"] for s in new["stages"].values()}
    assert len(runs) == 1 and stale["stages"]["sweep"]["run"] not in runs  # every stage ran again, in one run


def test_a_changed_checkpoint_is_refused_after_loading(reference, tmp_path):
    """Options that only the loaded model can check (here: the checkpoint hash) are checked before any stage."""
    out, _, _ = reference
    copy = tmp_path / "scan"
    shutil.copytree(out, copy)
    record = summary(copy)
    record["fingerprint"].update(checkpoint="0" * 16, key="0" * 64)  # as a scan of other weights records it
    (copy / "summary.json").write_text(json.dumps(record))
    with pytest.raises(OutputError) as err:
        from discovery.model.loading import load_model
        from pipelines import pipeline
        from pipelines.options import ScanOptions

        lm = load_model("bundled:mc-transformer")
        opts = ScanOptions(**{k: v for k, v in record["options"].items()})
        pipeline.run(lm, opts, copy)
    assert "holds a scan with other settings (checkpoint" in str(err.value)
    assert "Fix: pass --force to start over, or choose another --out" in str(err.value)
    assert summary(copy)["stages"] == record["stages"]  # nothing ran


def _check_chain_step(out: Path, before: dict, stopped: str) -> None:
    """After a run stopped in ``stopped``: the stages before it are complete with the records they had
    (not recomputed), ``stopped`` and the later ones are not."""
    now = summary(out)["stages"]
    for stage in STAGES:
        if STAGES.index(stage) < STAGES.index(stopped):
            assert now[stage]["complete"], stage
            if before.get(stage, {}).get("complete"):
                assert now[stage] == before[stage], f"{stage} was recomputed"
        else:
            assert not now[stage]["complete"], stage
    assert summary(out)["complete"] is False


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_scan_stopped_in_each_stage_resumes_there(how, reference, tmp_path, monkeypatch):
    out = tmp_path / "scan"
    stages_before: dict = {}
    runs: list[str] = []
    for stopped in STAGES:
        stop = f"{stopped}:INT" if how == "SIGINT" else f"{stopped}:KILL:start"
        if how == "SIGINT":
            code = in_process(scan_args(out), monkeypatch, stop=stop)
        else:
            proc = subprocess_scan(scan_args(out), stop=stop)
            code = proc.returncode
        assert code == (130 if how == "SIGINT" else -9), f"stop in {stopped}: exit {code}"
        _check_chain_step(out, stages_before, stopped)
        assert read_marker(out, stopped) is None
        now = summary(out)["stages"]
        if stopped != STAGES[0]:  # the stage finished by this run has a run id not seen before
            finished = STAGES[STAGES.index(stopped) - 1]
            assert now[finished]["run"] not in runs
            runs.append(now[finished]["run"])
        stages_before = now
        if how == "SIGINT" and stopped == "pairs":  # the report of an incomplete scan says so first
            partial = tmp_path / "partial"
            shutil.copytree(out, partial)
            assert in_process(["report", str(partial)], monkeypatch) == 0
            first = "Incomplete scan: the pairs stage did not finish"
            assert (partial / "report.md").read_text().splitlines()[0].startswith(f"**{first}")
            body = (partial / "report.html").read_text().split("<body>", 1)[1]
            assert body.startswith(f'\n<p id="incomplete" class="incomplete">{first}')
    if how == "SIGINT":
        assert in_process(scan_args(out), monkeypatch) == 0
    else:
        proc = subprocess_scan(scan_args(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        # off a terminal the breakdown is plain lines: a header and one line per stage
        lines = proc.stderr.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "wall", "s"])
        named = [line.split()[0] for line in lines[header + 1:] if line.strip()]
        assert [n for n in named if n in STAGES] == list(STAGES)
        assert "resumed: sweep, evidence, pairs, verdict complete from an earlier run; ran report" in \
            " ".join(proc.stderr.split())
    final = summary(out)["stages"]
    for stage in STAGES[:-1]:
        assert final[stage] == stages_before[stage], f"{stage} was recomputed by the last run"
    assert len({final[s]["run"] for s in STAGES}) == len(STAGES)  # each stage finished in a run of its own
    # SIGINT stopped the sweep after its one task was saved: the rerun took it from there
    assert final["sweep"]["tasks_resumed"] == (1 if how == "SIGINT" else 0)
    assert_same_results(out, reference[0])
    assert not list(out.rglob(".*.tmp"))  # no half-written file is left behind


def test_stage_records(reference):
    """Every stage records wall seconds, forward-equivalents and peak memory; the counted matmul FLOPs of the
    exact all-position sweep agree with an independent count: ablating a head in layer l recomputes layers
    l..L-1, i.e. (L - l) / L of a clean forward."""
    out, _, _ = reference
    record = summary(out)
    stages = record["stages"]
    assert list(stages) == list(STAGES)
    for name, rec in stages.items():
        assert isinstance(rec["wall_s"], float) and rec["wall_s"] >= 0, name
        assert rec["peak_rss_mib"] > 0, name
        assert rec["forward_equivalents"] >= 0, name
    for name in ("sweep", "evidence", "pairs"):  # these run the model
        assert stages[name]["forward_equivalents"] > 1, name
    assert stages["verdict"]["forward_equivalents"] == 0
    parts = stages["sweep"]["parts"]
    assert set(parts) == {"clean", "patterns", "ablation_all", "ablation_query", "attribution"}
    assert parts["clean"]["forward_equivalents"] == 1.0
    heads = pl.read_parquet(out / "heads.parquet")
    n_layers = record["n_layers"]
    expected = sum((n_layers - layer) / n_layers for layer in heads["layer"].to_list())
    assert parts["ablation_all"]["forward_equivalents"] == pytest.approx(expected, rel=0.02)
    # the query sweep recomputes one position of the later layers: far cheaper than the all-position one
    assert parts["ablation_query"]["forward_equivalents"] < expected / 2
    assert stages["sweep"]["forward_equivalents"] == pytest.approx(
        sum(p["forward_equivalents"] for p in parts.values()), rel=0.05)


def test_a_new_budget_keeps_the_sweep_and_reruns_from_the_evidence_tests(reference, tmp_path, monkeypatch, capsys):
    """The budget is read only after the sweep (``AFTER_SWEEP_SETTINGS``): `gascan scan` with another ``--budget``
    on a finished scan keeps the sweep (its record, run id included) and reruns the evidence tests and pairs
    with that budget; `gascan report --rerun evidence --budget` does the same to a copy, with the same tables,
    fingerprint and sweep record, after which the scan command finds that copy complete. Other options are
    still refused (test above)."""
    out, _, _ = reference
    by_scan, by_report = tmp_path / "scan", tmp_path / "report"
    shutil.copytree(out, by_scan)
    shutil.copytree(out, by_report)
    before = summary(out)
    assert before["options"]["budget"] == "auto" and before["budget"]["mc"]["budget"] is not None

    assert in_process(scan_args(by_scan, "--budget", "none"), monkeypatch) == 0
    after = summary(by_scan)
    assert after["stages"]["sweep"] == before["stages"]["sweep"]
    assert after["stages"]["evidence"]["run"] != before["stages"]["evidence"]["run"]
    assert after["options"]["budget"] == after["fingerprint"]["options"]["budget"] == "none"
    assert after["fingerprint"]["key"] != before["fingerprint"]["key"]
    assert after["budget"]["mc"]["budget"] is None  # the evidence stage ran unbounded
    assert after["complete"] is True

    assert in_process(["report", str(by_report), "--rerun", "evidence", "--budget", "none"], monkeypatch) == 0
    reported = summary(by_report)
    assert reported["fingerprint"] == after["fingerprint"]
    assert reported["stages"]["sweep"] == before["stages"]["sweep"]
    for name, table in tables(by_scan).items():
        other = tables(by_report)[name]
        assert (table is None) == (other is None) and (table is None or table.equals(other)), name
    assert reported["verdict"] == after["verdict"] and reported["top_pairs"] == after["top_pairs"]
    kept = summary(by_report)["stages"]
    assert in_process(scan_args(by_report, "--budget", "none"), monkeypatch) == 0
    assert summary(by_report)["stages"] == kept  # complete: nothing ran again

    capsys.readouterr()
    assert in_process(["report", str(by_report), "--budget", "50"], monkeypatch) == 2
    assert capsys.readouterr().err.strip() == ("gascan: error: --budget changes what the evidence tests and pairs "
                                               "run. Fix: pass --rerun evidence with it")
