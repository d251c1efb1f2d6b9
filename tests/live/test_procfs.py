"""dbr_service.common.procfs: a client whose main thread has ended stays readable.

After main() calls pthread_exit the thread-group leader is a zombie: /proc/PID/mem
cannot be opened and /proc/PID/maps reads empty, while the other threads still run
the program.  The service reads such a client through a live thread's
/proc/PID/task/TID (found by selection failing with ESRCH on /proc/PID/mem before).
"""

from __future__ import annotations

import subprocess
import time

import pytest

from dbr_service.common.procmaps import read_maps
from dbr_service.common.procfs import proc_dir, thread_state
from dbr_service.region.memview import LiveMemoryView
from harness import compile_c


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def orphaned_threads():
    """A process (no agent) whose main thread has ended while a worker runs on."""
    exe = compile_c(["mainexit.c"])
    proc = subprocess.Popen([str(exe), "1", "20000"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert _wait_for(lambda: thread_state(f"/proc/{proc.pid}/stat") == "Z")
        yield proc.pid, str(exe)
    finally:
        proc.kill()
        proc.wait(10)


def test_leader_gone_reads_through_a_live_thread(orphaned_threads):
    pid, exe = orphaned_threads
    with open(f"/proc/{pid}/maps") as f:
        assert f.read() == ""             # what the service read before
    d = proc_dir(pid)
    assert d.startswith(f"/proc/{pid}/task/") and int(d.rsplit("/", 1)[1]) != pid
    maps = read_maps(pid)
    head = [m for m in maps if m.path == exe and m.offset == 0]
    assert head and any(m.executable for m in maps if m.path == exe), [m.path for m in maps]
    view = LiveMemoryView(pid)
    try:
        assert view.read(head[0].lo, 4) == b"\x7fELF"
    finally:
        view.close()


def test_live_leader_is_proc_pid():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert proc_dir(proc.pid) == f"/proc/{proc.pid}"
    finally:
        proc.kill()
        proc.wait(10)
    assert proc_dir(proc.pid) == f"/proc/{proc.pid}"   # gone: the caller's usual errors


def test_thread_state_parses_comm_with_parentheses(tmp_path):
    stat = tmp_path / "stat"
    stat.write_bytes(b"123 (a) b) (c) S 1 2 3")
    assert thread_state(str(stat)) == "S"
    assert thread_state(str(tmp_path / "missing")) is None


def test_a_module_base_is_its_private_mappings_not_a_shared_one_of_the_same_file():
    """A process that maps one of its libraries' files shared (reading it as data) has
    that mapping below the library's own; the module's base is the loader's."""
    from dbr_service.common.procmaps import module_base, parse_maps

    maps = parse_maps(
        "7f0000029000-7f0000200000 r--s 00000000 fe:00 42 /usr/lib/libc.so.6\n"
        "7f1000000000-7f1000028000 r--p 00000000 fe:00 42 /usr/lib/libc.so.6\n"
        "7f1000028000-7f10001bd000 r-xp 00028000 fe:00 42 /usr/lib/libc.so.6\n")
    assert module_base(maps, "/usr/lib/libc.so.6") == 0x7f1000000000
    only_shared = maps[:1]
    assert module_base(only_shared, "/usr/lib/libc.so.6") == 0x7f0000029000
    assert module_base(maps, "/nothing") == 0
