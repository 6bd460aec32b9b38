"""The batch bar's time left: shards weighted by predicted seconds, a finish shard predicted from its budget at
the sweep's measured seconds per forward-equivalent, counting down between shards."""
from __future__ import annotations

import io

import pytest

from pipelines.batch.forecast import BUDGET_SHARE, FINISH_RATIO_PRIOR, Forecast, finish_seconds
from pipelines.batch.shards import Shard
from pipelines.batch.spec import Checkpoint
from pipelines.progress import PlainProgress


def _shard(name: str, key: str, stage: str = "sweep") -> Shard:
    return Shard(Checkpoint(spec=f"/models/{name}", name=name), "hash", "kv", {}, None, None, key, stage=stage)


def test_a_finish_shard_is_predicted_from_its_budget_at_the_sweeps_rate():
    """4 layers x 2 heads: the exact sweep is 5 forward-equivalents by layers, so the auto budget is the floor of
    MIN_PASSES (140) average passes of 5/8 fe, 87.5 fe, of which a finish spends about BUDGET_SHARE; the sweep ran
    50 fe in 100 s (2 s per fe), so the finish is predicted at BUDGET_SHARE x 175 s."""
    summary = {"n_layers": 4, "tasks": {"kv": {"seconds": 100.0, "cost": {"forward_equivalents": 50.0}}}}
    layers = {"kv": [0, 0, 1, 1, 2, 2, 3, 3]}
    assert finish_seconds(summary, layers, "auto") == pytest.approx(BUDGET_SHARE * 175.0)
    assert finish_seconds(summary, layers, "60") == pytest.approx(BUDGET_SHARE * 120.0)  # 60 fe at 2 s/fe
    assert finish_seconds(summary, layers, "300s") == pytest.approx(BUDGET_SHARE * 300.0)  # 300 s = 150 fe
    assert finish_seconds(summary, layers, "none") == pytest.approx(10 * 50 * 2.0)  # unbounded: ~10 sweeps
    two = {"n_layers": 4, "tasks": {t: summary["tasks"]["kv"] for t in ("kv", "mc")}}
    assert finish_seconds(two, {"kv": layers["kv"], "mc": layers["kv"]}, "auto") == pytest.approx(BUDGET_SHARE * 350)
    no_cost = {"n_layers": 4, "tasks": {"kv": {"seconds": 100.0}}}
    assert finish_seconds(no_cost, layers, "auto") is None


def test_one_worker_the_eta_weighs_the_finish_shard_and_counts_down():
    """Two sweep shards of 100 s, then a finish predicted at 450 s, on one worker: after the first sweep shard
    the finish is the prior ratio times the predicted sweep; once queued, its own prediction; the time left
    falls with the clock between shards and is unknown once overrun."""
    a, b, fin = _shard("m", "a"), _shard("m", "b"), _shard("m", "f", "finish")
    forecast = Forecast(started=0.0)
    forecast.expect(a)
    forecast.expect(b)
    forecast.expect_finish("m")
    assert forecast.eta(50.0) is None  # nothing measured yet
    forecast.finished(a, 100.0, now=100.0)
    # b predicted at 100 s; the finish at the prior ratio x (100 measured + 100 predicted) of sweep
    assert forecast.eta(100.0) == pytest.approx(100 + FINISH_RATIO_PRIOR * 200)
    assert forecast.eta(160.0) == pytest.approx(100 + FINISH_RATIO_PRIOR * 200 - 60)
    forecast.finished(b, 100.0, now=200.0)
    forecast.queued_finish(fin, 450.0, sweep_seconds=200.0)
    assert forecast.ratio == pytest.approx(2.25)
    assert forecast.eta(200.0) == pytest.approx(450.0)
    assert forecast.eta(500.0) == pytest.approx(150.0)
    assert forecast.eta(700.0) is None  # the finish overran its prediction
    forecast.finished(fin, 480.0, now=680.0)
    assert forecast.eta(680.0) == 0.0


def test_two_workers_the_eta_is_at_least_the_longest_chain():
    """Two checkpoints' sweeps ran side by side (throughput 2 shard-seconds per second); the next checkpoint's
    finish is predicted by the first one's ratio; one long finish cannot be split over two workers."""
    a1, a2, fin = _shard("a", "a1"), _shard("a", "a2"), _shard("a", "fa", "finish")
    b1 = _shard("b", "b1")
    forecast = Forecast(started=0.0)
    for s in (a1, a2, b1):
        forecast.expect(s)
    forecast.expect_finish("a")
    forecast.expect_finish("b")
    forecast.finished(a1, 100.0, now=100.0)
    forecast.finished(a2, 100.0, now=100.0)
    forecast.queued_finish(fin, 600.0, sweep_seconds=200.0)  # ratio 3
    # pending: b1 (100 s, b's sweep mean falls back to a's), finish a 600 s, finish b 3 x 100 s = 300 s:
    # 1000 s at 2 per second = 500 s, but finish a alone takes 600 s on one worker
    assert forecast.eta(100.0) == pytest.approx(600.0)
    forecast.finished(b1, 80.0, now=180.0)  # b's own measurement replaces the mean: finish b 3 x 80 = 240 s
    # 280 s measured in 180 s: 840 s left at that rate is 540 s, under finish a's 600 s (the forecast does not
    # know when finish a started, so it counts all of it)
    assert forecast.eta(180.0) == pytest.approx(max((600 + 240) * 180 / 280, 600))
    forecast.dropped("b")  # b's finish will not run (a shard failed)
    assert forecast.eta(180.0) == pytest.approx(600.0)


def test_a_resumed_batch_predicts_from_the_earlier_runs_sweep_seconds():
    """Sweep shards an earlier run finished predict the rest; with only a queued finish left, the time left is
    its prediction counted down from the run's start."""
    done_before, left = _shard("m", "a"), _shard("m", "b")
    forecast = Forecast(started=10.0)
    forecast.measured_before(done_before, 120.0)
    forecast.expect(left)
    forecast.expect_finish("m")
    assert forecast.eta(10.0) == pytest.approx(120 + FINISH_RATIO_PRIOR * 240)
    only = Forecast(started=10.0)
    only.queued_finish(_shard("m", "f", "finish"), 300.0, sweep_seconds=240.0)
    assert only.eta(10.0) == pytest.approx(300.0) and only.eta(110.0) == pytest.approx(200.0)


def test_a_stage_with_a_forecast_prints_it_instead_of_the_rate():
    """The plain line of a stage in ``eta_for`` shows the forecast's time left (``?`` when it has none); other
    stages keep the rate so far."""
    now = [0.0]
    left: list[float | None] = [420.0]
    out = io.StringIO()
    progress = PlainProgress(out, interval=0, clock=lambda: now[0], eta_for={"batch shards": lambda: left[0]})
    progress("batch shards", 0, 3)
    progress("other", 0, 2)
    now[0] = 60.0
    progress("batch shards", 1, 3)  # by the count: 2 min more; by the forecast: 7 min
    progress("other", 1, 2)
    left[0] = None
    now[0] = 90.0
    progress("batch shards", 2, 3)
    assert out.getvalue().splitlines()[2:] == [
        "gascan: batch shards  1/3  elapsed 1m00s  eta 7m00s",
        "gascan: other  1/2  elapsed 1m00s  eta 1m00s",
        "gascan: batch shards  2/3  elapsed 1m30s  eta ?",
    ]


def test_the_first_finish_of_a_series_calibrates_the_next():
    """The budget is the most a finish may plan: checkpoint a's finish, predicted at 400 s, ran 300 s, so b's
    finish, predicted at 400 s too, is expected to take 300 s (and c's, not yet queued, the calibrated ratio)."""
    forecast = Forecast(started=0.0)
    a, b, c = (_shard(n, f"{n}1") for n in "abc")
    fin_a, fin_b = _shard("a", "fa", "finish"), _shard("b", "fb", "finish")
    for s in (a, b, c):
        forecast.expect(s)
        forecast.expect_finish(s.checkpoint.name)
    forecast.finished(a, 100.0, now=100.0)
    forecast.queued_finish(fin_a, 400.0, sweep_seconds=100.0)
    assert forecast.calibration() == 1.0
    forecast.finished(fin_a, 300.0, now=400.0)
    assert forecast.calibration() == pytest.approx(0.75)
    forecast.finished(b, 100.0, now=500.0)
    forecast.queued_finish(fin_b, 400.0, sweep_seconds=100.0)
    # pending: finish b 400 x 0.75 = 300 s; c's sweep 100 s; c's finish 4 x 100 x 0.75 = 300 s; 500 s measured
    # in 500 s (one worker): 700 s
    assert forecast.eta(500.0) == pytest.approx(700.0)
