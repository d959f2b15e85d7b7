"""The balance dashboards as a user sees them: TensorBoard rendered by headless Chromium.

Uses Debian's `chromium` and `chromium-driver` through selenium; skipped only when those are
absent. The charts live in shadow DOM, so the page is walked by JavaScript. Two negative tests
prove the check fails when our layout or our data is missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Dict, List

import pytest

from tf_hetbatch.dashboards import summaries
from test_summaries import (
    NUM_REPLICAS,
    start_tensorboard,
    write_keras_tensorboard_logs,
    write_synthetic_balance_run,
)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
           f"apt-get install chromium chromium-driver",
)]

# Every custom-scalars chart card on the page: its category, title, the series listed under
# "Matches" and the stroke colours of the drawn (non-empty) lines.
_COLLECT_CHARTS_JS = r"""
function findAll(root, selector, acc) {
  for (const el of root.querySelectorAll('*')) {
    if (el.matches(selector)) acc.push(el);
    if (el.shadowRoot) findAll(el.shadowRoot, selector, acc);
  }
  return acc;
}
function ancestor(el, tag) {
  for (let n = el; n; n = n.parentNode || n.host) {
    if (n.tagName && n.tagName.toLowerCase() === tag) return n;
  }
  return null;
}
return findAll(document, 'tf-custom-scalar-multi-line-chart-card', []).map(card => {
  const view = ancestor(card, 'tf-category-paginated-view');
  const lines = findAll(card.shadowRoot, 'vz-line-chart2', [])
      .flatMap(chart => findAll(chart.shadowRoot || chart, 'path.line', []))
      .filter(p => (p.getAttribute('d') || '').length > 20);
  return {
    category: view && view.category ? view.category.name : null,
    title: card.title,
    series: findAll(card.shadowRoot, '.match-list-entry', [])
        .map(e => e.textContent.replace(/\s+/g, ' ').replace(/^[^\w]+/, '').trim()),
    colours: [...new Set(lines.map(p => p.style.stroke || p.getAttribute('stroke')))],
  };
});
"""


_COLLECT_RUNS_JS = r"""
function findAll(root, selector, acc) {
  for (const el of root.querySelectorAll('*')) {
    if (el.matches(selector)) acc.push(el);
    if (el.shadowRoot) findAll(el.shadowRoot, selector, acc);
  }
  return acc;
}
return findAll(document, 'tf-runs-selector paper-checkbox, paper-checkbox[id^="checkbox-"]', [])
    .map(box => box.id.replace(/^checkbox-/, '')).filter(name => name);
"""


def collect_runs(driver) -> List[str]:
    """Returns the run names listed in the runs selector of the page."""
    return driver.execute_script(_COLLECT_RUNS_JS)


def collect_charts(driver) -> List[Dict[str, object]]:
    """Returns every custom-scalars chart card currently rendered in the page."""
    return driver.execute_script(_COLLECT_CHARTS_JS)


def balance_dashboard_problems(charts: List[Dict[str, object]]) -> List[str]:
    """Lists what is missing for our replica charts to count as rendered; empty if all is well.

    Each chart of the "tf_hetbatch balance" category must be present, list one series per
    replica (`<tag> (hetbatch/replica_<k>)`) and draw lines in one colour per replica.
    """
    ours = {c["title"]: c for c in charts if c["category"] == summaries.LAYOUT_CATEGORY}
    problems = []
    for title, (regex,) in summaries.REPLICA_CHARTS:
        chart = ours.get(title)
        if chart is None:
            problems.append(f"chart {title!r} not found in category {summaries.LAYOUT_CATEGORY!r}")
            continue
        tag = regex.strip("^$")
        expected = {f"{tag} ({summaries.replica_run(k)})" for k in range(NUM_REPLICAS)}
        if set(chart["series"]) != expected:
            problems.append(f"chart {title!r} lists series {chart['series']}, expected {expected}")
        if len(chart["colours"]) < NUM_REPLICAS:
            problems.append(f"chart {title!r} draws lines in colours {chart['colours']}, "
                            f"expected {NUM_REPLICAS} (one per replica)")
    return problems


def wait_for_balance_dashboard(driver, url: str, timeout: float) -> List[Dict[str, object]]:
    """Opens the custom-scalars dashboard and waits until our charts are rendered.

    Returns:
      The charts found.

    Raises:
      AssertionError: naming what is still missing after `timeout` seconds.
    """
    driver.get(url + "/#custom_scalars")
    deadline = time.monotonic() + timeout
    while True:
        charts = collect_charts(driver)
        problems = balance_dashboard_problems(charts)
        if not problems:
            return charts
        if time.monotonic() > deadline:
            raise AssertionError(f"balance dashboard not rendered after {timeout} s: {problems}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless", "--no-sandbox", "--disable-gpu",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(60)
    browser.set_script_timeout(30)
    yield browser
    browser.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _serve(log_dir: str, request) -> str:
    url, stop = start_tensorboard(log_dir)
    request.addfinalizer(stop)
    return url


def test_custom_scalars_shows_one_series_per_replica(driver, tmp_path, request):
    write_keras_tensorboard_logs(str(tmp_path))
    write_synthetic_balance_run(str(tmp_path))
    url = _serve(str(tmp_path), request)
    charts = wait_for_balance_dashboard(driver, url, timeout=45)
    cluster = {c["title"]: c for c in charts if c["category"] == summaries.LAYOUT_CLUSTER_CATEGORY}
    assert set(cluster) == {title for title, _ in summaries.CLUSTER_CHARTS}
    step_chart = cluster["Step time vs ideal (ms)"]
    assert set(step_chart["series"]) == {
        f"{summaries.TAG_STEP_TIME_MS} ({summaries.cluster_run()})",
        f"{summaries.TAG_IDEAL_STEP_TIME_MS} ({summaries.cluster_run()})",
    }
    screenshot = os.path.join(tempfile.gettempdir(), "tf_hetbatch_balance_dashboard.png")
    assert driver.save_screenshot(screenshot)
    assert set(collect_runs(driver)) >= {"train", "validation", summaries.cluster_run()}


def test_check_fails_without_our_layout(driver, tmp_path, request):
    # The same per-replica scalars, written without BalanceWriter: no custom-scalars layout.
    import tensorflow as tf

    for k in range(NUM_REPLICAS):
        with tf.summary.create_file_writer(
                os.path.join(str(tmp_path), summaries.replica_run(k))).as_default():
            for step in range(10, 100, 10):
                tf.summary.scalar(summaries.TAG_BATCH_SIZE, 32.0, step=step)
                tf.summary.scalar(summaries.TAG_COMPUTE_TIME_MS, 30.0 + k, step=step)
    url = _serve(str(tmp_path), request)
    with pytest.raises(AssertionError, match="not found in category"):
        wait_for_balance_dashboard(driver, url, timeout=6)
    # The page did load (the runs are listed); only our layout is missing.
    assert summaries.replica_run(0) in collect_runs(driver)


def test_check_fails_with_layout_but_no_data(driver, tmp_path, request):
    # Only our layout, no window was ever written: the charts exist but show no replica.
    import tensorflow as tf
    from tensorboard.plugins.custom_scalar import metadata

    with tf.summary.create_file_writer(
            os.path.join(str(tmp_path), summaries.cluster_run())).as_default():
        tf.summary.write(tag=metadata.CONFIG_SUMMARY_TAG,
                         tensor=tf.constant(summaries.make_layout().SerializeToString()),
                         metadata=metadata.create_summary_metadata(), step=0)
    url = _serve(str(tmp_path), request)
    with pytest.raises(AssertionError, match="lists series"):
        wait_for_balance_dashboard(driver, url, timeout=6)
    titles = {c["title"] for c in collect_charts(driver)}
    assert {title for title, _ in summaries.REPLICA_CHARTS} <= titles  # layout did render
