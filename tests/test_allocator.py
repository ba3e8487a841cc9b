"""The daemon's allocator setting (node/daemon/allocator.py): a model's flat buffers freed after
glibc's threshold has moved stay in the process without it, and go back with it."""

import os
import subprocess
import sys

import pytest

PROBE = """
import re, sys
import torch
if sys.argv[1] == "fixed":
    from cgad.node.daemon.allocator import give_back_freed_memory
    assert give_back_freed_memory()
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
big = torch.ones(30 << 18)  # 30 MiB, mapped and freed: glibc's threshold moves up to it
del big
base = rss()
held = [torch.ones(5 << 20) for _ in range(20)]  # 20 buffers of 20 MiB, as a model's fragments
live = torch.ones(1 << 10)  # something allocated after them and still in use
del held
print((rss() - base) / 2**20)
"""


def _retained_mib(mode: str, env: dict[str, str] | None = None) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_model_sized_buffers_go_back_with_the_daemons_setting_and_stay_without():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    # of 400 MiB freed, glibc keeps 40 to 400 MiB run to run (how many buffers it put on the heap)
    assert _retained_mib("moving", env) > 30
    assert _retained_mib("fixed", env) < 20


def test_a_users_own_glibc_setting_is_left_alone(monkeypatch):
    from cgad.node.daemon.allocator import give_back_freed_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert give_back_freed_memory() is False
