"""The control panel against a live `flashmoe run --loop`: its JSON API (stats, config,
refusals, a live change that shows in the stats), its Prometheus metrics, and its page in
headless Chromium (charts that update, a tuning change from the form, screenshots kept).

The run uses a small store of gpt-oss-20b's shape (`gpt-oss-tiny`: the trace's layers and
experts, small tensors) and a warm-up on a slice of the train split, as the live learning
tests do, with the worker paced at TOKEN_MS so that two shared cores are not saturated.
"""

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common.config import describe_fields, load_config
from common.traces import load_gptoss20b
from flashmoe.runtime.launch import child_env, cli_command, stop_process
from flashmoe.tools.synth_store import synth_store
from tests.support.traces import sequences_slice

pytestmark = [pytest.mark.slow, pytest.mark.traces]
TOKEN = "panel-test-token"
TOKEN_MS = 40.0
STATIC = Path(__file__).resolve().parents[2] / "services" / "control_panel" / "static"
URL_LINE = re.compile(r"\[run\] control panel (http://\S+)\s+token (\S+)")


class LiveRun:
    """`flashmoe run --loop` in a child process, its output read on a thread."""

    def __init__(self, root: Path) -> None:
        from flashmoe.sim.learning import warmup

        store = synth_store(root / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                            parallelism=3, show_progress=False).path
        warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 3),
               load_config(env={}), root / "warmup")
        self.runtime = root / "rt"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cli_command("run", "--loop", "--home", str(root / "home"), "--store", str(store),
                        "--warmup", str(root / "warmup"), "--capacity", "96", "--token-ms",
                        str(TOKEN_MS), "--set", "panel.port=0", "--set",
                        f"panel.token={TOKEN}", "--set", f"ipc.runtime_dir={self.runtime}"),
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.url, self.token = self._wait_for_url(timeout_s=300)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def _wait_for_url(self, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                match = URL_LINE.search(line)
                if match:
                    return match.group(1).rstrip("/"), match.group(2)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise AssertionError("flashmoe run printed no panel URL:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        return stop_process(self.proc, 60)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    run = LiveRun(tmp_path_factory.mktemp("panel"))
    yield run
    assert run.stop() == 0, "\n".join(run.lines[-30:])
    assert not list(run.runtime.glob("*.sock")), "socket files left behind"


def request(live, method: str, path: str, body=None, headers=None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(live.url + path, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def put(live, changes, token=TOKEN, header="authorization"):
    headers = {}
    if token is not None:
        headers = {"authorization": f"Bearer {token}"} if header == "authorization" else \
            {"x-flashmoe-token": token}
    return request(live, "PUT", "/api/config", {"changes": changes}, headers)


def wait_for_stats(live, condition, timeout_s=120.0, what=""):
    deadline = time.monotonic() + timeout_s
    while True:
        _, current = request(live, "GET", "/api/stats")
        if condition(current):
            return current
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {current}"
        time.sleep(0.5)


def assert_taken_live(status, body, key):
    """The services take ``key`` live: a 409 here is a failure, with the service's reason."""
    refused = body.get("detail", {}).get("refused", {}) if isinstance(body, dict) else {}
    assert status == 200, f"{key} refused ({status}): {refused.get(key, body)}"


def test_run_prints_the_url_and_the_token_and_listens_on_loopback(live):
    assert live.url.startswith("http://127.0.0.1:") and live.token == TOKEN
    info = json.loads((live.runtime / "panel.json").read_text())
    assert info["url"].rstrip("/") == live.url


def test_stats_come_from_every_service_with_live_rates(live):
    services = {"cache_manager", "feature_extractor", "predictor"}
    # A busy service may miss one stats round (its answer is late): wait for a full one.
    stats = wait_for_stats(live, lambda s: (s["rates"].get("tokens_per_s") or 0) > 0
                           and services <= set(s["services"]), what="tokens flowing")
    assert stats["services"]["cache_manager"]["policy"] == "flashmoe"
    rates = stats["rates"]
    assert 0 <= rates["hit_rate"] <= 1 and 0 <= rates["stall_free_rate"] <= rates["hit_rate"]
    assert rates["learner_cpu_ms_per_token"] > 0
    status, history = request(live, "GET", "/api/history")
    assert status == 200 and len(history["t"]) >= 2 and len(history["hit_rate"]) == \
        len(history["t"])


def test_metrics_are_prometheus_text(live):
    wait_for_stats(live, lambda s: "cache_manager" in s["services"], what="a stats round")
    req = urllib.request.urlopen(live.url + "/metrics", timeout=30)
    assert req.headers["content-type"].startswith("text/plain")
    text = req.read().decode()
    assert 'flashmoe_up{service="cache_manager"} 1.0' in text
    assert re.search(r"^flashmoe_cache_manager_hits_total \d", text, re.MULTILINE)
    assert re.search(r"^flashmoe_hit_ratio [0-9.]+", text, re.MULTILINE)


def test_config_has_every_field_with_its_range_and_no_token(live):
    status, config = request(live, "GET", "/api/config")
    assert status == 200 and config["source"] == "cache_manager"
    fields = {row["key"]: row for row in config["fields"]}
    assert set(fields) == {row["key"] for row in describe_fields() if not row["secret"]}
    assert "panel.token" not in fields and TOKEN not in json.dumps(config)
    assert fields["cache.capacity_experts"]["value"] == 96
    assert (fields["io.queue_depth"]["lo"], fields["io.queue_depth"]["hi"]) == (1, 256)
    assert fields["cache.policy"]["live"] and not fields["store.block_size"]["live"]
    status, openapi = request(live, "GET", "/openapi.json")
    schema = openapi["components"]["schemas"]["ConfigUpdate"]["properties"]["changes"]
    assert schema["properties"]["io.queue_depth"]["maximum"] == 256
    status, docs = request(live, "GET", "/docs")
    assert status == 200 and "cdn" not in docs.lower()


# The refusal cases: (changes, token, status, words in the answer).
REFUSALS = [
    ({"cache.policy": "lru"}, None, 401, ["token"]),
    ({"cache.policy": "lru"}, "wrong", 401, ["token"]),
    ({"io.queue_depth": 100000}, TOKEN, 422, ["io.queue_depth", "[1, 256]"]),
    ({"prefetch.threshold": -1}, TOKEN, 422, ["prefetch.threshold", "[0.0, 1.0]"]),
    ({"cache.no_such_field": 1}, TOKEN, 422, ["unknown config field cache.no_such_field"]),
    ({"cache.policy": "belady"}, TOKEN, 422, ["cache.policy", "choices"]),
    ({"store.block_size": "128K"}, TOKEN, 409, ["store.block_size", "flashmoe convert"]),
    ({"profile": "8gb"}, TOKEN, 409, ["profile", "restart"]),
    ({"cache.capacity_experts": 4096}, TOKEN, 409, ["above the arena's 96 slots"]),
    ({"prefetch.window": 200}, TOKEN, 409, ["prefetch.budget"]),
    ({"io.queue_depth": 4}, TOKEN, 409, ["io.queue_depth", "cannot change while"]),
]


def test_refusals_401_422_409(live, tmp_path):
    rows = []
    for changes, token, expected, words in REFUSALS:
        status, body = put(live, changes, token)
        text = json.dumps(body)
        rows.append({"changes": changes, "token": "ok" if token == TOKEN else
                     "none" if token is None else "wrong", "status": status, "answer": body})
        assert status == expected, (changes, body)
        for word in words:
            assert word in text, (changes, body)
    status, _ = put(live, {"cache.policy": "lru"}, "wrong", header="x-flashmoe-token")
    assert status == 401
    (tmp_path / "refusals.json").write_text(json.dumps(rows, indent=1))
    _, stats = request(live, "GET", "/api/stats")
    assert stats["services"]["cache_manager"]["policy"] == "flashmoe"  # nothing applied
    assert stats["tuned"] == {}


def test_a_refusal_of_a_deeply_nested_body_is_a_422_with_the_input_clipped(live):
    """A body 480 levels deep is valid JSON, but echoing it in the refusal went past the
    recursive encoders (500, found by the report-profile fuzz run)."""
    deep = 1
    for _ in range(240):
        deep = {"a": [deep]}
    status, body = request(live, "PUT", "/api/config", deep,
                           {"authorization": f"Bearer {TOKEN}"})
    assert status == 422 and '"..."' in json.dumps(body), body


def test_a_live_change_reaches_the_cache_manager_and_shows_in_stats(live):
    status, body = put(live, {"cache.policy": "lru"}, header="x-flashmoe-token")
    assert_taken_live(status, body, "cache.policy")
    assert status == 200, body
    assert body["applied"]["cache.policy"] == ["cache_manager"]
    stats = wait_for_stats(live, lambda s: s["services"].get("cache_manager", {})
                           .get("policy") == "lru", what="the policy in the stats")
    assert stats["tuned"]["cache.policy"] == "lru"
    _, config = request(live, "GET", "/api/config")
    assert {row["key"]: row["value"] for row in config["fields"]}["cache.policy"] == "lru"
    status, body = put(live, {"cache.policy": "flashmoe"})
    assert status == 200, body


def test_capacity_down_and_the_hybrid_share_change_live(live):
    status, body = put(live, {"cache.capacity_experts": 64})
    assert status == 200, body
    wait_for_stats(live, lambda s: s["services"].get("cache_manager", {}).get("capacity") == 64,
                   what="the capacity in the stats")
    status, body = put(live, {"cache.capacity_experts": 1})
    assert status == 409 and "can go down to" in json.dumps(body), body
    status, body = put(live, {"cache.capacity_experts": 96})
    assert status == 200, body
    status, body = put(live, {"cache.policy_params": {"hybrid_share": 0.5}})
    assert status == 200, body
    wait_for_stats(live, lambda s: '"hybrid_share": 0.5' in
                   s["services"].get("cache_manager", {}).get("policy_params", ""),
                   what="the hybrid share in the stats")
    status, body = put(live, {"cache.policy_params": {"no_such_param": 1}})
    assert status in (409, 422), body
    status, body = put(live, {"cache.policy_params": {}})
    assert status == 200, body


def find_chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def test_page_in_headless_chromium(live, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    found = find_chromium()
    if found is None:
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh "
                    "installs them with apt-get)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1800", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=found[1]),
                              options=options)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    try:
        driver.get(live.url + "/")
        # the page re-renders its figures every second: an element found may be replaced before
        # its text is read, so a wait retries on a stale element
        wait = WebDriverWait(driver, 60, ignored_exceptions=(StaleElementReferenceException,))
        wait.until(lambda d: d.execute_script("return window.flashmoePanel.chartUpdates") >= 1)
        first = driver.execute_script("return window.flashmoePanel.historyPoints")
        wait.until(lambda d: d.execute_script(
            "return window.flashmoePanel.historyPoints") > first)  # a chart updated
        if (STATIC / "vendor" / "uplot" / "uPlot.iife.min.js").is_file():
            assert driver.find_elements(By.CSS_SELECTOR, "#chart-rates .u-wrap canvas")
        else:
            assert "not installed" in driver.find_element(By.ID, "chart-note").text
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-key='cache.policy']"))
        driver.save_screenshot(str(shots / "1-page.png"))
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        row = driver.find_element(By.CSS_SELECTOR, "tr[data-key='prefetch.threshold']")
        field = row.find_element(By.CSS_SELECTOR, "input")
        field.clear()
        field.send_keys("0.6")
        row.find_element(By.TAG_NAME, "button").click()
        wait.until(lambda d: d.execute_script("return window.flashmoePanel.lastTune"))
        result = driver.execute_script("return window.flashmoePanel.lastTune")
        driver.execute_script("document.getElementById('tune-result').scrollIntoView()")
        driver.save_screenshot(str(shots / "2-after-tuning.png"))
        assert_taken_live(result["status"], result["body"], "prefetch.threshold")
        assert result["status"] == 200, result
        assert "applied prefetch.threshold" in driver.find_element(By.ID, "tune-result").text
        Select(driver.find_element(By.CSS_SELECTOR, "tr[data-key='cache.policy'] select")) \
            .select_by_value("lru")
        driver.find_element(By.CSS_SELECTOR, "tr[data-key='cache.policy'] button").click()
        wait.until(lambda d: "cache.policy" in d.find_element(By.ID, "tune-result").text)
        wait_for_stats(live, lambda s: s["services"].get("cache_manager", {})
                       .get("policy") == "lru", what="the policy set from the page")
        wait.until(lambda d: "lru" in d.find_element(By.ID, "figure-policy").text)
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(shots / "3-policy-lru.png"))
    finally:
        driver.quit()
        print(f"screenshots in {shots}")
