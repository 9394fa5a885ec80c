"""The dashboard in a real browser: Playwright (sync API) driving Debian's chromium, headless,
against the control-plane main and a gateway over the simulated engine with traffic flowing.

It signs in (a wrong key is refused first), sees the deployment, starts a rollout v1 -> v2 from
the page (confirming the dialog), watches v2's share of the traffic move to 50 % in the page,
rolls back from the page, and sees the rollout end rolled back, the traffic back on v1 and the
abort in the audit trail; then scales v1 to 2 from the page and runs GC (its dry run finds
nothing); no request through the gateway fails meanwhile. A second test pins a versioned
deployment as current from the page. A third runs a batch through the gateway and sees its row
in the Batches table with a progress bar that moves while it runs and ends full, its failed
lines drawn apart. Every wait is on page text or attributes with a bound.
Screenshots go to $TEST_UNDECLARED_OUTPUTS_DIR (Bazel's test outputs); with
$PAVED_DASHBOARD_SCREENSHOT set, the mid-rollout screen (1280x900) is also saved there (that is
how docs/img/dashboard.png is made).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import openai
import pytest
from fleet import FAST, TrafficDriver, deploy, first_deploy, make_fleet, rollout
from playwright.sync_api import Page, expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Long analysis intervals: the rollout sits at 50 % until the page rolls it back.
PARAMS = {**FAST, "phases": [50, 100], "interval_s": 120}


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    return Path(os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tmp_path)


@pytest.fixture
def page():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: tools/bazel installs Debian's chromium (apt)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            yield context.new_page()
        finally:
            browser.close()


def _share(page: Page, version: str):
    return page.locator(
        f'#traffic tr[data-alias="tiny"][data-region="local"][data-version="{version}"] td.share'
    )


def _confirm(page: Page, expected_text: str) -> None:
    dialog = page.get_by_role("dialog")
    expect(dialog).to_be_visible(timeout=10_000)
    expect(dialog).to_contain_text(expected_text)
    dialog.get_by_role("button", name="Confirm").click()
    expect(dialog).to_be_hidden(timeout=10_000)


def test_rollout_and_rollback_from_the_dashboard(tmp_path, page, outputs):
    with make_fleet(tmp_path) as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key)
        deploy(cp, "v2")
        traffic = TrafficDriver(gw.url, key, "tiny", rate=4).start()
        try:
            _drive(page, cp, outputs)
        finally:
            results = traffic.stop()
        assert results and traffic.failures() == [], traffic.failures()[:5]


def _sign_in(page: Page, cp) -> None:
    page.goto(cp.url + "/dashboard")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("Admin key").fill(cp.admin_key)
    page.get_by_role("button", name="Sign in").click()


def test_pin_a_versioned_deployment_from_the_dashboard(tmp_path, page, outputs):
    with make_fleet(tmp_path) as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key, strategy="versioned")  # v1 becomes current
        deploy(cp, "v2", strategy="versioned")
        r = cp.wait_rollout(rollout(cp, "v2")["id"])
        assert r["status"] == "succeeded", r
        _sign_in(page, cp)
        v2 = page.locator('#deployments tr[data-model="tiny"][data-version="v2"]')
        expect(v2).to_contain_text("active", timeout=15_000)
        expect(page.locator('#deployments tr[data-version="v1"]')).to_contain_text("v1 (current)")
        page.get_by_role("button", name="Pin tiny to v2").click()
        _confirm(page, "Make v2 the version the bare alias tiny follows")
        expect(v2).to_contain_text("v2 (current)", timeout=15_000)
        expect(page.get_by_role("button", name="Pin tiny to v1")).to_be_visible()
        expect(page.locator('#traffic tr[data-version="v2"]')).to_contain_text("(current v2)", timeout=15_000)
        page.screenshot(path=str(outputs / "dashboard_pinned.png"), full_page=True)
        assert cp.api("GET", "/v1/deployments/tiny/v2")["current"] is True


# Slow decoding (8 tokens/s, at most 16 tokens a line, 32 lines at a time): the batch runs for
# tens of seconds, so the page sees it part done. Prompts past max_model_len are refused (400).
SLOW_SIM = "sim://tiny?tokens_per_s=8&max_num_seqs=64&max_model_len=512"
LINES, TOO_LONG = 320, 2


def test_batches_with_progress_bars_on_the_dashboard(tmp_path, page, outputs):
    with make_fleet(tmp_path) as make:
        cp, gw, key = make()
        first_deploy(cp, gw, key, engine=SLOW_SIM)
        lines = [
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "long " * 200 if i < TOO_LONG else f"q {i}"}],
                    "max_tokens": 16,
                },
            }
            for i in range(LINES)
        ]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, timeout=30, max_retries=0)
        data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _sign_in(page, cp)
        row = page.locator(f'#batches tr[data-batch="{batch.id}"]')
        expect(row).to_contain_text("team", timeout=15_000)
        expect(row).to_contain_text("/v1/chat/completions")
        bar = row.get_by_role("progressbar")
        expect(bar).to_have_attribute("aria-valuemax", str(LINES))
        # Part done while it runs: the running batch's bar has completed lines (its too-long
        # lines fail first, at once: a bar can be all failed so far).
        moving = page.locator(
            f'#batches tr[data-batch="{batch.id}"][data-status="in_progress"] '
            '[role="progressbar"]:not([data-completed="0"])'
        )
        expect(moving).to_have_count(1, timeout=60_000)
        assert float(bar.locator("rect.bar-completed").get_attribute("width") or 0) > 0
        page.screenshot(path=str(outputs / "dashboard_batch_running.png"), full_page=True)
        # It ends completed: a full bar, its failed lines counted and drawn in their own colour.
        expect(row).to_have_attribute("data-status", "completed", timeout=180_000)
        expect(bar).to_have_attribute("aria-valuenow", str(LINES), timeout=15_000)
        expect(bar).to_have_attribute("data-failed", str(TOO_LONG))
        expect(bar).to_have_attribute(
            "aria-label", re.compile(f"{LINES - TOO_LONG} completed, {TOO_LONG} failed")
        )
        # 2 of 320 lines: still drawn (at least 2 % of the bar) and named beside it.
        assert float(bar.locator("rect.bar-failed").get_attribute("width") or 0) >= 2
        expect(bar.locator(".error")).to_have_text(f"{TOO_LONG} failed")
        expect(row).to_contain_text("finished")
        page.screenshot(path=str(outputs / "dashboard_batch_done.png"), full_page=True)


def _drive(page: Page, cp, outputs: Path) -> None:
    page.goto(cp.url + "/dashboard")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("Admin key").fill("not-the-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-error")).to_contain_text("rejected", timeout=10_000)

    page.get_by_label("Admin key").fill(cp.admin_key)
    page.get_by_role("button", name="Sign in").click()
    deployment = page.locator('#deployments tr[data-model="tiny"][data-version="v1"]')
    expect(deployment).to_contain_text("active", timeout=15_000)
    expect(page.locator('#deployments tr[data-model="tiny"][data-version="v2"]')).to_contain_text("inactive")
    expect(_share(page, "v1")).to_have_attribute("data-share", "100", timeout=15_000)
    expect(page.locator('#replicas tr[data-state="ready"]')).to_have_count(1, timeout=15_000)
    # Per-tenant usage from the gateway's /metrics (the traffic driver is the tenant "team").
    expect(page.locator('#tenants tr[data-tenant="team"]')).to_be_visible(timeout=15_000)
    page.screenshot(path=str(outputs / "dashboard_before.png"), full_page=True)

    # Start v1 -> v2 from the form, confirming the dialog.
    page.get_by_label("Model", exact=True).select_option("tiny")
    page.get_by_label("To version").select_option("v2")
    page.get_by_label("Params (JSON)").fill(json.dumps(PARAMS))
    page.get_by_role("button", name="Start rollout…").click()
    _confirm(page, "version v2")
    running = page.locator('#rollouts tr[data-status="running"]')
    expect(running).to_have_count(1, timeout=15_000)
    expect(running).to_contain_text("v1 → v2")

    # The weights move in the page: v2 takes half of the region's traffic.
    expect(_share(page, "v2")).to_have_attribute("data-share", "50", timeout=120_000)
    expect(_share(page, "v1")).to_have_attribute("data-share", "50")
    expect(running).to_have_attribute("data-phase", "analysis:0", timeout=30_000)
    expect(page.locator("#weights-chart polyline")).to_have_count(2)  # a line per version
    shot = outputs / "dashboard_rollout.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("PAVED_DASHBOARD_SCREENSHOT"):  # the docs' picture: one laptop screen
        page.screenshot(path=os.environ["PAVED_DASHBOARD_SCREENSHOT"])

    # Roll back from the page.
    rollout_id = running.get_attribute("data-rollout")
    page.get_by_role("button", name=f"Roll back rollout {rollout_id}").click()
    _confirm(page, f"Abort rollout {rollout_id}")
    ended = page.locator(f'#rollouts tr[data-rollout="{rollout_id}"]')
    expect(ended).to_have_attribute("data-status", "rolled_back", timeout=120_000)
    expect(ended.get_by_role("button")).to_have_count(0)  # nothing left to roll back
    expect(_share(page, "v1")).to_have_attribute("data-share", "100", timeout=30_000)
    expect(page.locator('#audit tr[data-kind="rollout.abort_requested"]')).to_contain_text(
        "aborted through the API", timeout=15_000
    )
    expect(page.locator("#rollout-audit")).to_contain_text("abort requested")
    page.screenshot(path=str(outputs / "dashboard_rolled_back.png"), full_page=True)
    r = cp.api("GET", f"/v1/rollouts/{rollout_id}")
    assert r["status"] == "rolled_back", r

    # Scale v1 from the page: the dialog's input, then a second ready replica.
    page.get_by_role("button", name="Scale tiny@v1").click()
    page.get_by_role("dialog").get_by_label("Replicas per region").fill("2")
    _confirm(page, "tiny@v1")
    expect(deployment).to_contain_text("local: 2", timeout=15_000)
    v1_ready = page.locator('#replicas tr[data-state="ready"]', has_text="tiny@v1")
    expect(v1_ready).to_have_count(2, timeout=60_000)
    expect(page.locator('#audit tr[data-kind="scale"]', has_text="tiny@v1 scaled to 2")).to_have_count(1)
    assert cp.api("GET", "/v1/deployments/tiny/v1")["desired"] == {"local": 2}

    # GC from the page: its dry run finds nothing to remove (red-black versions are never GC's).
    page.get_by_role("button", name="Garbage-collect…").click()
    expect(page.locator("#toast")).to_contain_text("nothing to remove", timeout=10_000)
    expect(page.get_by_role("dialog")).to_be_hidden()
