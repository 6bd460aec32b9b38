"""``--ablation screened`` on a bundled toy: the screen's top-k, swept exactly, keeps the exact sweep's top heads
at a fraction of its cost, and leaves the other heads' all-position columns null."""
from __future__ import annotations

import dataclasses

import pytest

from discovery.model.loading import load_model
from discovery.toy import trained_task_options
from pipelines.options import ScanOptions
from pipelines.sweep import scan_task
from tests.test_attribution import one_thread  # noqa: F401  (autouse: small models run fastest on one thread)


def test_screened_sweep_keeps_the_exact_top_heads_for_less(monkeypatch):
    from discovery.measure import recall

    lm = load_model("bundled:mc1-transformer")
    opts = {"mc": trained_task_options(list(lm.files)).get("mc", {})}
    n_heads = len(list(lm.inventory.heads()))
    k = 9  # 9 of the toy's 16 heads, its measured k for recall 0.9 (the default k is sized for real models)
    monkeypatch.setattr(recall, "DEFAULT_SCREEN", dataclasses.replace(recall.DEFAULT_SCREEN, k=k))
    exact, ex_summary = scan_task(lm, "mc", ScanOptions(ablation="exact", prompts=12, bootstrap=10, task_options=opts))
    screened, sc_summary = scan_task(lm, "mc", ScanOptions(ablation="screened", prompts=12, bootstrap=10,
                                                           task_options=opts))
    record = sc_summary["screen"]
    assert record["screen"] == recall.DEFAULT_SCREEN.screen and record["k"] == k and len(record["heads"]) == k
    assert screened["d_ld_all"].null_count() == n_heads - k
    swept = screened.filter(screened["d_ld_all"].is_not_null())
    # the screened heads' exact numbers are the exact sweep's, to the last digit
    joined = swept.join(exact, on=["layer", "head", "kind"], suffix="_exact")
    assert joined["d_ld_all"].to_list() == pytest.approx(joined["d_ld_all_exact"].to_list(), abs=1e-6)
    # the exact sweep's top 3 heads by |d_ld_all| are all among the screened ones, in the same order
    top = lambda f: [(r["layer"], r["head"]) for r in f.sort(abs(f["d_ld_all"]), descending=True).head(3).iter_rows(named=True)]
    assert top(swept) == top(exact)
    # the all-position part costs about k/n of the full sweep's, and the whole scan task less than the exact one
    full = ex_summary["parts"]["ablation_all"]["forward_equivalents"]
    part = sc_summary["parts"]["ablation_all"]["forward_equivalents"]
    assert part < 0.7 * full
    assert sc_summary["cost"]["forward_equivalents"] < ex_summary["cost"]["forward_equivalents"]
    assert record["agreement"]["spearman"] is not None
    if record["screen"] == "atp_qk":  # the screen's own column covers every head, as in an exact scan
        assert screened["atp_ld"].null_count() == 0
        assert sc_summary["attribution"]["agreement"] == record["agreement"]
    # the report says what was screened, how many heads were swept exactly, and agreement on those only
    from discovery.report.sections import screened_sentence

    sentence = screened_sentence("mc", record)
    assert f"top {k} heads" in sentence and f"all {n_heads} heads" in sentence
    assert f"the other {n_heads - k} heads have no exact all-position drop" in sentence
    assert f"On the {k} swept heads" in sentence and "k is below (the screen may miss heads) the largest k, 23, the screen needed on the 9 measured runs" in sentence


def test_the_first_screen_says_grey_cells_were_not_swept(tmp_path):
    """A screened scan's effect map has null cells for the heads the screen did not send to the exact sweep;
    its caption says so (with k of n), and an exact scan's caption does not."""
    import json

    from discovery.artifacts import read_scan
    from discovery.report.first_screen import screened_note
    from tests.synthetic import write_synthetic_scan

    out = write_synthetic_scan(tmp_path / "scan")
    assert screened_note(read_scan(out)) == ""
    summary = json.loads((out / "summary.json").read_text())
    task = next(iter(summary["tasks"]))
    summary["tasks"][task]["screen"] = {"k": 30, "n_heads": 270, "heads": ["L0H0"]}
    (out / "summary.json").write_text(json.dumps(summary))
    note = screened_note(read_scan(out))
    assert "Grey: not swept at all positions" in note and "30 of 270 heads" in note
