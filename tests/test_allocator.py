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


HUGE_PROBE = """
import re, sys
from cgad.node.daemon.allocator import give_back_freed_memory, use_huge_pages
if sys.argv[1] == "huge":
    assert use_huge_pages()
import torch
assert give_back_freed_memory()
def huge_kib():
    return sum(int(k) for k in re.findall(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps").read()))
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
base = rss()
buffers = [torch.ones(16 << 20) for _ in range(4)]  # 4 x 64 MiB, touched: an outer step's buffers
print(huge_kib() >> 10)
del buffers
print((rss() - base) / 2**20)
"""


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="the kernel grants no transparent huge pages")
def test_huge_pages_back_the_daemons_large_buffers_and_still_go_back_when_freed():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE")}

    def probe(mode: str) -> tuple[float, float]:
        cmd = [sys.executable, "-c", HUGE_PROBE, mode]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120, env=env)
        huge, retained = done.stdout.split()[-2:]
        return float(huge), float(retained)

    huge, retained = probe("huge")
    assert huge >= 128, f"{huge} MiB of 256 in huge pages"  # khugepaged or the fault path may miss some
    assert retained < 20
    if _thp_mode() == "madvise":  # without asking, none (under "always" every process gets them)
        assert probe("plain")[0] < 16


def test_a_users_own_huge_page_setting_is_left_alone(monkeypatch):
    from cgad.node.daemon.allocator import use_huge_pages

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert use_huge_pages() is False
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
