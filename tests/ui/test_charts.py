"""The overview's charts in a real browser (headless Chromium) over a store filled as a short training run would
fill it (issue 28 item 5): each chart's plotted data read back from the page and asserted against the store,
hover values, drag-to-zoom, the robust y-scale with its outlier marked, held-out evals one point per round,
and (issue 29 item 9) a store whose rewards are all near 1e16 a few units apart draws without hanging the tab.

    ROLLWAY_UI_SCREENSHOTS=DIR pytest tests/ui/test_charts.py      # keeps overview-charts.png
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.services import app_services
from tests.fakes.sglang import FakeSGLang
from tests.harness import LiveGateway
from tests.ui.conftest import sign_in

STEPS = 12
STALENESS = [9, 0, 1, 0, 1, 1, 0, 2, 1, 0, 1, 1]
"""One early spike: the robust scale keeps the rest readable."""


def _turn(gw: LiveGateway, fake: FakeSGLang, tok: Any, cred: dict[str, Any], n: int) -> None:
    fake.script([[*range(200, 200 + n), tok.convert_tokens_to_ids("<|im_end|>")]])
    gw.openai(cred).chat.completions.create(model="m", messages=[{"role": "user", "content": "add"}], max_tokens=n + 2)


def _reward(gw: LiveGateway, cred: dict[str, Any], reward: float) -> None:
    gw.admin.post(f"/v1/sessions/{cred['session_id']}/reward", json={"reward": reward, "finish": True}) \
        .raise_for_status()


def _fill(gw: LiveGateway, fake: FakeSGLang, tok: Any, ckpt: Path) -> None:
    """STEPS steps: a group of 2 leased and published into version k + 1 with its step report (every figure the
    trainer reports), two eval rounds, the second with a straggler group completing over a second later."""
    for i, reward in enumerate([1.0, 0.0, 1.0]):  # eval round 0
        e = gw.group(1, task={"prompt": f"eval {i}"}, eval=True, metadata={"eval_version": 0})
        _turn(gw, fake, tok, e["sessions"][0], 2)
        _reward(gw, e["sessions"][0], reward)
    for k in range(STEPS):
        g = gw.group(2, task={"prompt": f"train {k}"})
        rewards = [1.0, 0.0] if k % 3 else [1.0, 1.0]
        for j, cred in enumerate(g["sessions"]):
            _turn(gw, fake, tok, cred, 2 + j + k % 4)
            _reward(gw, cred, rewards[j])
        lease = gw.admin.post("/v1/batches", json={"max_groups": 8}).json()
        assert lease["batch_id"], lease
        gw.admin.post("/v1/weights", json={"version": k + 1, "model_path": str(ckpt),
                                           "batch_ids": [lease["batch_id"]]}).raise_for_status()
        metrics = {"loss": round(0.5 / (k + 1), 4), "kl": round(0.001 * k, 4), "entropy": round(2.5 - 0.05 * k, 4),
                   "grad_norm": round(1.0 + (k % 4) * 0.25, 4), "lr": 1e-6 * min(1.0, (k + 1) / 4),
                   "clip_frac": round(0.01 * (k % 5), 4), "tokens_per_s": 1000.0 + 10 * k,
                   "reward_mean": sum(rewards) / 2, "staleness_max": STALENESS[k],
                   "staleness_mean": STALENESS[k] / 2}
        gw.admin.post("/v1/training/steps", json={
            "step": k, "version": k + 1, "metrics": metrics,
            "samples": [{"session_id": c["session_id"], "group_id": g["group_id"], "advantage": 0.0,
                         "reward": r, "loss_tokens": 10 * (k + 1) + j}
                        for j, (c, r) in enumerate(zip(g["sessions"], rewards, strict=True))]}).raise_for_status()
        if k == STEPS // 2:  # eval round 6: three groups now, the last one over a second later
            for i, reward in enumerate([1.0, 1.0, 0.0]):
                e = gw.group(1, task={"prompt": f"eval b{i}"}, eval=True, metadata={"eval_version": k})
                _turn(gw, fake, tok, e["sessions"][0], 2)
                _reward(gw, e["sessions"][0], reward)
            straggler = gw.group(1, task={"prompt": "eval b3"}, eval=True, metadata={"eval_version": k})
            _turn(gw, fake, tok, straggler["sessions"][0], 2)
    time.sleep(1.5)
    _reward(gw, straggler["sessions"][0], 1.0)


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, sqlite_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=sqlite_url) as gw:
        _fill(gw, fake, tok, tmp_path_factory.mktemp("ckpt"))
        gw.fake, gw.tok = fake, tok  # type: ignore[attr-defined]  # for the lease test's groups
        yield gw


def q(gw: LiveGateway, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(gw.settings.db_url.removeprefix("sqlite:///")) as conn:
        return conn.execute(sql, args).fetchall()


def plotted(page: Any, chart: str) -> dict[str, list[list[float]]]:
    """What the chart plots, by series name (lineChart keeps it on its figure)."""
    return {s["name"]: s["points"] for s in json.loads(page.get_attribute(f"#{chart}", "data-points"))}


def close(a: list[list[float]], b: list[tuple[float, float]] | list[list[float]]) -> bool:
    return len(a) == len(b) and all(x[0] == pytest.approx(y[0]) and x[1] == pytest.approx(y[1]) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def overview(run: LiveGateway, browser: Any) -> Iterator[Any]:
    page = sign_in(browser, run.url)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{run.url}/ui")
    page.wait_for_selector("#chart-staleness svg")
    page.errors = errors
    yield page
    page.context.close()


def test_each_chart_is_the_stores_data(overview: Any, run: LiveGateway, shots: Path) -> None:
    page, gw = overview, run
    steps = [(s, json.loads(m)) for s, m in q(gw, "SELECT step, metrics FROM training_steps ORDER BY version")]
    assert len(steps) == STEPS
    # Every trainer figure on its own chart (its own axis), per step, as reported.
    for chart, name in (("chart-loss", "loss"), ("chart-kl", "kl"), ("chart-entropy", "entropy"),
                        ("chart-grad-norm", "grad_norm"), ("chart-lr", "lr"), ("chart-clip", "clip_frac"),
                        ("chart-tokens-per-s", "tokens_per_s"), ("chart-train-step", "reward_mean")):
        got = plotted(page, chart)
        assert list(got) == [name], chart
        assert close(got[name], [(s, m[name]) for s, m in steps]), (chart, got[name])
    stale = plotted(page, "chart-staleness")
    assert close(stale["staleness_max"], [(s, m["staleness_max"]) for s, m in steps])
    assert close(stale["staleness_mean"], [(s, m["staleness_mean"]) for s, m in steps])
    # Response length: mean loss tokens per trained session, by the step that trained it.
    length = q(gw, "SELECT ts.step, avg(tr.loss_tokens) FROM trained_samples tr JOIN training_steps ts "
                   "ON ts.version = tr.version GROUP BY tr.version ORDER BY tr.version")
    assert close(plotted(page, "chart-length")["loss tokens / session"], length)
    # Training reward by trained version: the sessions of the groups trained into each version.
    by_version = q(gw, "SELECT g.trained_version, avg(s.reward) FROM groups g JOIN sessions s ON s.group_id = g.id "
                       "WHERE g.trained_version IS NOT NULL AND NOT g.is_eval AND s.reward IS NOT NULL "
                       "GROUP BY g.trained_version ORDER BY 1")
    assert len(by_version) == STEPS and close(plotted(page, "chart-train-version")["mean reward"], by_version)
    # By wall clock: the buckets hold every finished training session once, at their mean.
    clock = plotted(page, "chart-train-clock")["bucket mean"]
    api = gw.admin.get("/ui/api/overview").json()["train_reward_by_clock"]
    assert close(clock, [(p["t"], p["mean"]) for p in api])
    n, mean = q(gw, "SELECT count(*), avg(s.reward) FROM sessions s JOIN groups g ON g.id = s.group_id "
                    "WHERE NOT g.is_eval AND s.state = 'finished' AND s.reward IS NOT NULL AND g.completed_at IS NOT NULL")[0]
    assert sum(p["sessions"] for p in api) == n
    assert sum(p["mean"] * p["sessions"] for p in api) / n == pytest.approx(mean)
    # Held-out eval: one point per round (eval_version), at its last completion; the straggler is in its round.
    rounds = q(gw, "SELECT max(g.completed_at), avg(s.reward), json_extract(g.metadata, '$.eval_version') v "
                   "FROM groups g JOIN sessions s ON s.group_id = g.id WHERE g.is_eval GROUP BY v ORDER BY 1")
    assert len(rounds) == 2 and rounds[-1][1] == pytest.approx(0.75)
    eval_clock = plotted(page, "chart-eval-clock")
    assert close(eval_clock["mean"], [(t, m) for t, m, _ in rounds]), eval_clock
    assert eval_clock["pass@k"][-1][1] == pytest.approx(0.75)
    assert close(plotted(page, "chart-eval-version")["mean"], [(v, m) for _, m, v in sorted(rounds, key=lambda r: r[2])])
    versions = q(gw, "SELECT published_at, version FROM weight_versions ORDER BY version")
    assert close(plotted(page, "chart-versions")["version"], versions)
    # Each chart says what its figure is.
    for chart in ("chart-train-step", "chart-train-version", "chart-train-clock", "chart-eval-clock", "chart-length"):
        assert len(page.inner_text(f"#{chart} .def")) > 40, chart
    assert "reward_mean" in page.inner_text("#chart-train-step .def")
    assert "Filtered groups" in page.inner_text("#chart-train-version .def")
    page.screenshot(path=str(shots / "overview-charts.png"), full_page=True)
    assert page.errors == [], page.errors  # no console error: /favicon.ico is served


def test_robust_scale_marks_the_outlier(overview: Any) -> None:
    """One early staleness spike (9, the rest 0-2) does not flatten the chart: the scale ends below it and the
    spike is a mark on the edge with its value; a click scales to every point."""
    page = overview
    y0, y1 = json.loads(page.get_attribute("#chart-staleness", "data-yrange"))
    assert y0 == 0 and 2 <= y1 < 9
    assert page.locator("#chart-staleness .outlier").count() == 1
    assert "9 at" in page.text_content("#chart-staleness .outlier title")
    assert "1 point off the scale" in page.inner_text("#chart-staleness .chart-note")
    page.click("#chart-staleness button.full")
    assert json.loads(page.get_attribute("#chart-staleness", "data-yrange"))[1] >= 9
    assert page.locator("#chart-staleness .outlier").count() == 0
    page.click("#chart-staleness button.full")
    assert json.loads(page.get_attribute("#chart-staleness", "data-yrange"))[1] < 9


def test_hover_shows_values_and_drag_zooms(overview: Any, run: LiveGateway) -> None:
    page = overview
    last_step, metrics = q(run, "SELECT step, metrics FROM training_steps ORDER BY version DESC LIMIT 1")[0]
    page.locator("#chart-loss").scroll_into_view_if_needed()
    box = page.locator("#chart-loss rect.overlay").bounding_box()
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)
    tip = page.locator("#chart-loss .tip")
    assert tip.is_visible()
    text = tip.inner_text()
    assert f"trainer step {last_step}" in text and f"loss: {json.loads(metrics)['loss']:g}" in text, text
    full = json.loads(page.get_attribute("#chart-loss", "data-xrange"))
    assert full == [0, STEPS - 1]
    page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + 20)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + 30, steps=5)
    page.mouse.up()
    zoomed = json.loads(page.get_attribute("#chart-loss", "data-xrange"))
    assert full[0] < zoomed[0] < zoomed[1] < full[1]
    assert zoomed[0] == pytest.approx(0.25 * (STEPS - 1), abs=0.3) and zoomed[1] == pytest.approx(0.6 * (STEPS - 1), abs=0.3)
    y = json.loads(page.get_attribute("#chart-loss", "data-yrange"))
    assert y[1] < 0.5 / 3  # the y scale follows the steps in view (the loss falls: step 0's 0.5 is out of view)
    page.wait_for_timeout(5500)  # a poll redraws: the zoom stays
    assert json.loads(page.get_attribute("#chart-loss", "data-xrange")) == zoomed
    page.dblclick("#chart-loss rect.overlay")
    assert json.loads(page.get_attribute("#chart-loss", "data-xrange")) == full


def test_leases_and_queue_line(overview: Any) -> None:
    """Counts in words with their plurals; the trainer's last sign of life in the store."""
    text = overview.inner_text("#queue")  # eval groups (7 complete here) never wait for a trainer
    assert text.startswith("0 complete groups wait for a trainer; 0 groups leased: 0 held leases."), text
    assert "Trainer last seen (lease, publish or step report):" in text and "never" not in text


def test_lease_table_lapsed_and_paged(overview: Any, run: LiveGateway, shots: Path) -> None:
    """Issue 28 item 6: leases read "expiring in 210 s" after the trainer was gone, and every lease ever made was
    listed. 11 leases, the 10 oldest of 6 s: once they lapse they say so, newest first, 10 a page."""
    page, gw = overview, run
    fake, tok = gw.fake, gw.tok  # type: ignore[attr-defined]
    for i in range(11):
        g = gw.group(1, task={"prompt": f"lease {i}"})
        _turn(gw, fake, tok, g["sessions"][0], 2)
        _reward(gw, g["sessions"][0], 1.0)
    t0 = time.time()  # a lease call after the short ones lapsed would expire them (state expired): all first
    ids = []
    for i in range(11):
        ids.append(gw.admin.post("/v1/batches", json={"max_groups": 1, "lease_seconds": 6 if i < 10 else 600}).json()["batch_id"])
        if i == 9:
            t_last = time.time()  # the last short lease
    assert time.time() - t0 < 6, "the leases took longer than the short ones last"
    time.sleep(max(0.0, t_last + 6.3 - time.time()))
    app_services(gw.app).ui_overview = None
    page.reload()
    page.wait_for_selector("#leases tr.lease-lapsed")
    rows = page.locator("#leases tbody tr")
    assert rows.count() == 10
    assert page.eval_on_selector_all("#leases tbody tr", "rs => rs.map(r => r.dataset.lease)") == ids[:0:-1]
    assert rows.nth(0).inner_text().endswith("held, expires in 10 min")
    assert all(" ago" in rows.nth(i).inner_text() and "lapsed" in rows.nth(i).inner_text() for i in range(1, 10))
    assert "11 groups leased: 1 held lease, 10 lapsed leases" in page.inner_text("#queue")
    assert "1–10 of 11" in page.inner_text("#lease-pager")
    page.locator("#leases").scroll_into_view_if_needed()
    page.locator(".two").screenshot(path=str(shots / "overview-leases.png"))
    page.click("#leases-older")
    page.wait_for_selector(f"#leases tbody tr[data-lease='{ids[0]}']")
    assert page.locator("#leases tbody tr").count() == 1 and "lapsed" in page.inner_text("#leases tbody")
    page.click("#leases-newer")
    page.wait_for_selector(f"#leases tbody tr[data-lease='{ids[-1]}']")


@pytest.fixture(scope="module")
def big(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    """Issue 29 item 9's store: one group, its session rewards 1e16 and 1e16 + 4 (written into the store: the
    REST API refuses them now), so every point of the reward charts sits near 1e16 a few units apart."""
    from gateway.store.db import upgrade

    path = tmp_path_factory.mktemp("big") / "rollway.db"
    upgrade(f"sqlite:///{path}")
    with FakeSGLang(vocab=range(100, 1000)) as fake, \
            LiveGateway(backends=[fake.url], tokenizer=str(tiny_model_dir), db=f"sqlite:///{path}") as gw:
        g = gw.group(2, task={"prompt": "big"})
        for cred in g["sessions"]:
            _reward(gw, cred, 0.0)
        with sqlite3.connect(path) as conn:
            for cred, value in zip(g["sessions"], [1e16, 1e16 + 4], strict=True):
                conn.execute("UPDATE sessions SET reward = ? WHERE id = ?", (value, cred["session_id"]))
        yield gw


def test_large_close_values_do_not_hang_the_tab(big: LiveGateway, browser: Any) -> None:
    page = sign_in(browser, big.url)
    try:
        page.set_default_timeout(20_000)  # a hung lineChart never draws: this fails instead of hanging
        page.goto(f"{big.url}/ui")
        page.wait_for_selector("#chart-train-clock svg")
        assert plotted(page, "chart-train-clock")["bucket mean"][0][1] == 1e16 + 2
        # Direct calls over the worst cases: each returns, with distinct tick labels where the values differ.
        labels = page.evaluate("""() => {
            const out = [];
            for (const ys of [[1e16, 1e16 + 4], [-1.7e308, 1.7e308], [1e308, 1e308], [5e-324, 1e-323], [0, 1e155]]) {
              const fig = document.createElement("figure"); fig.id = "t" + out.length; document.body.appendChild(fig);
              UI.lineChart(fig, [{name: "r", points: ys.map((y, i) => [i, y])}], {robust: true});
              out.push([...fig.querySelectorAll("svg > text[text-anchor=end]")].map(t => t.textContent));
              fig.remove();
            }
            return out;
        }""")
        assert len(labels) == 5 and all(labels)
        assert len(set(labels[0])) == len(labels[0]) >= 2, labels[0]
    finally:
        page.context.close()
