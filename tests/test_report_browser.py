"""The report in a real browser (Chromium through Playwright, at 1280×800): it loads without console or page
errors, every figure decodes, and the verdict and the first figure are on screen without scrolling.

Needs the Debian package ``chromium`` (``/usr/bin/chromium``) and the pip package ``playwright`` (no
``playwright install``: the system Chromium is used). Missing either is a failure, not a skip."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from verdict_standin import standin_verdict

from discovery.report import write_report

TOY = Path(__file__).resolve().parents[1] / "reports" / "toy-mc-transformer"
VIEWPORT = {"width": 1280, "height": 800}


def _chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Chromium is not installed: apt-get install chromium (the browser test needs /usr/bin/chromium)")
    return path


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright (no `playwright install`: the system "
                    "Chromium is used)")
    return sync_playwright


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two reports rebuilt from committed tables (no model run): the toy scan with a stand-in verdict and a
    long model name, and the same scan without any verdict (decide() may be unavailable)."""
    out = []
    for name, with_verdict in (("verdict", True), ("plain", False)):
        d = tmp_path_factory.mktemp(name) / "scan"
        shutil.copytree(TOY, d, ignore=shutil.ignore_patterns("report.*", "figures"))
        if with_verdict:
            summary = json.loads((d / "summary.json").read_text())
            summary["model"] = "a-rather-long-model-name/with-a-checkpoint-path-<script>alert(1)</script>"
            summary["verdict"] = standin_verdict(summary, pl.read_parquet(d / "pairs.parquet").to_dicts()).as_dict()
            (d / "summary.json").write_text(json.dumps(summary))
        out.append(write_report(d))
    return out


def _inside(box: dict, viewport: dict) -> bool:
    return (box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= viewport["width"]
            and box["y"] + box["height"] <= viewport["height"])


def test_the_first_screen_fits_and_the_page_is_clean(reports):
    executable = _chromium()
    sync_playwright = _playwright()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            for html in reports:
                page = browser.new_page(viewport=VIEWPORT)
                errors: list[str] = []
                page.on("console", lambda m, errors=errors: errors.append(f"console {m.type}: {m.text}")
                        if m.type == "error" else None)
                page.on("pageerror", lambda e, errors=errors: errors.append(f"page error: {e}"))
                page.goto(html.as_uri())
                page.wait_for_load_state("load")
                # the first screen, before any scrolling or opening
                assert page.evaluate("window.scrollY") == 0
                verdict = page.locator("#verdict").bounding_box()
                figure = page.locator("#effect-map").bounding_box()
                ranked = page.locator("#ranked").bounding_box()
                assert verdict and _inside(verdict, VIEWPORT), (html, verdict)
                assert figure and _inside(figure, VIEWPORT), (html, figure)
                assert ranked and ranked["y"] < VIEWPORT["height"], (html, ranked)  # the table starts on screen
                assert page.locator("#verdict").inner_text().strip()
                # every image decodes, the appendix's too (opened)
                page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
                sizes = page.evaluate("Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])")
                assert len(sizes) >= 4
                assert all(complete and width > 0 for _alt, complete, width in sizes), sizes
                assert not errors, errors
                assert page.evaluate("document.querySelectorAll('script').length") == 0
                page.close()
        finally:
            browser.close()
