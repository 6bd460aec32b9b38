"""Devices and dtypes: a bfloat16 sweep agrees with float32 (on the CPU, always), and a CUDA sweep
agrees with the CPU wherever a GPU is visible (``scripts/gpu-check`` runs this file on a GPU machine).

The unavailable-device path (``--device cuda`` with a CPU-only torch: one line, exit code 5) is in
``tests/test_bad_inputs.py``.
"""
from __future__ import annotations

import polars as pl
import pytest
import torch
from scipy.stats import spearmanr

from discovery.model.loading import load_model
from pipelines import pipeline
from pipelines.options import ScanOptions
from pipelines.sweep import scan_model

MODEL = "bundled:mc-transformer"  # a trained toy: its head effects are real, not noise
KEYS = ["task", "layer", "head", "kind"]


def _sweep(dtype: str, device: str = "cpu") -> pl.DataFrame:
    lm = load_model(MODEL, dtype=dtype, device=device)
    options = ScanOptions(task_options=pipeline.task_options(lm.files, ["mc"], {}), prompts=16, bootstrap=50)
    heads, summary = scan_model(lm, options)
    assert summary["tasks"]["mc"]["clean"]["acc"] > 0.9  # the toy solves its task at this precision too
    return heads.sort(KEYS)


@pytest.fixture(scope="module")
def float32_cpu() -> pl.DataFrame:
    return _sweep("float32")


def _agree(reference: pl.DataFrame, other: pl.DataFrame, atol: float, min_rank: float) -> None:
    assert reference.select(KEYS).equals(other.select(KEYS))
    for column in ("d_ld_all", "d_ld_query", "gather_score", "agg_select"):
        a = reference[column].to_numpy()
        b = other[column].to_numpy()
        assert abs(a - b).max() <= atol, (column, abs(a - b).max())
        assert spearmanr(a, b).statistic >= min_rank, column
    top = reference.sort("d_ld_all")[0].select(KEYS).row(0)
    assert other.sort("d_ld_all")[0].select(KEYS).row(0) == top  # the head whose ablation costs most


def test_bfloat16_sweep_agrees_with_float32(float32_cpu):
    _agree(float32_cpu, _sweep("bfloat16"), atol=0.05, min_rank=0.98)  # measured: 0.020, 0.994


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a visible CUDA GPU (scripts/gpu-check)")
@pytest.mark.parametrize("dtype,atol,min_rank", [("float32", 1e-3, 0.999), ("bfloat16", 0.05, 0.98)])
def test_cuda_sweep_agrees_with_cpu(float32_cpu, dtype, atol, min_rank):
    _agree(float32_cpu, _sweep(dtype, "cuda"), atol=atol, min_rank=min_rank)
