"""The dashboard of real `cgad-node join` daemons, in a real headless browser (Debian's chromium,
driven through its command line): the page of a three-node swarm loads, shows every live peer and
the contribution table (each peer credited by what the others signed they applied), draws the
floor a file names beside its loss, its loss chart gains points as the node trains, and the
browser logs no error. A screenshot is saved."""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _daemons import FRESH_LOSS, NodeProcess  # tests/ is on sys.path under pytest

from cgad.node.daemon.dashboard import FloorFile

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


def _credited(status: dict) -> bool:
    """Every live peer credited by the others, and every other peer's own count in."""
    return len(status["swarm"]) == 3 and all(
        p["applied_by_others"] >= 1 and (p["this_node"] or p["published"] >= 1) for p in status["swarm"]
    )


@pytest.mark.timeout(600)
def test_the_dashboard_shows_the_swarm_and_its_loss_in_a_browser(daemons):
    workdir, started = daemons
    # the floor the page draws beside a's loss: a lone node's held-out loss, as `demo` writes it
    floor = workdir / "floor.json"
    floor.write_text(json.dumps({"points": [[r, 20.0 * r, 8.3 - 0.1 * r] for r in range(5)]}))
    # b and c start with a and join it once it is up, side by side (neither needs the other)
    first = NodeProcess("a", workdir, [], ["--dashboard-floor", str(floor)], wait=False)
    started.append(first)
    second, third = (NodeProcess(name, workdir, [], after=[first], wait=False) for name in "bc")
    started += [second, third]
    others = {second.status()["peer_id"], third.status()["peer_id"]}
    first.wait(
        lambda s: others <= set(s["applied_by_peer"]) and len(s["eval_history"]) >= 3, "b's and c's fragments"
    )

    url = first.dashboard
    assert url.startswith("http://127.0.0.1:")
    # what b and c signed they applied, and their counts of published fragments, come with their
    # next progress records, which can reach a after their fragments did: eventually, not at once
    deadline = time.monotonic() + 90
    while True:
        code, body = get(url + "api/status")
        assert code == 200
        status = json.loads(body)
        rows = {p["peer_id"]: p for p in status["swarm"]}
        assert others <= set(rows) and all(rows[o]["applied"] >= 1 for o in others)
        if _credited(status) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert _credited(status), status["swarm"]
    me = first.status()["peer_id"]
    assert (
        set(rows) == others | {me} and rows[me]["this_node"] and not any(rows[o]["this_node"] for o in others)
    )
    # a's credit is what b and c signed; b's includes what a signed, which a's own status states
    assert rows[me]["credited_by"] == 2
    # signed counts lag what b and c have applied by now, never run ahead of it
    signed_for_me = [
        second.status()["applied_by_peer"].get(me, 0),
        third.status()["applied_by_peer"].get(me, 0),
    ]
    assert 1 <= rows[me]["applied_by_others"] <= sum(signed_for_me)
    assert all(rows[o]["eval_loss"] is not None and rows[o]["eval_loss"] < FRESH_LOSS + 1 for o in others)
    assert status["floor"] == [[float(r), 20.0 * r, 8.3 - 0.1 * r] for r in range(5)]
    assert len(status["timeline"]) >= 2 and status["bytes_in"] > 0
    assert get(url)[0] == 200 and b"<title>cgad-node</title>" in get(url)[1]
    assert get(url + "etc/passwd")[0] == 404

    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium; `make setup` does it as root)")
    seen = browse(url, workdir / "profile", "--dump-dom")
    assert seen.returncode == 0, seen.stderr[-2000:]
    dom = seen.stdout
    for peer in others | {me}:
        assert f'data-peer="{peer}"' in dom, dom[:3000]
        credit = re.search(rf'data-credit-peer="{peer}" data-credit="(\d+)"', dom)
        assert credit and int(credit.group(1)) >= 1, dom[:3000]
    points = int(re.search(r'id="by-round" data-points="(\d+)"', dom).group(1))
    assert points >= 3 + 5  # its evaluations, and the floor's 5 points
    assert 'data-floor-points="5"' in dom
    assert "held-out (claimed)" in dom  # a peer's loss is its own word
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


def test_a_floor_file_is_read_when_it_changes_and_anything_wrong_reads_as_no_floor(tmp_path):
    path = tmp_path / "floor.json"
    floor = FloorFile(str(path))
    assert floor.points() is None  # not there yet
    path.write_text(json.dumps({"points": [[1, 30.0, 5.0], [0, 0.0, 8.25]]}))
    assert floor.points() == [[0.0, 0.0, 8.25], [1.0, 30.0, 5.0]]
    for wrong in (
        "not json",
        json.dumps([[0, 0, 1]]),
        json.dumps({"points": [[0, 0]]}),
        json.dumps({"points": [[0, 0, "8"]]}),
        json.dumps({"points": [[0, 0, True]]}),
        '{"points": [[0, 0, NaN]]}',
        json.dumps({"points": [[0, 0, 1.0]] * 20_001}),
        " " * (1 << 20) + json.dumps({"points": []}),  # over the size read
    ):
        path.write_text(wrong)
        assert floor.points() is None, wrong[:40]
    assert FloorFile(None).points() is None
