"""Loading the agent into a running process: `dbr attach PID`.

The ptrace is done here, in the caller's own process, with the caller's privileges:
the kernel's ptrace access checks and Yama decide, never the root service
(docs/decisions/0033-attach.md).  One thread of the target is stopped
(PTRACE_SEIZE + PTRACE_INTERRUPT); its registers are saved; it is made to call the
loader's ``dlopen(agent, RTLD_NOW)`` with a return address of 0, so that the call ends
in a SIGSEGV at 0 that is caught here; then the agent's ``dbr_agent_activate(dir)``
the same way; every register is put back and the thread detached.  The other threads
run on throughout.  x86-64 only.

Every refusal is an :class:`AttachError` whose message says what is missing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass, field

from dbr_service.common.procmaps import MapEntry, mapped_file, read_maps
from dbr_service.common.symbols import dynamic_functions

PTRACE_CONT, PTRACE_DETACH = 7, 17
PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
RTLD_NOW = 2
AGENT_NAME = "libdbr_agent.so"
#: Below the stack pointer: the red zone (128 bytes) and a margin.
STACK_GAP = 512
STOP_WAIT_S = 3.0
CALL_WAIT_S = 10.0
#: Blocking calls at the top of a thread's work (an event loop, a sleep, a read): a
#: thread stopped in one is outside malloc and the loader, whose locks dlopen takes.
QUIET_SYSCALLS = {0, 7, 23, 34, 35, 43, 45, 47, 61, 128, 130, 230, 232, 270, 271, 281, 288}
SYS_FUTEX = 202
ACTIVATE_ERRORS = {
    -1: "the runtime directory is too long or not absolute",
    -2: "the agent has no thread (it could not be made when it was loaded)",
    -3: "the agent is inert there (DBR_AGENT_DISABLE=1, or a seccomp filter in force)",
    -4: "the agent stepped aside there (unshare, setns or seccomp): it serves no more",
}


class AttachError(Exception):
    """A refusal or failure, with a message for the user."""


class Regs(ctypes.Structure):
    """struct user_regs_struct (x86-64)."""
    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags "
        "rsp ss fs_base gs_base ds es fs gs").split()]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(req: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p = 0) -> None:
    if _libc.ptrace(req, tid, ctypes.c_void_p(addr), data if not isinstance(data, int)
                    else ctypes.c_void_p(data)) == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


# ------------------------------------------------------------------ what is asked
@dataclass
class Target:
    pid: int
    name: str
    maps: list[MapEntry] = field(default_factory=list)
    agent: MapEntry | None = None          # the agent's mapping, if it is loaded already


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read(1 << 16)
    except FileNotFoundError:
        raise AttachError(f"no process {pid} (ESRCH)") from None
    except OSError as exc:
        raise AttachError(f"cannot read /proc/{pid}/status: {exc.strerror}") from None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def yama_scope() -> int | None:
    """/proc/sys/kernel/yama/ptrace_scope, None without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _has_cap_sys_ptrace() -> bool:
    caps = _status(os.getpid()).get("CapEff", "0")
    return bool(int(caps, 16) >> 19 & 1)


def _user(uid: int) -> str:
    import pwd
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read(64).strip()
    except OSError:
        return "?"


def _yama_message(pid: int, scope: int | None) -> str:
    if scope == 1:
        return (f"Yama's ptrace_scope is 1: only a parent may trace pid {pid}, or a "
                "process with CAP_SYS_PTRACE (run dbr attach as root), or one the target "
                "named with prctl(PR_SET_PTRACER)")
    if scope == 2:
        return ("Yama's ptrace_scope is 2: only a process with CAP_SYS_PTRACE may use "
                "ptrace (run dbr attach as root)")
    if scope == 3:
        return "Yama's ptrace_scope is 3: ptrace is disabled on this host until it reboots"
    return f"the kernel refused to let this process trace pid {pid} (EPERM)"


def check_target(pid: int) -> Target:
    """Everything that can be refused before ptrace; AttachError says what."""
    st = _status(pid)
    name = st.get("Name", "?")
    if st.get("State", "").startswith(("Z", "X")):
        raise AttachError(f"pid {pid} ({name}) is a zombie: it has ended and runs no code")
    me = os.geteuid()
    uids = [int(x) for x in st.get("Uid", "").split()[:3]] or [-1]
    cap = _has_cap_sys_ptrace()
    if not cap and any(u != me for u in uids):
        other = next(u for u in uids if u != me)
        raise AttachError(f"pid {pid} ({name}) runs as uid {_user(other)}, you are uid "
                          f"{_user(me)}: only its owner or root (CAP_SYS_PTRACE) may attach")
    gids = [int(x) for x in st.get("Gid", "").split()[:3]] or [-1]
    if not cap and any(g != os.getegid() for g in gids):
        other = next(g for g in gids if g != os.getegid())
        raise AttachError(f"pid {pid} ({name}) runs with gid {other}, you with gid "
                          f"{os.getegid()} (a set-group-ID program?): only root "
                          "(CAP_SYS_PTRACE) may attach")
    tracer = int(st.get("TracerPid", "0") or 0)
    if tracer:
        raise AttachError(f"pid {pid} ({name}) is already traced by pid {tracer} "
                          f"({_comm(tracer)}): a process has one tracer; detach that first")
    scope = yama_scope()
    if scope == 3 or (scope == 2 and not cap):
        raise AttachError(_yama_message(pid, scope))
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/mnt"), os.stat("/proc/self/ns/mnt")
    except PermissionError:
        # the owner's own process, yet its /proc entries are closed: not dumpable
        raise AttachError(f"pid {pid} ({name}) is not dumpable (it called "
                          "prctl(PR_SET_DUMPABLE, 0), or it runs a set-user-ID or file-"
                          "capability program): only root (CAP_SYS_PTRACE) may attach") from None
    except OSError as exc:
        raise AttachError(f"cannot see pid {pid}'s mount namespace: {exc.strerror}") from None
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
        raise AttachError(f"pid {pid} ({name}) is in another mount namespace (a container?): "
                          "the agent's path would name another file there; run dbr attach "
                          "inside its namespace")
    _check_elf(pid, name)
    try:
        maps = read_maps(pid)
    except Exception as exc:   # MemoryViewError
        raise AttachError(str(exc)) from None
    agent = next((m for m in maps if os.path.basename(m.path) == AGENT_NAME), None)
    if not any(os.path.basename(m.path).startswith(("ld-linux", "ld-musl")) for m in maps):
        raise AttachError(f"pid {pid} ({name}) has no dynamic loader mapped (a statically "
                          "linked program): there is no dlopen to load the agent with")
    return Target(pid, name, maps, agent)


def _check_elf(pid: int, name: str) -> None:
    try:
        with open(f"/proc/{pid}/exe", "rb") as f:
            head = f.read(20)
    except OSError as exc:
        raise AttachError(f"cannot read pid {pid}'s executable: {exc.strerror}") from None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise AttachError(f"pid {pid} ({name}) does not run an ELF executable")
    if head[4] != 2 or int.from_bytes(head[18:20], "little") != 62:
        raise AttachError(f"pid {pid} ({name}) is not an x86-64 process (a 32-bit one?): "
                          "the agent is x86-64 only")


def _symbol(maps: list[MapEntry], want: str, names: tuple[str, ...]) -> int | None:
    """Run-time address of function ``want`` in the first mapped object whose file name
    starts with one of ``names``, from that file's .dynsym."""
    seen = set()
    for m in maps:
        base = os.path.basename(m.path)
        if not base.startswith(names) or m.path in seen or m.offset != 0:
            continue
        seen.add(m.path)
        try:
            if mapped_file(m.path, m.dev, m.ino) is None:
                continue
            syms, first = dynamic_functions(m.path, {want})
        except OSError:
            continue
        if want in syms:
            return m.lo - first + syms[want]
    return None


def pick_thread(pid: int) -> int:
    """A thread blocked in an event loop, sleep or read if there is one, else one
    blocked in another call but a futex, else the main thread."""
    ranked = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return pid
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                first = f.read(256).split()[0]
        except (OSError, IndexError):
            continue
        nr = int(first) if first.lstrip("-").isdigit() else -1
        rank = 0 if nr in QUIET_SYSCALLS else 1 if nr >= 0 and nr != SYS_FUTEX else 2
        ranked.append((rank, tid != pid, tid))
    return min(ranked)[2] if ranked and min(ranked)[0] < 2 else pid


# ------------------------------------------------------------------ the injection
class Injector:
    """One thread of ``pid``, stopped and traced for as long as the ``with`` lasts; on
    leaving, its registers are restored and it is detached (a signal caught at the
    first stop is handed back)."""

    def __init__(self, pid: int, tid: int) -> None:
        self.pid, self.tid = pid, tid
        self.saved = Regs()
        self.pending = 0
        self.mem = -1
        self.attached = False

    #: Held off while a thread is traced: this process ending mid-call would let the
    #: thread run on into its return address 0 (SIGKILL cannot be held off).
    HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}

    def __enter__(self) -> Injector:
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.HELD_SIGNALS)
        try:
            _ptrace(PTRACE_SEIZE, self.tid)
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            raise AttachError(self._seize_error(exc)) from None
        self.attached = True
        try:
            _ptrace(PTRACE_INTERRUPT, self.tid)
            status = self._wait(STOP_WAIT_S)
            if status is None:
                raise AttachError(f"thread {self.tid} of pid {self.pid} did not stop within "
                                  f"{STOP_WAIT_S:.0f} s (uninterruptible sleep?); left as it was")
            if os.WSTOPSIG(status) != signal.SIGTRAP or status >> 16 != PTRACE_EVENT_STOP:
                self.pending = os.WSTOPSIG(status)   # a signal on its way: given back at the end
            _ptrace(PTRACE_GETREGS, self.tid, 0, ctypes.byref(self.saved))
            self.mem = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except BaseException:
            self._release(restore=False)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._release(restore=True)

    def _seize_error(self, exc: OSError) -> str:
        import errno
        if exc.errno == errno.ESRCH:
            return f"no process {self.pid} (ESRCH): it ended"
        if exc.errno == errno.EPERM:
            tracer = _status(self.pid).get("TracerPid", "0")
            if tracer not in ("", "0"):
                return f"pid {self.pid} is already traced by pid {tracer} ({_comm(int(tracer))})"
            return _yama_message(self.pid, yama_scope()) + (
                " (or the process is not dumpable: a set-user-ID program, "
                "prctl(PR_SET_DUMPABLE, 0))")
        return f"ptrace of pid {self.pid} failed: {exc.strerror}"

    def _wait(self, timeout: float) -> int | None:
        """The thread's next status (stops included), None after ``timeout``."""
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError:
                raise AttachError(f"pid {self.pid} ended while attached") from None
            if got:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    self.attached = False
                    raise AttachError(f"pid {self.pid} ended while attached")
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _release(self, restore: bool) -> None:
        if self.mem >= 0:
            os.close(self.mem)
            self.mem = -1
        if self.attached:
            try:
                if restore:
                    _ptrace(PTRACE_SETREGS, self.tid, 0, ctypes.byref(self.saved))
                _ptrace(PTRACE_DETACH, self.tid, 0, self.pending)
            except OSError:
                pass   # gone, or never stopped: the kernel detaches it when this process ends
            self.attached = False
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)

    def call(self, fn: int, args: tuple[int, ...] = (), data: bytes = b"") -> tuple[int, int]:
        """Run ``fn(*args)`` on the stopped thread; ``data`` is copied below its stack
        and an argument of -1 stands for its address.  (rax, data address)."""
        regs = Regs.from_buffer_copy(self.saved)
        at = (self.saved.rsp - STACK_GAP - len(data)) & ~15
        sp = ((at - 64) & ~15) - 8      # as after a call: rsp % 16 == 8 at entry
        if data:
            os.pwrite(self.mem, data, at)
        os.pwrite(self.mem, bytes(8), sp)   # return address 0: the call ends in SIGSEGV
        vals = [at if a == -1 else a for a in args]
        for reg, v in zip(("rdi", "rsi", "rdx", "rcx"), vals):
            setattr(regs, reg, v & (2**64 - 1))
        regs.rip, regs.rsp, regs.rax = fn, sp, 0
        regs.orig_rax = 2**64 - 1         # no system call restart into the call
        regs.eflags &= ~0x500             # DF and TF clear, as the ABI has them at a call
        _ptrace(PTRACE_SETREGS, self.tid, 0, ctypes.byref(regs))
        _ptrace(PTRACE_CONT, self.tid)
        deadline = time.monotonic() + CALL_WAIT_S
        while True:
            status = self._wait(max(0.0, deadline - time.monotonic()))
            if status is None:
                self._interrupt()
                raise AttachError(
                    f"the call at {fn:#x} in pid {self.pid} did not return within "
                    f"{CALL_WAIT_S:.0f} s; the thread was put back where it was stopped (if "
                    "it was stopped holding the loader's or malloc's lock, the program may "
                    "now wait for it)")
            sig = os.WSTOPSIG(status)
            if sig == signal.SIGSEGV and status >> 16 == 0:
                got = Regs()
                _ptrace(PTRACE_GETREGS, self.tid, 0, ctypes.byref(got))
                if got.rip == 0:
                    return got.rax, at
                raise AttachError(f"the call at {fn:#x} in pid {self.pid} faulted at "
                                  f"{got.rip:#x}; the thread was put back where it was stopped")
            # a ptrace event stop (our interrupt, a group stop) resumes; a signal for the
            # thread is delivered to it as it would have been
            _ptrace(PTRACE_CONT, self.tid, 0, 0 if status >> 16 else sig)

    def _interrupt(self) -> None:
        try:
            _ptrace(PTRACE_INTERRUPT, self.tid)
            self._wait(STOP_WAIT_S)
        except OSError:
            pass

    def read_string(self, addr: int, limit: int = 1024) -> str:
        try:
            raw = os.pread(self.mem, limit, addr)
        except OSError:
            return "?"
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


@dataclass
class Attached:
    pid: int
    tid: int
    loaded: bool          # dlopen'ed now (else the agent was there and is woken again)


def attach(pid: int, agent: str, runtime_dir: str) -> Attached:
    """Load the agent into ``pid`` (if it is not there) and activate it with
    ``runtime_dir``; AttachError says why not."""
    t = check_target(pid)
    activate_in_file = None
    if t.agent is not None:
        where = t.agent.path
    else:
        where = agent
        if _symbol(t.maps, "dlopen", ("libc.so", "libdl.so", "ld-musl")) is None:
            raise AttachError(f"pid {pid} ({t.name}) has no dlopen in its libc or libdl: it "
                              "cannot load the agent")
    try:
        syms, first = dynamic_functions(where, {"dbr_agent_activate"})
    except OSError as exc:
        raise AttachError(f"cannot read the agent {where}: {exc.strerror}") from None
    activate_in_file = syms.get("dbr_agent_activate")
    if activate_in_file is None:
        raise AttachError(f"{where} has no dbr_agent_activate: not an agent that can attach")
    tid = pick_thread(pid)
    with Injector(pid, tid) as inj:
        loaded = False
        if t.agent is None:
            dlopen = _symbol(t.maps, "dlopen", ("libc.so", "libdl.so", "ld-musl"))
            handle, _ = inj.call(dlopen or 0, (-1, RTLD_NOW), agent.encode() + b"\0")
            if handle == 0:
                dlerror = _symbol(t.maps, "dlerror", ("libc.so", "libdl.so", "ld-musl"))
                msg, _ = inj.call(dlerror or 0) if dlerror else (0, 0)
                raise AttachError(f"dlopen of {agent} failed in pid {pid}: "
                                  f"{inj.read_string(msg) if msg else 'no dlerror'}")
            loaded = True
            maps = read_maps(pid)
        else:
            maps = t.maps
        mine = next((m for m in maps if os.path.basename(m.path) == AGENT_NAME
                     and m.offset == 0), None)
        if mine is None:
            raise AttachError(f"the agent is not mapped in pid {pid} after dlopen")
        rc, _ = inj.call(mine.lo - first + activate_in_file, (-1,),
                         runtime_dir.encode() + b"\0")
    rc = ctypes.c_int32(rc & 0xFFFFFFFF).value
    if rc == 1:
        raise AttachError(f"pid {pid} ({t.name}) carries an active agent already (it is "
                          "served, or waits for a service): nothing to do")
    if rc < 0:
        raise AttachError(f"the agent in pid {pid} refused to start: "
                          f"{ACTIVATE_ERRORS.get(rc, f'error {rc}')}")
    return Attached(pid, tid, loaded)
