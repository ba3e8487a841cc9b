"""The dashboard of real `cgad-node join` daemons, in a real headless browser (Debian's chromium,
driven through its command line): the page loads, shows the other peer, its loss chart has points
and gains more as the node trains, and the browser logs no error. A screenshot is saved."""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _daemons import NodeProcess  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# a headless browser on a machine without internet: no background traffic, no first-run UI
HEADLESS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0", "--window-size=1280,1500",
]  # fmt: skip


def browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    """Load ``url`` headless, let its scripts run for 6 s of page time, then do ``extra``."""
    command = [CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", "--virtual-time-budget=6000", *extra, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if "CONSOLE" in line and re.search(r"error|uncaught", line, re.I)
    ]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.timeout(600)
def test_the_dashboard_shows_the_swarm_and_its_loss_in_a_browser(daemons):
    workdir, started = daemons
    first = NodeProcess("a", workdir, [])
    started.append(first)
    second = NodeProcess("b", workdir, first.maddrs())
    started.append(second)
    other = second.status()["peer_id"]
    first.wait(
        lambda s: other in s["applied_by_peer"] and len(s["eval_history"]) >= 3, "b's fragments, 3 evals"
    )

    url = first.dashboard
    assert url.startswith("http://127.0.0.1:")
    # b's count of published fragments comes with its next progress record, which can reach a
    # after b's first fragment did: the count is eventually right, not at once
    deadline = time.monotonic() + 60
    while True:
        code, body = get(url + "api/status")
        assert code == 200
        status = json.loads(body)
        assert [p["peer_id"] for p in status["swarm"]] == [other] and status["swarm"][0]["applied"] >= 1
        if status["swarm"][0]["published"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert status["swarm"][0]["published"] >= 1  # its own count, from its progress record
    assert len(status["timeline"]) >= 2 and status["bytes_in"] > 0
    assert get(url)[0] == 200 and b"<title>cgad-node</title>" in get(url)[1]
    assert get(url + "etc/passwd")[0] == 404

    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; `make setup` does it as root)")
    seen = browse(url, workdir / "profile", "--dump-dom")
    assert seen.returncode == 0, seen.stderr[-2000:]
    dom = seen.stdout
    assert f'data-peer="{other}"' in dom, dom[:3000]
    points = int(re.search(r'id="by-round" data-points="(\d+)"', dom).group(1))
    assert points >= 3
    assert not console_errors(seen.stderr), console_errors(seen.stderr)

    # the node trains on: a later look draws more points
    rounds = first.status()["round"]
    first.wait(lambda s: s["round"] >= rounds + 2, "two more rounds")
    later = browse(url, workdir / "profile", "--dump-dom")
    later_points = int(re.search(r'id="by-round" data-points="(\d+)"', later.stdout).group(1))
    assert later_points > points

    shot = workdir / "dashboard.png"
    taken = browse(url, workdir / "profile", f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.stat().st_size > 20_000, taken.stderr[-2000:]
    print(f"screenshot: {shot}")

    # a page whose node cannot be reached (it left) says so instead of showing old numbers as live
    orphan = workdir / "orphan.html"
    orphan.write_bytes(get(url)[1])
    gone = browse(orphan.as_uri(), workdir / "profile", "--dump-dom")
    assert "cannot reach this node" in gone.stdout and 'class="badge stale"' in gone.stdout
