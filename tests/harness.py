"""A small fake service for agent tests: accepts the agent, hands it code buffers,
writes hand-assembled replacement code (keystone), drives PATCH/UNPATCH.

It is built on dbr_service.wire.agentconn, the same session code the real service uses.
Also: compiling test programs (cached per test session), reading client memory,
and a line reader with timeouts for client stdout.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import capstone
import keystone

import pytest

import dbr_agent
from dbr_service.wire import protocol as P
from dbr_service.wire.agentconn import (AgentConnection, CodeBufferHandle, jmp_rel32, listen,
                                        make_site)
from dbr_service.codegen.cfi import Fde, Glue

TESTS = Path(__file__).resolve().parent
PROGS = TESTS / "agent_progs"
_BUILD_DIR = Path(tempfile.gettempdir()) / f"dbr-test-build-{os.getuid()}"

SITE_INSN = bytes.fromhex("69c7e8030000")  # imul eax, edi, 1000 (6 bytes)
SITE_LEN = len(SITE_INSN)


def compile_c(sources: Iterable[str | Path], *, flags: Iterable[str] = (),
              out_name: str | None = None, shared: bool = False, cc: str = "gcc",
              link: Iterable[str | Path] = ()) -> Path:
    """Compile C sources (relative names are under tests/agent_progs); cached by content.
    ``link``: libraries, placed after the sources (the linker drops a shared library
    named before the objects that need it when --as-needed is the default)."""
    srcs = [Path(s) if Path(s).is_absolute() else PROGS / s for s in sources]
    flags = list(flags)
    h = hashlib.sha256()
    for s in srcs:
        h.update(s.read_bytes())
    for inc in PROGS.glob("*.h"):
        h.update(inc.read_bytes())
    link = [str(x) for x in link]
    h.update(repr((flags, shared, cc, link)).encode())
    _BUILD_DIR.mkdir(parents=True, exist_ok=True)
    name = out_name or srcs[0].stem
    out = _BUILD_DIR / f"{name}-{h.hexdigest()[:12]}{'.so' if shared else ''}"
    if not out.exists():
        cmd = [cc, "-O2", "-g", "-pthread", f"-I{PROGS}", *flags]
        if shared:
            cmd += ["-shared", "-fPIC"]
        tmp = out.with_suffix(out.suffix + f".tmp{os.getpid()}")
        subprocess.run([*cmd, "-o", str(tmp), *map(str, srcs), *link, "-ldl"], check=True)
        os.replace(tmp, out)
    return out


def assemble(asm: str, addr: int) -> bytes:
    """Assemble Intel-syntax ``asm`` for address ``addr`` with keystone."""
    ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
    enc, _ = ks.asm(asm, addr)
    return bytes(enc)


def read_mem(pid: int, addr: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return f.read(n)


class LineReader:
    """Reads a pipe line by line on a thread; ``expect`` waits (bounded) for a match."""

    def __init__(self, stream) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.q.put(raw.decode(errors="replace").rstrip("\n"))
        self.q.put(None)

    def expect(self, prefix: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line starting with {prefix!r} within {timeout}s; "
                                   f"last lines: {self.lines[-5:]}")
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise EOFError(f"stream ended before {prefix!r}; lines: {self.lines[-5:]}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def rest(self, timeout: float = 10.0) -> list[str]:
        """Every remaining line until EOF (bounded)."""
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                continue
            if line is None:
                return out
            self.lines.append(line)
            out.append(line)
        raise TimeoutError("stream did not end")


class Client:
    """A client process started with the agent preloaded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.out = LineReader(proc.stdout)
        self.err = LineReader(proc.stderr)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 20.0) -> tuple[int, list[str]]:
        """Close stdin and wait (bounded) for exit: (returncode, remaining stdout lines)."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        rest = self.out.rest(timeout)
        return self.proc.wait(timeout), rest

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class FakeService:
    """Accepts agents on a private runtime dir and drives them by hand."""

    def __init__(self, *, on_disconnect: int = P.DISCONNECT_KEEP, map_wait_ms: int = 300,
                 runtime_dir: str | None = None, listening: bool = True) -> None:
        """``runtime_dir``: serve an existing directory (another process's clients),
        which close() then leaves in place; ``listening=False``: no socket until
        start_listening() (agents meanwhile find nobody and retry)."""
        self._own_dir = runtime_dir is None
        self.runtime_dir = runtime_dir or tempfile.mkdtemp(prefix="dbr-rt-")
        self.sock_path = os.path.join(self.runtime_dir, "agent.sock")
        self.listener: socket.socket | None = None
        if listening:
            self.start_listening()
        self.on_disconnect = on_disconnect
        self.map_wait_ms = map_wait_ms
        self.clients: list[Client] = []
        self.conns: list[AgentConnection] = []
        self._session = 0

    def start_listening(self) -> None:
        """Bind the agent socket (replacing a stale file, e.g. a killed service's)."""
        self.listener = listen(self.sock_path)

    def stop_listening(self) -> None:
        """Close and remove the agent socket: agents find nobody and stay dormant."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["DBR_RUNTIME_DIR"] = self.runtime_dir
        env["LD_PRELOAD"] = dbr_agent.agent_path()
        env.update(extra or {})
        return env

    def spawn(self, argv: list[str], env: dict[str, str] | None = None,
              preexec: Callable[[], None] | None = None) -> Client:
        """``preexec``: run in the child before it execs (what a prefix command such as
        chrt would do, without a process of its own that loads the agent)."""
        proc = subprocess.Popen([str(a) for a in argv], env=self.env(env), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec)
        c = Client(proc)
        self.clients.append(c)
        return c

    def accept(self, timeout: float = 10.0, pid: int | None = None,
               handshake: bool = True) -> AgentConnection:
        """Accept the next agent (optionally: the one of ``pid``) and do the handshake
        (``handshake=False``: leave HELLO unread and unanswered)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no agent connected within {timeout}s")
            self.listener.settimeout(left)
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            conn = AgentConnection(sock)
            if pid is not None and conn.peer_pid != pid:
                conn.close()
                continue
            if not handshake:
                self.conns.append(conn)
                return conn
            self._session += 1
            conn.handshake(service_pid=os.getpid(), session_id=self._session,
                           on_disconnect=self.on_disconnect, map_wait_ms=self.map_wait_ms,
                           timeout=max(0.5, deadline - time.monotonic()))
            self.conns.append(conn)
            return conn

    def close(self) -> None:
        for c in self.clients:
            c.kill()
        for conn in self.conns:
            conn.close()
        if self.listener is not None:
            self.listener.close()
        if self._own_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def exit_stub(buf: CodeBufferHandle, at: int, site: int, first_insn: bytes = SITE_INSN) -> int:
    """Write replacement code equivalent to the original: the (position-independent)
    first instruction, then ``jmp`` back to the instruction after it.  Returns ``at``."""
    code = first_insn + jmp_rel32(at + len(first_insn), site + len(first_insn))
    buf.write(at, code)
    return at


def parse_sites(line: str) -> list[int]:
    """'sites 0x.. 0x..' -> addresses."""
    return [int(w, 16) for w in line.split()[1:]]


def patch_sites(conn: AgentConnection, pid: int, targets: dict[int, int],
                variant: int = P.Variant.INT3) -> list[P.PatchSite]:
    """PatchSite records for site -> target, with the original bytes read from the client."""
    return [make_site(s, t, read_mem(pid, s, P.PATCH_LEN), variant) for s, t in targets.items()]


def count_executions(pid: int, addr: int, seconds: float) -> int:
    """How often the threads of ``pid`` (those alive now) execute the instruction at
    ``addr`` during ``seconds``: a hardware execute breakpoint per thread, counting
    (perf_event_open, PERF_TYPE_BREAKPOINT).  Exact where sampling may never land on
    a few short instructions."""
    from dbr_service.sampling.perf import PerfEventAttr, list_tids, perf_event_open

    fds = []
    try:
        for tid in list_tids(pid):
            attr = PerfEventAttr()
            attr.type = 5                       # PERF_TYPE_BREAKPOINT
            attr.size = ctypes.sizeof(attr)
            attr.bp_type = 4                    # HW_BREAKPOINT_X
            attr.config1 = addr                 # bp_addr
            attr.config2 = 8                    # bp_len: sizeof(long) for execute
            attr.exclude_kernel = attr.exclude_hv = 1
            try:
                fds.append(perf_event_open(attr, tid))
            except ProcessLookupError:
                continue                        # the thread ended meanwhile
        time.sleep(seconds)
        return sum(struct.unpack("<Q", os.read(fd, 8))[0] for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


def terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


__all__ = ["FakeService", "Client", "compile_c", "assemble", "read_mem", "exit_stub",
           "parse_sites", "patch_sites", "jmp_rel32", "make_site", "SITE_INSN", "SITE_LEN",
           "terminate", "symbols", "relocate_copy", "FakeGen", "stub_gen"]


# --------------------------------------------------------------------------- shared
# by several test modules: symbols of a binary, a copied function's bytes, fake codegen
# output for the installer.

_CS = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_CS.detail = True


def symbols(path) -> dict[str, tuple[int, int]]:
    out = subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    syms = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 4 and f[2] in "tTwW":
            syms[f[3]] = (int(f[0], 16), int(f[0], 16) + int(f[1], 16))
    return syms


def relocate_copy(f: Fde, layout, bias: int) -> bytes:
    """The copy's bytes for ``layout`` (pieces and 5-byte glue jumps): rel32 branches
    and rip-relative operands re-aimed (targets in a copied piece go to the copy)."""
    code = f.image.cursor(f.start).bytes(f.end - f.start)
    pieces = [it for it in layout if not isinstance(it, Glue)]

    def new_of(o: int) -> int:
        for lo, hi, ol in pieces:
            if ol <= o < ol + hi - lo:
                return lo + o - ol
        return o + bias

    base = min(it[0] for it in layout)
    out = bytearray(max(it[1] for it in layout) - base)
    for it in layout:
        lo, hi, o = it
        if isinstance(it, Glue):
            out[lo - base:hi - base] = b"\xe9" + struct.pack("<i", new_of(o) - hi)
            continue
        for insn in _CS.disasm(code[o - f.start:o - f.start + hi - lo], o):
            b = bytearray(insn.bytes)
            at = lo + insn.address - o
            end = at + insn.size
            if capstone.CS_GRP_BRANCH_RELATIVE in insn.groups:
                target = new_of(insn.operands[0].imm)
                if insn.imm_size == 4:
                    b[insn.imm_offset:insn.imm_offset + 4] = struct.pack("<i", target - end)
                else:                              # rel8: only within its piece
                    assert target - end == insn.operands[0].imm - insn.address - insn.size
            elif insn.disp_size == 4 and "rip" in insn.op_str:
                target = insn.address + insn.size + insn.disp + bias
                b[insn.disp_offset:insn.disp_offset + 4] = struct.pack("<i", target - end)
            out[at - base:end - base] = b
    return bytes(out)


@dataclass
class FakeGen:
    """Codegen output for 'relocated first instruction + exit' stubs."""

    code: bytes
    base: int
    entries: dict[int, int]
    addr_map: list[tuple[int, int, int]] = field(default_factory=list)
    exits: list[tuple[int, int]] = field(default_factory=list)
    transfers: dict[int, int] = field(default_factory=dict)
    evictions: dict[int, int] = field(default_factory=dict)


def stub_gen(base: int, sites: list[int]) -> FakeGen:
    code = b""
    gen = FakeGen(b"", base, {})
    for s in sites:
        at = base + len(code)
        back = jmp_rel32(at + len(SITE_INSN), s + len(SITE_INSN))
        gen.entries[s] = at
        gen.addr_map += [(at, at + 6, s), (at + 6, at + 11, s + 6)]
        gen.exits.append((at + 6, s + 6))
        code += SITE_INSN + back
        code += b"\xcc" * (-len(code) % 16)
    gen.code = code
    return gen


# Kept while tests/agent/test_agent_entry_sites.py imports it; the ``svc`` fixture of every
# other module comes from conftest.py.
@pytest.fixture(name="svc")
def fake_service_fixture():
    """A FakeService for one test, closed (its clients killed) afterwards; import it
    into a test module to have the ``svc`` fixture there."""
    s = FakeService()
    yield s
    s.close()


def cfi_maps(pid: int):
    """/proc/PID/maps as CfiSource wants it: (lo, hi, path, (major, minor), inode)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            p = ln.split(None, 5)
            if len(p) == 6 and p[5].startswith("/"):
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                major, minor = (int(x, 16) for x in p[3].split(":"))
                out.append((lo, hi, p[5].rstrip("\n"), (major, minor), int(p[4])))
    return out
