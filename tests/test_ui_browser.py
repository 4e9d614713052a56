"""The user's journey through the Prefect UI, in headless Chromium, against a password-protected server.

Set-up as a user does it: `prefect work-pool create` (the process pool of prefect.yaml's pipeline
deployment), `prefect deploy --name pipeline-tiny-cpu` with a small variant of the tiny preset, and
`prefect worker start`. Then, in the browser only: log in, find the deployment, start a custom run
(the RunConfig renders as a form; one field is edited there), wait until the run waits at the approval
gate (Paused, or Suspended), open Resume, read the summary, tick approve, name the reviewer, submit,
wait for Completed, and open the approval decision, the loss curve and the benchmark artifacts.

Each step is a screenshot in the test's folder (printed at the start): 01-login.png, 02-dashboard.png, ...
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time

import httpx
import pytest
import yaml
from browser import REPO, WAITING_FOR_INPUT, LocalPrefect, Screens, launch_chromium, local_only, submit_custom_run

from eyas.config import RunConfig, load_run_config

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.timeout(1800)]

# Elements of the dialog wider than their box (scrollWidth > clientWidth) or reaching past the dialog's edges.
DIALOG_OVERFLOW_JS = """(dialog) => {
  const box = dialog.getBoundingClientRect();
  const found = [];
  for (const el of dialog.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || el.closest('input, textarea, select')) continue;
    const style = getComputedStyle(el);
    const scrolls = el.scrollWidth > el.clientWidth + 1 && ['auto', 'scroll'].includes(style.overflowX);
    if (scrolls || r.right > box.right + 1 || r.left < box.left - 1) {
      found.push(`${el.tagName.toLowerCase()}.${el.className}: ${el.scrollWidth}/${el.clientWidth} px, ` +
                 `${Math.round(r.left)}..${Math.round(r.right)} in ${Math.round(box.left)}..${Math.round(box.right)}`);
    }
  }
  return found.slice(0, 10);
}"""
REVIEWER = "ui-reviewer"
NOTE = "approved in the browser test"
EPOCHS_DEPLOYED, EPOCHS_IN_FORM = 3, 2


def pipeline_deployment() -> dict:
    """prefect.yaml's pipeline deployment of the tiny CPU preset."""
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for deployment in doc["deployments"]:
        if deployment["entrypoint"] == "flows/pipeline.py:pipeline" and (
            deployment["parameters"]["config"]["name"] == "tiny-cpu"
        ):
            return deployment
    raise AssertionError("prefect.yaml has no pipeline deployment of the tiny-cpu preset")


def small_tiny_config(workdir) -> RunConfig:
    """The tiny preset, shrunk so that the whole journey takes a few minutes: fewer and shorter samples,
    a few epochs, a 20-step smoke run (its loss halves by then), two benchmark prompts; a gate that gives
    up after 15 minutes, not a day."""
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    target = REPO / "fixtures" / "tiny-target"
    small = config.model_copy(
        update={
            "workdir": str(workdir),
            "target": config.target.model_copy(update={"model_path": str(target)}),
            "dataset": config.dataset.model_copy(
                update={"prompts_path": str(target / "prompts.jsonl"), "num_samples": 64, "max_new_tokens": 32}
            ),
            "train": config.train.model_copy(update={"num_epochs": EPOCHS_DEPLOYED}),
            "smoke": config.smoke.model_copy(update={"num_steps": 20}),
            "approval": config.approval.model_copy(update={"timeout_s": 900}),
            "bench": config.bench.model_copy(
                update={
                    "prompts_path": str(target / "heldout_prompts.jsonl"),
                    "num_prompts": 2,
                    "max_new_tokens": 24,
                    "min_tau": 1.0,
                }
            ),
        }
    )
    return RunConfig.model_validate(small.model_dump())


def announce(request, line: str) -> None:
    """Print past pytest's capture, so that the screenshot folder shows in a normal run."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}", flush=True)


@pytest.fixture
def local_prefect(tmp_path):
    """A fresh server with a random password; stopped (with the worker, its flow runs and torchrun) at the end."""
    local = LocalPrefect(home=tmp_path / "prefect", auth_string=f"eyas:{secrets.token_urlsafe(12)}")
    try:
        local.start_server()
        yield local
    finally:
        local.stop()


def test_user_runs_the_pipeline_from_the_ui_and_approves_it_there(local_prefect, tmp_path, request):
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=60_000)  # a loaded 2-core machine renders slowly
    local = local_prefect
    shots_dir = tmp_path / "screenshots"
    announce(request, f"browser test: screenshots in {shots_dir}, server and worker logs in {local.home}")
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # the API refuses a client without the password; the CLI below passes PREFECT_API_AUTH_STRING
    assert httpx.post(f"{local.api_url}/flows/filter", json={}, timeout=10).status_code == 401
    deployment = pipeline_deployment()
    pool = deployment["work_pool"]["name"]
    config = small_tiny_config(tmp_path / "run")
    local.cli("work-pool", "create", pool, "--type", "process")
    local.cli(
        "--no-prompt",
        "deploy",
        "--name",
        deployment["name"],
        "--params",
        json.dumps({"config": config.model_dump(mode="json")}),
    )
    local.spawn(
        "worker",
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
        local.client_env(EYAS_REPO=str(REPO), PREFECT_WORKER_QUERY_SECONDS="2"),
    )
    timings["set-up (server, pool, deploy)"] = time.monotonic() - t0

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(60_000)
        context.route("**/*", local_only)
        page = context.new_page()
        shot = Screens(page, shots_dir)
        try:
            t = time.monotonic()
            # 1. the login page asks for the server's auth string
            page.goto(local.ui_url)
            page.locator("input[type=password]").fill(local.auth_string)
            shot("login")
            page.get_by_role("button", name="Login").click()
            page.wait_for_url(lambda url: "/login" not in url)
            expect(page.get_by_role("link", name="Deployments")).to_be_visible()
            shot("dashboard")

            # 2. the deployment, and a custom run: the RunConfig is a form; edit one field there
            page.get_by_role("link", name="Deployments").click()
            page.get_by_role("link", name=deployment["name"], exact=True).click()
            expect(page.get_by_text(pool, exact=True).first).to_be_visible()
            shot("deployment")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Custom run").click()
            expect(page.get_by_label("Workdir", exact=True)).to_have_value(config.workdir)
            expect(page.get_by_label("Model Path", exact=True)).to_have_value(config.target.model_path)
            epochs = page.get_by_label(re.compile(r"^Num Epochs\b"))
            expect(epochs).to_have_value(str(EPOCHS_DEPLOYED))
            epochs.fill(str(EPOCHS_IN_FORM))
            shot("custom-run-form")
            run_id = submit_custom_run(page, shot)
            view_run = page.get_by_role("link", name="View run").or_(page.get_by_role("button", name="View run"))
            expect(view_run.first).to_be_visible()
            shot("run-submitted")
            view_run.first.click()
            page.wait_for_url(re.compile(rf"/runs/flow-run/{run_id}"))
            run_url = page.url.split("?")[0]
            settle(page)
            shot("run-page")
            timings["browser: log in, start a custom run"] = time.monotonic() - t

            # 3. the run waits at the approval gate: Paused (process kept) or Suspended (process exits)
            t = time.monotonic()
            run = local.wait_for_state(run_id, WAITING_FOR_INPUT, timeout_s=900)
            assert run["parameters"]["config"]["train"]["num_epochs"] == EPOCHS_IN_FORM, "the form's edit was lost"
            timings[f"run start -> {run['state']['name']}"] = time.monotonic() - t
            page.reload()
            expect(page.get_by_text(re.compile(r"^(Paused|Suspended)$")).first).to_be_visible()
            settle(page)
            shot("waiting-for-approval")

            # 4. Resume: the summary above the typed form; approve, reviewer, note
            t = time.monotonic()
            click_menu_item(page, "Resume")
            dialog = page.get_by_role("dialog")
            expect(dialog.get_by_label(re.compile(r"^Reviewer"))).to_be_visible()
            expect(dialog).to_contain_text("eyas.train")  # the summary shows the exact command that will run
            # the decision's facts first: what trains and what is frozen, the cost, the data, the smoke run
            for words in ("trains", "frozen", "cost", "about", "wall", "shards verified", "smoke run", "passed"):
                expect(dialog).to_contain_text(words)
            expect(dialog).not_to_contain_text("{'weight'")  # shapes as [512, 128], not Python dicts
            # the overrides are plain optional numbers, not an `int | None` type switch
            expect(dialog.get_by_label(re.compile(r"^Num Epochs"))).to_be_visible()
            expect(dialog).not_to_contain_text("Property is type")
            # nothing in the dialog is wider than its box: no element scrolls or sticks out sideways
            overflow = dialog.evaluate(DIALOG_OVERFLOW_JS)
            assert not overflow, f"the Resume dialog overflows sideways: {overflow}"
            dialog.screenshot(path=str(shots_dir / "resume-dialog.png"))
            dialog.locator("pre").last.scroll_into_view_if_needed()
            dialog.screenshot(path=str(shots_dir / "resume-dialog-command.png"))
            # the complete summary is a full-width artifact, linked from the description
            link = dialog.get_by_role("link", name="The complete summary")
            href = link.get_attribute("href")
            artifact_id = re.search(r"/artifacts/artifact/([0-9a-f-]{36})$", href or "")
            assert artifact_id, f"the complete summary's link: {href!r}"
            full = local.api("GET", f"/artifacts/{artifact_id[1]}")
            assert full["key"] == "gate-summary" and "the complete summary" in full["data"], full
            shot("resume-form")
            approve = dialog.get_by_role("switch", name=re.compile(r"^Approve")).or_(
                dialog.get_by_role("checkbox", name=re.compile(r"^Approve"))
            )
            approve.click()
            expect(approve).to_be_checked()
            dialog.get_by_label(re.compile(r"^Reviewer")).fill(REVIEWER)
            dialog.get_by_label(re.compile(r"^Note")).fill(NOTE)
            dialog.get_by_label(re.compile(r"^Reviewer")).scroll_into_view_if_needed()
            shot("resume-form-filled")
            dialog.get_by_role("button", name="Resume", exact=True).click()
            expect(dialog).to_be_hidden()
            settle(page)
            shot("resumed")

            # 5. training, export, benchmark; the run completes
            # (a run still waiting minutes after the answer means the gate asked again)
            run = local.wait_for_state(run_id, ("Completed",), timeout_s=900, stuck_in=WAITING_FOR_INPUT)
            timings["resume -> Completed"] = time.monotonic() - t
            t = time.monotonic()
            page.goto(run_url)
            expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
            settle(page)
            shot("completed")

            # 6. the artifacts: the decision on the run itself, the others on its subflow runs
            page.get_by_role("tab", name="Artifacts").click()
            page.get_by_text("approval-decision", exact=True).click()
            expect(page.get_by_role("heading", name="Training approved")).to_be_visible()
            expect(page.get_by_text(REVIEWER, exact=True).first).to_be_visible()
            shot("approval-decision")

            open_subflow_run(page, run_url, "train-drafter")
            settle(page)
            shot("train-drafter-run")
            page.get_by_role("tab", name="Artifacts").click()
            page.get_by_text("loss-curve", exact=True).click()
            expect(page.locator("img").first).to_be_visible()
            shot("loss-curve")

            open_subflow_run(page, run_url, "benchmark-acceptance")
            page.get_by_role("tab", name="Artifacts").click()
            for key in ("benchmark", "benchmark-table", "acceptance-plots"):
                expect(page.get_by_text(key, exact=True)).to_be_visible()
            shot("benchmark-artifacts")
            page.get_by_text("benchmark", exact=True).click()
            expect(page.get_by_role("heading", name=re.compile(r"^Acceptance")).first).to_be_visible()
            expect(page.get_by_text("tau_mean").first).to_be_visible()
            shot("benchmark", full_page=True)
            page.go_back()
            page.get_by_text("acceptance-plots", exact=True).click()
            expect(page.locator("img").first).to_be_visible()
            shot("acceptance-plots")
            timings["browser: artifacts"] = time.monotonic() - t
        except Exception:
            try:  # best effort: the page as it was when the step failed
                shot("failure", full_page=True)
                (shots_dir / "failure.html").write_text(page.content())
            except Exception as err:  # keep the step's own error
                print(f"no failure screenshot: {err}")
            raise
        finally:
            browser.close()

    record = json.loads((config.paths.root / "approval.json").read_text())
    assert record["approve"] is True and record["reviewer"] == REVIEWER and record["note"] == NOTE
    assert (config.paths.bench_dir / "benchmark.json").is_file()
    timings["total"] = time.monotonic() - t0
    (shots_dir / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    announce(request, "browser test timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))


def settle(page) -> None:
    """For a readable screenshot: let the page's requests finish (the UI polls, so this may not happen)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_load_state("networkidle", timeout=10_000)
    except PlaywrightTimeout:
        pass


def click_menu_item(page, item: str) -> None:
    """Open the page's menus in turn until one offers `item`, and choose it (the run's menu has no name)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    menus = page.get_by_role("button", name="Open menu")
    menus.first.wait_for()
    for i in range(menus.count()):
        menus.nth(i).click()
        entry = page.get_by_role("menuitem", name=item, exact=True)
        try:
            entry.wait_for(timeout=3000)
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
            continue
        entry.click()
        return
    raise AssertionError(f"no menu on {page.url} offers {item!r}")


def open_subflow_run(page, run_url: str, flow_name: str) -> None:
    """Run page -> Subflow Runs -> the run of flow `flow_name` (its link follows the flow's link)."""
    page.goto(run_url)
    page.get_by_role("tab", name="Subflow Runs").click()
    flow_link = page.get_by_role("link", name=flow_name, exact=True)
    flow_link.first.wait_for()
    flow_link.first.locator("xpath=following::a[contains(@href, '/runs/flow-run/')][1]").click()
    page.wait_for_url(lambda url: "/runs/flow-run/" in url and url.split("?")[0] != run_url)
    page.get_by_text(flow_name, exact=True).first.wait_for()
