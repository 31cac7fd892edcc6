"""Screenshots of the review page of a real lab (the README's docs/overview.png and docs/hypothesis.png).

    python docs/shoot.py runs/demo-lab docs/          # after `make run`: a lab with its runs

Starts `autoresearch serve` on the lab on a free loopback port with a token, opens the page in
headless chromium (Debian's `chromium` and `chromium-driver`), and saves the overview and the page
of the lab's last promoted hypothesis (or its last one). Nothing is written to the lab.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def main(lab: Path, out: Path) -> int:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(16)
    exe = Path(sys.executable).with_name("autoresearch")
    server = subprocess.Popen([str(exe), "--repo", str(lab), "serve", "--port", str(port), "--token", token],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{url}/?token={token}", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        opts = Options()
        opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1700",
                    "--disable-gpu"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
        try:
            driver.get(f"{url}/?token={token}")
            time.sleep(1.0)
            out.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(out / "overview.png"))
            status = subprocess.run([str(exe), "--repo", str(lab), "status", "--json"], capture_output=True,
                                    text=True, check=True).stdout

            hs = json.loads(status).get("hypotheses", [])
            promoted = [h for h in hs if h.get("decision") == "promote"] or hs
            if promoted:
                driver.get(f"{url}/hypotheses/{promoted[-1]['id']}")
                time.sleep(1.0)
                driver.save_screenshot(str(out / "hypothesis.png"))
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(10)
    print(f"wrote {out / 'overview.png'} and {out / 'hypothesis.png'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python docs/shoot.py LAB OUTDIR")
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
