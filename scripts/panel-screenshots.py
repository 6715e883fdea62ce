"""Screenshots of the control panel over a live `flashmoe run --loop`, once its charts hold data.

    python scripts/panel-screenshots.py [--out docs/img] [--seconds 90] [--token-ms 60]

Starts the main job (the sample or the full eval split, as `flashmoe run` finds them) with the
panel on a free port, lets it run ``--seconds``, then takes the page in headless Chromium (the
same browser the panel's test drives): ``panel-live.png`` (figures and charts) and
``panel-experts.png`` (experts per layer: popularity and residency; the configuration form
below). Stops the run with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def start_run(seconds_ms: float) -> tuple[subprocess.Popen, list[str]]:
    env = dict(os.environ, FLASHMOE_PANEL__PORT="0")
    proc = subprocess.Popen([sys.executable, "-m", "flashmoe", "run", "--loop", "--token-ms",
                             str(seconds_ms)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout),
                     daemon=True).start()
    return proc, lines


def wait_for(lines: list[str], pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := re.search(pattern, line):
                return match
        time.sleep(0.2)
    raise SystemExit(f"no line matching {pattern!r} in {timeout_s:g} s:\n" + "\n".join(lines[-20:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img", help="folder of the PNG files")
    parser.add_argument("--seconds", type=float, default=90.0, help="run time before the shots")
    parser.add_argument("--token-ms", type=float, default=60.0, help="a decode step's length")
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver_path):
        raise SystemExit("chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, lines = start_run(args.token_ms)
    try:
        match = wait_for(lines, r"control panel (http://\S+)\s+token (\S+)", 900)
        url = match.group(1)
        print(f"panel at {url}; running {args.seconds:g} s", flush=True)
        time.sleep(args.seconds)
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--window-size=1400,1000", "--disable-gpu"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path),
                                  options=options)
        try:
            driver.get(url)
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.execute_script(
                "return window.flashmoePanel && window.flashmoePanel.historyPoints") >= 5)
            time.sleep(3)
            driver.save_screenshot(str(out / "panel-live.png"))
            heatmap = driver.find_element(By.XPATH, "//*[contains(text(), 'Experts per layer')]")
            driver.execute_script("arguments[0].scrollIntoView()", heatmap)
            time.sleep(1)
            driver.save_screenshot(str(out / "panel-experts.png"))
        finally:
            driver.quit()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    for name in ("panel-live.png", "panel-experts.png"):
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
