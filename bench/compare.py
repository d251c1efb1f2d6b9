"""Where dbr stands against the alternatives, per workload (issue 6).

Configurations, side by side on every workload of ``bench/suite.py``:

* ``native``       the program as is (the baseline of every ratio);
* ``dbr``          ``dbr run --embedded`` with default settings;
* ``dbr-sampling`` ``dbr run --embedded`` with patching disabled (sampling only), when
                   the configuration has a key for that;
* ``perf``         ``perf record -F <dbr's sampling rate> -e cpu-clock`` (temp file,
                   deleted): the profiling anchor;
* ``valgrind``     ``valgrind --tool=none``: the floor cost of a DBI framework; its own
                   native/valgrind A/B pair, few runs (small inputs in quick mode);
* ``pgo``          C workloads only: the source rebuilt with -fprofile-generate, a
                   training run, -fprofile-use.

All the configurations of a workload run in alternation (round i starts at config i
mod k, so drift and periodic load hit every config alike) after one warm-up run of
each; we report medians, min/max and IQR, and ratios to native (median over median,
plus the range of per-round paired ratios).  Every run's stdout and output files are
hashed: a configuration whose output differs from native's is a FAILURE (loud, and
the benchmark exits non-zero), never a data point.  Results are written after every
workload, so a crash or an interrupt still leaves the partial JSON and table.

usage: python -m bench.compare [--quick] [--runs N] [--configs a,b] [WORKLOAD...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench import suite
from bench.common import Results, ratio_ci, spread, tree_cpu_s

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ one run

@dataclass
class Run:
    wall: float
    exit_code: int          # waitstatus_to_exitcode: negative = killed by that signal
    digest: str
    cpu_s: float            # user + sys of the process tree (wait4 rusage)
    maxrss_kb: int          # largest RSS of any process of the tree
    timed_out: bool = False
    stderr_tail: str = ""
    extra: dict = field(default_factory=dict)
    pid: int = 0
    hung: list = field(default_factory=list)  # on a timeout: what each thread was doing
    round: int = -1         # index of its recorded round in alternate()'s result (-1: none)


def digest_outputs(run_dir: Path, outputs: list[str]) -> str:
    h = hashlib.sha256()
    for name in ["stdout", *outputs]:
        p = run_dir / name
        h.update(name.encode() + b"\0")
        if p.exists():
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        else:
            h.update(b"\0MISSING\0")
    return h.hexdigest()


def run_once(argv: list[str], env: dict[str, str], run_dir: Path, outputs: list[str],
             timeout: float) -> Run:
    """One timed run in a fresh ``run_dir`` (its cwd; stdout goes to run_dir/stdout).
    Wall time from just before the spawn to the return of wait4; rusage from wait4
    covers the child and every descendant it waited for."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    res: dict[str, Any] = {}
    with open(run_dir / "stdout", "wb") as out, open(run_dir.parent / "stderr", "wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, env=env, cwd=run_dir, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=err, start_new_session=True)

        def waiter() -> None:
            _, status, ru = os.wait4(p.pid, 0)
            res.update(t=time.perf_counter(), status=status, ru=ru)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        try:
            th.join(timeout)
        except BaseException:  # interrupted (SIGINT/SIGTERM): take the run down with us
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            th.join(10)
            raise
        timed_out = th.is_alive()
        hung = session_threads(p.pid) if timed_out else []
        if timed_out:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session we created for it
            except ProcessLookupError:
                pass
            th.join(30)
    if "status" not in res:
        raise RuntimeError(f"could not reap {argv[0]} (pid {p.pid})")
    p.returncode = os.waitstatus_to_exitcode(res["status"])  # reaped: keep Popen from waiting
    ru = res["ru"]
    tail = (run_dir.parent / "stderr").read_bytes()[-2000:].decode(errors="replace")
    return Run(wall=res["t"] - t0, exit_code=p.returncode,
               digest=digest_outputs(run_dir, outputs), cpu_s=ru.ru_utime + ru.ru_stime,
               maxrss_kb=ru.ru_maxrss, timed_out=timed_out, stderr_tail=tail, pid=p.pid,
               hung=hung)


def session_threads(sid: int) -> list[dict]:
    """Every thread of the processes in session ``sid``, as /proc shows it: name,
    state, kernel wait channel and /proc/TID/syscall (the syscall it waits in, or
    "running", with its user stack pointer and pc) -- what a timed-out run was doing,
    recorded before it is killed."""
    out: list[dict] = []
    for pid in sorted(int(d) for d in os.listdir("/proc") if d.isdigit()):
        try:
            st = Path(f"/proc/{pid}/stat").read_text()
            if int(st.rsplit(")", 1)[1].split()[3]) != sid:   # field 6: session
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()[:200]
            for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
                base = Path(f"/proc/{pid}/task/{tid}")
                tst = (base / "stat").read_text()
                rest = tst.rsplit(")", 1)[1].split()
                item = {"pid": pid, "tid": tid, "cmd": cmd,
                        "comm": tst[tst.index("(") + 1:tst.rindex(")")], "state": rest[0],
                        "utime_ticks": int(rest[11]), "stime_ticks": int(rest[12])}
                for name in ("wchan", "syscall"):
                    with contextlib.suppress(OSError):
                        item[name] = (base / name).read_text().strip()
                out.append(item)
        except (OSError, ValueError, IndexError):
            continue                       # gone meanwhile
    return out


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code > 128 and code - 128 < 65:
        try:
            return f"exit {code} ({signal.Signals(code - 128).name}?)"
        except ValueError:
            pass
    return f"exit {code}"


# ------------------------------------------------------------------ configurations

class Config:
    """How one configuration wraps a workload's command."""

    name = "?"
    what = ""
    separate = False  # measured in its own A/B pair against native (valgrind)

    def __init__(self) -> None:
        self.reason: str | None = None  # None: available

    def check(self, ctx: suite.Ctx, env: dict[str, str], tmp: Path) -> str | None:
        """None when usable here, else the reason it is unavailable."""
        return None

    def applies(self, w: suite.Workload, prep: suite.Prepared) -> str | None:
        return None

    def command(self, argv: list[str], prep: suite.Prepared, work: Path) -> list[str]:
        return argv

    def environ(self, env: dict[str, str]) -> dict[str, str]:
        """The environment of the run (the workload's; configurations may add to it)."""
        return env

    def collect(self, work: Path, run: Run | None = None) -> dict:
        return {}


class Native(Config):
    name, what = "native", "the program as built / installed"


class Pgo(Config):
    name, what = "pgo", "gcc -fprofile-generate, training run, -fprofile-use (C workloads)"

    def applies(self, w, prep):
        return None if prep.pgo_argv else "not applicable: no source to rebuild"

    def command(self, argv, prep, work):
        assert prep.pgo_argv
        return prep.pgo_argv


def _dbr_exe() -> str:
    venv = Path(sys.executable).parent / "dbr"
    return str(venv) if venv.exists() else (shutil.which("dbr") or str(venv))


class Dbr(Config):
    """``dbr run --embedded --quiet --report FILE [-o ...] -- PROG``."""

    name, what = "dbr", "dbr run --embedded, default settings"

    def __init__(self, overrides: list[str] | None = None, flags: list[str] | None = None):
        super().__init__()
        self.overrides = list(overrides or [])
        self.flags = list(flags or [])

    def prefix(self, report: Path) -> list[str]:
        pre = [_dbr_exe(), "run", "--embedded", "--quiet", *self.flags, "--report", str(report)]
        for o in self.overrides:
            pre += ["-o", o]
        return pre + ["--"]

    def check(self, ctx, env, tmp):
        exe = _dbr_exe()
        if not os.path.exists(exe):
            return "unavailable: no dbr command in the venv"
        p = subprocess.run([exe, "run", "--help"], env=env, capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0:
            return f"unavailable: `dbr run` is not implemented yet ({_last(p.stderr)})"
        report = tmp / f"smoke-{self.name}.json"
        true = shutil.which("true") or "/bin/true"
        try:
            t0 = time.perf_counter()
            p = subprocess.run(self.prefix(report) + [true], env=env, capture_output=True,
                               text=True, timeout=120)
            self.what += f"; `dbr run ... -- true` takes {time.perf_counter() - t0:.2f} s"
        except subprocess.TimeoutExpired:
            return "unavailable: `dbr run -- true` did not finish within 120 s"
        if p.returncode != 0:
            return f"unavailable: `dbr run -- true` exited {p.returncode}: {_last(p.stderr)}"
        if not report.exists():
            return "unavailable: `dbr run --report` wrote no report"
        return None

    def command(self, argv, prep, work):
        rep = work / f"report-{self.name}.json"
        rep.unlink(missing_ok=True)
        return self.prefix(rep) + argv

    def collect(self, work, run=None):
        import json

        rep = work / f"report-{self.name}.json"
        try:
            data = json.loads(rep.read_text())
        except (OSError, ValueError) as exc:
            return {"report_error": f"no readable report: {exc}"}
        rep.unlink(missing_ok=True)
        return {"report": summarize_report(data)}


def summarize_report(data: dict) -> dict:
    """The numbers the table needs from one dbr.run/1 report."""
    clients = data.get("clients") or []
    totals = data.get("totals") or {}
    ttfp = [c["time_to_first_patch_s"] for c in clients
            if isinstance(c.get("time_to_first_patch_s"), (int, float))]
    samples = totals.get("samples", sum(c.get("samples", 0) or 0 for c in clients))
    in_repl = totals.get("samples_in_replacement",
                         sum(c.get("samples_in_replacement", 0) or 0 for c in clients))
    after = sum(c.get("samples_after_first_patch", 0) or 0 for c in clients)
    regions = [r for c in clients for r in (c.get("regions") or [])]
    out = {
        "clients": len(clients),
        "samples": samples,
        "samples_in_replacement": in_repl,
        "samples_after_first_patch": after,
        "share_in_replacement": (in_repl / samples) if samples else None,
        "share_after_first_patch": (in_repl / after) if after else None,
        "time_to_first_patch_s": min(ttfp) if ttfp else None,
        "patches_installed": totals.get("patches_installed",
                                        sum(c.get("patches_installed", 0) or 0 for c in clients)),
        "patches_removed": sum(c.get("patches_removed", 0) or 0 for c in clients),
        "regions_installed": totals.get("regions_installed"),
        "code_bytes": sum(r.get("code_bytes", 0) or 0 for r in regions),
        "code_bytes_installed": sum(r.get("code_bytes", 0) or 0 for r in regions
                                    if r.get("state") == "installed"),
        "exit_code": data.get("exit_code"),
        "prog_wall_s": data.get("wall_s"),  # PROG alone, as timed by dbr run
        "region_status": next((c.get("region_status") for c in clients
                               if c.get("region_status")), None),
    }
    # Service cost, if the report carries it (field names not fixed by the schema).
    for key in ("service", "embedded_service"):
        svc = data.get(key)
        if isinstance(svc, dict):
            for k in ("cpu_s", "peak_rss_kb", "peak_rss_bytes", "max_rss_kb"):
                if isinstance(svc.get(k), (int, float)):
                    out[f"service_{k}"] = svc[k]
    return out


def _last(text: str, n: int = 200) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "no message")[-n:]


def sampling_only_override() -> tuple[str | None, str]:
    """The ``-o`` that turns patching off, from the service's configuration keys."""
    try:
        from dbr_service.config import Config as SvcConfig

        keys = set(SvcConfig.keys())
    except Exception as exc:  # noqa: BLE001 - any import problem makes it unavailable
        return None, f"unavailable: cannot read dbr_service.config ({exc!r})"
    for key, value in (("patching", "false"), ("enable_patching", "false"),
                       ("install_patches", "false"), ("patch", "false"),
                       ("sampling_only", "true"), ("dry_run", "true"), ("observe_only", "true")):
        if key in keys:
            return f"{key}={value}", ""
    return None, ("unavailable: dbr_service/config.py has no key that disables patching "
                  "(looked for patching, enable_patching, install_patches, sampling_only, "
                  "dry_run, observe_only)")


class DbrSampling(Dbr):
    name, what = "dbr-sampling", "dbr run --embedded, patching disabled (sampling only)"

    def check(self, ctx, env, tmp):
        override, why = sampling_only_override()
        if override is None:
            return why
        self.overrides = [override]
        self.what = f"dbr run --embedded -o {override}"
        return super().check(ctx, env, tmp)


def sampling_rate_hz() -> tuple[int, str]:
    try:
        from dbr_service.config import Config as SvcConfig

        period = SvcConfig().sample_period_us
        return max(1, round(1e6 / period)), f"dbr's default sample_period_us={period}"
    except Exception:  # noqa: BLE001
        return 1000, "dbr_service.config not importable: 1000 Hz assumed"


class Perf(Config):
    name = "perf"

    def __init__(self) -> None:
        super().__init__()
        self.rate, self.rate_note = sampling_rate_hz()
        self.what = (f"perf record --no-bpf-event -F {self.rate} -e cpu-clock -o TMP "
                     f"({self.rate_note}; continuous, while dbr samples in windows)")
        self.opts = ["--no-bpf-event"]

    def check(self, ctx, env, tmp):
        self.exe = shutil.which("perf", path=ctx.path if ctx.path is not None
                                else os.environ.get("PATH"))
        if not self.exe:
            return "unavailable: perf not found on PATH"
        out = tmp / "smoke.perf"
        # Fixed cost of perf record on `true`, without and with --no-bpf-event (perf
        # synthesises an event per loaded BPF program at start: ~1 s on some hosts, a
        # set-up cost unrelated to sampling, which would swamp 1-2 s workloads).
        self.fixed: dict[str, float] = {}
        for label, opts in (("default", []), ("--no-bpf-event", ["--no-bpf-event"])):
            t0 = time.perf_counter()
            p = subprocess.run([self.exe, "record", "-q", *opts, "-F", str(self.rate), "-e",
                                "cpu-clock", "-o", str(out), "--", "true"], env=env,
                               capture_output=True, text=True, timeout=60)
            self.fixed[label] = time.perf_counter() - t0
            out.unlink(missing_ok=True)
            if p.returncode != 0:
                if opts:  # an old perf without the option: plain perf record
                    self.opts = []
                    self.what = self.what.replace(" --no-bpf-event", "")
                    continue
                return f"unavailable: perf record refused: {_last(p.stderr)}"
        self.what += ("; `perf record -- true` takes " + ", ".join(
            f"{v:.2f} s {k}" for k, v in self.fixed.items()))
        return None

    def command(self, argv, prep, work):
        out = work / "perf.data"
        out.unlink(missing_ok=True)
        return [self.exe, "record", "-q", *self.opts, "-F", str(self.rate), "-e", "cpu-clock",
                "-o", str(out), "--", *argv]

    def collect(self, work, run=None):
        out = work / "perf.data"
        size = out.stat().st_size if out.exists() else 0
        out.unlink(missing_ok=True)
        return {"perf_data_bytes": size}


class Valgrind(Config):
    name, what = "valgrind", "valgrind --tool=none (own A/B pair with native, few runs)"
    separate = True

    def check(self, ctx, env, tmp):
        self.exe = shutil.which("valgrind", path=ctx.path if ctx.path is not None
                                else os.environ.get("PATH"))
        return None if self.exe else "unavailable: valgrind not found on PATH"

    def command(self, argv, prep, work):
        return [self.exe, "--tool=none", "-q", *argv]


class HostService:
    """A ``dbr service`` with default settings and a private DBR_RUNTIME_DIR, started once
    and left running for the whole benchmark, as on a host that runs it all the time."""

    def __init__(self, overrides: list[str] | None = None) -> None:
        self.rt: str | None = None
        self.proc: subprocess.Popen | None = None
        self.overrides = list(overrides or [])

    def start(self, env: dict[str, str]) -> str | None:
        """None once it serves, else why it is unavailable."""
        import atexit
        import tempfile

        self.rt = tempfile.mkdtemp(prefix="dbr-bench-host-")
        args = [_dbr_exe(), "service"] + [a for o in self.overrides for a in ("-o", o)]
        self.proc = subprocess.Popen(args, env=dict(env, DBR_RUNTIME_DIR=self.rt),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.rt, "control.sock")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return "unavailable: the host dbr service did not start"
            time.sleep(0.05)
        time.sleep(1.0)  # let its worker pool start, as on a host that runs all the time
        return None

    def cpu_s(self) -> float | None:
        """user+sys of the service and its worker processes so far (common.tree_cpu_s)."""
        return tree_cpu_s(self.proc.pid)

    def patched(self, pid: int) -> bool | None:
        """Whether this service installed code in the client ``pid`` (asked after it
        ended, while the service keeps its session): False when it has no session for
        it (the run was born late, or ended before the service heard of it), None when
        the service cannot be asked."""
        if not self.rt or not pid:
            return None
        from dbr_service.cmd_run import collect_report
        from dbr_service.ctlclient import ControlClient

        try:
            clients = collect_report(ControlClient(self.rt), pid)
        except Exception:  # noqa: BLE001 - a service that does not answer: unknown
            return None
        return any(c.get("time_to_first_patch_s") is not None for c in clients or [])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.rt:
            shutil.rmtree(self.rt, ignore_errors=True)


class DbrHost(Dbr):
    """``dbr run`` attached to a host service that is already running (default settings),
    as on a deployed host: the embedded service's start-up is not in the figure."""

    name, what = "dbr-host", "dbr run with a running host `dbr service` (default settings)"

    def __init__(self) -> None:
        super().__init__()
        self.host = HostService()

    def prefix(self, report: Path) -> list[str]:
        return [_dbr_exe(), "run", "--quiet", "--report", str(report), "--"]

    def environ(self, env):
        return dict(env, DBR_RUNTIME_DIR=self.host.rt or "")

    def check(self, ctx, env, tmp):
        why = self.host.start(env)
        return why or super().check(ctx, self.environ(env), tmp)


class DbrPreload(Config):
    """PROG itself with the agent in its environment (``LD_PRELOAD``) under a running host
    service with default settings: how programs run on a host where dbr is deployed
    (a unit's ``Environment=LD_PRELOAD=...``), timed by the same spawn-to-wait4 clock as
    native, with no ``dbr run`` process around it.  What dbr did comes from the
    service's ``report`` verb for the run's pid, asked after the run (not timed)."""

    name = "dbr-preload"
    what = ("PROG with LD_PRELOAD=libdbr_agent.so under a running host `dbr service` "
            "(default settings), no `dbr run`: the deployed form, timed like native")

    def __init__(self) -> None:
        super().__init__()
        self.host = HostService()
        self.agent = ""
        self._cpu: float | None = None

    def check(self, ctx, env, tmp):
        try:
            import dbr_agent

            self.agent = dbr_agent.agent_path()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"unavailable: the agent is not built ({exc})"
        why = self.host.start(env)
        self._cpu = None if why else self.host.cpu_s()
        return why

    def environ(self, env):
        from dbr_service.cmd_run import child_env

        return child_env(self.agent, Path(self.host.rt or ""), env)

    def collect(self, work, run=None):
        if run is None or not run.pid or not self.host.rt:
            return {}
        from dbr_service.cmd_run import collect_report
        from dbr_service.ctlclient import ControlClient
        from dbr_service.report import run_report

        clients = collect_report(ControlClient(self.host.rt), run.pid)
        cpu, before = self.host.cpu_s(), self._cpu
        self._cpu = cpu
        if not clients:
            # no session: the service never heard of this run (born late), so no code
            return {"report_error": f"the host service has no session for pid {run.pid}",
                    "patched": False}
        rep = run_report([], run.exit_code, run.wall, clients, service="host",
                         runtime_dir=self.host.rt)
        out = summarize_report(rep)
        if cpu is not None and before is not None:
            # the service's CPU since the previous run's report: this run's share (the
            # service serves nobody else)
            out["service_cpu_s"] = cpu - before
            out["service_cpu_source"] = ("host service CPU from one run's report to the "
                                         "next (psutil)")
        return {"report": out}


THREAD_ONLY_C = r"""
/* A preloaded library that starts one idle thread and does nothing else: the control
   for the agent's own thread (glibc leaves its single-threaded fast paths for good once
   a process has a second thread, whatever that thread does). */
#include <pthread.h>
#include <unistd.h>
static void *idle(void *arg) { (void)arg; for (;;) pause(); return 0; }
__attribute__((constructor)) static void start(void)
{
    pthread_t t;
    if (pthread_create(&t, 0, idle, 0) == 0)
        pthread_detach(t);
}
"""


class ThreadOnly(Config):
    """Control for the agent's thread: PROG with a preloaded library whose only act is
    to start one idle thread (built here with gcc).  The difference between this and
    native is what any in-process agent thread costs, not dbr's work."""

    name = "thread-only"
    what = "control: LD_PRELOAD of a library that only starts one idle thread"

    def __init__(self) -> None:
        super().__init__()
        self.lib = ""

    def check(self, ctx, env, tmp):
        cc = shutil.which("gcc") or shutil.which("cc")
        if not cc:
            return "unavailable: no C compiler"
        src, lib = tmp / "thread_only.c", tmp / "libthread_only.so"
        src.write_text(THREAD_ONLY_C)
        p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src),
                            "-lpthread"], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            return f"unavailable: cannot build the control library: {_last(p.stderr)}"
        self.lib = str(lib)
        return None

    def environ(self, env):
        from dbr_service.cmd_run import preload_env

        return preload_env(env, self.lib)


class DbrPreloadSampling(DbrPreload):
    """``dbr-preload`` with the host service's patching off: the agent and the sampling
    of a deployed host without any replacement code.  Next to ``dbr-preload`` it tells
    what the installed regions themselves gain or cost."""

    name = "dbr-preload-sampling"
    what = "dbr-preload with the host service's patching disabled (agent + sampling only)"

    def check(self, ctx, env, tmp):
        override, why = sampling_only_override()
        if override is None:
            return why
        self.host = HostService([override])
        self.what = f"dbr-preload, host service with -o {override}"
        return super().check(ctx, env, tmp)


class DbrPreloadYoung(DbrPreload):
    """``dbr-preload`` with ``min_client_age_s=0``: programs sampled from the service's
    first snapshot after they start, as before 2026-11-25 (night).  Next to
    ``dbr-preload`` it tells what leaving sub-second programs alone saves them."""

    name = "dbr-preload-young"
    what = "dbr-preload with -o min_client_age_s=0 (young programs sampled too)"

    def __init__(self) -> None:
        super().__init__()
        self.host = HostService(["min_client_age_s=0"])


class DbrPreloadPthread(DbrPreload):
    """``dbr-preload`` with the agent's thread made by pthread_create
    (``DBR_AGENT_THREAD=pthread``), as before 2026-11-25: glibc then leaves its
    single-threaded paths (stdio and malloc locks) for good.  Next to ``dbr-preload``
    it tells what hiding the agent's thread from glibc saves."""

    name = "dbr-preload-pthread"
    what = "dbr-preload with DBR_AGENT_THREAD=pthread (the agent's thread known to glibc)"

    def environ(self, env):
        return {**super().environ(env), "DBR_AGENT_THREAD": "pthread"}


def default_configs() -> list[Config]:
    return [Native(), Dbr(), DbrHost(), DbrPreload(), ThreadOnly(), DbrSampling(), Perf(),
            Valgrind(), Pgo()]


EXTRA_CONFIGS: dict[str, Callable[[], Config]] = {
    "dbr-aggressive": lambda: _named(Dbr(flags=["--aggressive"]), "dbr-aggressive",
                                     "dbr run --embedded --aggressive"),
    "dbr-preload-sampling": DbrPreloadSampling,
    "dbr-preload-pthread": DbrPreloadPthread,
    "dbr-preload-young": DbrPreloadYoung,
}


def _named(c: Config, name: str, what: str) -> Config:
    c.name, c.what = name, what
    return c


# Issue 5's target: "no workload slower than native by more than 1 %" with default
# settings.  The default, deployed form is the program under a host service with the
# agent preloaded (dbr-preload); `dbr run` adds its own start-up to every run.
TARGET = {"limit": 1.01, "configs": ["dbr-preload"], "level": 0.95}


# ------------------------------------------------------------------ settings

@dataclass
class Settings:
    quick: bool = False
    runs: int = 5
    warmup: int = 1
    valgrind_runs: int = 2
    timeout_factor: float = 20.0  # a run taking this many times native's is killed
    min_timeout: float = 60.0
    pgo_helps: float = 0.98       # PGO ratio at or below this counts as a gain
    valgrind_budget_s: float = 25.0  # no second valgrind round after this long

    @classmethod
    def for_mode(cls, quick: bool, runs: int | None = None) -> "Settings":
        if quick:
            # no warm-up rounds: the native reference run and each tool's availability
            # smoke run have already warmed the page cache
            return cls(quick=True, runs=runs or 3, warmup=0, valgrind_runs=1)
        return cls(quick=False, runs=runs or 5, warmup=1, valgrind_runs=2)


# ------------------------------------------------------------------ one workload

class Cell:
    """Runs and status of one configuration on one workload."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.runs: list[Run] = []
        self.status = "ok"
        self.message = ""
        self.hung: list[dict] = []   # a timed-out run's threads (session_threads)

    @property
    def live(self) -> bool:
        return self.status == "ok"


def _check_run(cell: Cell, r: Run, ref_code: int, ref_digest: str, wname: str) -> None:
    if r.timed_out:
        cell.status, cell.message = "timeout", f"killed after {r.wall:.1f} s"
        cell.hung = r.hung
        for t in r.hung:   # on stderr too: a hang is a bug to chase, not just a status
            warn(f"   hung: pid {t['pid']} tid {t['tid']} {t['comm']} {t['state']} "
                 f"wchan={t.get('wchan', '?')} syscall={t.get('syscall', '?')}")
    elif r.exit_code != ref_code:
        cell.status = "crashed"
        cell.message = (f"{describe_exit(r.exit_code)} (native: {describe_exit(ref_code)}): "
                        f"{_last(r.stderr_tail)}")
    elif r.digest != ref_digest:
        cell.status = "FAILURE"
        cell.message = "output differs from native (stdout/output-file hash mismatch)"
    else:
        cell.runs.append(r)
        return
    loud = "!! FAILURE" if cell.status == "FAILURE" else f"!! {cell.status}"
    warn(f"{loud}: {wname} under {cell.cfg.name}: {cell.message}")


def alternate(cells: list[Cell], prep: suite.Prepared, argv_of: Callable[[Cell], list[str]],
              env: dict[str, str], work: Path, runs: int, warmup: int, timeout: float,
              ref: tuple[int, str], wname: str,
              budget_s: float | None = None) -> list[list[tuple[str, float]]]:
    """Round-robin the live cells, rotating the starting config every round; returns the
    per-round walls (config name, seconds) for paired ratios.  With ``budget_s``, no new
    round starts once that much time has gone (at least one recorded round runs)."""
    rounds: list[list[tuple[str, float]]] = []
    t0 = time.monotonic()
    for i in range(warmup + runs):
        if budget_s is not None and rounds and time.monotonic() - t0 > budget_s:
            break
        live = [c for c in cells if c.live]
        if not live:
            break
        k = i % len(live)
        order = live[k:] + live[:k]
        this: list[tuple[str, float]] = []
        for cell in order:
            if not cell.live:
                continue
            r = run_once(cell.cfg.command(argv_of(cell), prep, work), cell.cfg.environ(env),
                         work / "run", prep.outputs, timeout)
            r.extra = cell.cfg.collect(work, r)
            if i < warmup:  # warm-up: checked, not recorded
                before = len(cell.runs)
                _check_run(cell, r, *ref, wname)
                del cell.runs[before:]
                continue
            _check_run(cell, r, *ref, wname)
            if cell.live:
                r.round = len(rounds)
                this.append((cell.cfg.name, r.wall))
        if i >= warmup:
            rounds.append(this)
    return rounds


def cell_json(cell: Cell, native: Cell | None, rounds: list[list[tuple[str, float]]]) -> dict:
    out: dict[str, Any] = {"status": cell.status, "what": cell.cfg.what}
    if cell.message:
        out["message"] = cell.message
    if cell.hung:
        out["hung_threads"] = cell.hung
    if not cell.runs:
        return out
    walls = [r.wall for r in cell.runs]
    out["runs"] = len(walls)
    out["wall_s"] = spread(walls)
    out["cpu_s"] = spread([r.cpu_s for r in cell.runs])
    out["maxrss_kb"] = max(r.maxrss_kb for r in cell.runs)
    if native is not None and native.runs and cell is not native:
        nw = statistics.median(r.wall for r in native.runs)
        ncpu = statistics.median(r.cpu_s for r in native.runs)
        out["ratio"] = out["wall_s"]["median"] / nw if nw else None
        out["cpu_ratio"] = out["cpu_s"]["median"] / ncpu if ncpu else None
        pairs, patched = [], []
        by_round = {r.round: r for r in cell.runs if r.round >= 0}
        for i, rnd in enumerate(rounds):
            d = dict(rnd)
            if cell.cfg.name in d and native.cfg.name in d and d[native.cfg.name] > 0:
                pairs.append((d[cell.cfg.name], d[native.cfg.name]))
                patched.append(run_patched(by_round.get(i)))
        if pairs:
            out["paired_ratio"] = spread([a / b for a, b in pairs])
            out["paired_walls"] = [[round(a, 6), round(b, 6)] for a, b in pairs]  # raw data
            ci = ratio_ci(pairs)
            if ci is not None:
                out["ratio_ci95"] = list(ci)
            if any(p is not None for p in patched):
                out["paired_patched"] = patched  # per pair: code installed in that run
                out["by_patch"] = by_patch(pairs, patched)
        out["extra_cpu_s"] = out["cpu_s"]["median"] - ncpu
    reports = [r.extra["report"] for r in cell.runs if "report" in r.extra]
    errors = [r.extra["report_error"] for r in cell.runs if "report_error" in r.extra]
    if reports or errors:
        out["dbr"] = dbr_metrics(reports, errors, out)
        pw = out["dbr"].get("prog_wall_s")
        if pw is not None and out.get("ratio"):
            # PROG's own wall time (dbr run's start-up, report and shutdown excluded)
            out["dbr"]["prog_ratio"] = pw / (out["wall_s"]["median"] / out["ratio"])
    return out


def run_patched(r: Run | None) -> bool | None:
    """Whether dbr installed code in run ``r`` (its report's time to first patch), or
    None when the run has no report (not a dbr config, or the report failed)."""
    if r is None:
        return None
    rep = r.extra.get("report")
    if not isinstance(rep, dict):
        return r.extra.get("patched")  # False where the service had no session for it
    return rep.get("time_to_first_patch_s") is not None


def by_patch(pairs: list[tuple[float, float]], patched: list[bool | None]) -> dict:
    """The paired rounds split by whether the dbr run had code installed: for each side,
    its rounds, the ratio of medians and its interval.  With default settings only some
    runs are patched (short runs are born late).  Not the code's own effect: a run gets
    code only if it lasts until the service's first job ends, so runs the machine slowed
    are patched more often (xz, run BY: patched 1.026, unpatched 0.993), and a program
    under two services, one with ``patching=false`` (bench.service_ab), measures that."""
    out: dict[str, Any] = {}
    for key, want in (("patched", True), ("unpatched", False)):
        side = [pr for pr, p in zip(pairs, patched) if p is want]
        if not side:
            continue
        nb = statistics.median(b for _, b in side)
        ci = ratio_ci(side)
        out[key] = {"rounds": len(side),
                    "ratio": statistics.median(a for a, _ in side) / nb if nb else None,
                    "ratio_ci95": list(ci) if ci else None}
    return out


def _med(xs: list) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def dbr_metrics(reports: list[dict], errors: list[str], cell: dict) -> dict:
    m: dict[str, Any] = {"reports": len(reports)}
    if errors:
        m["report_errors"] = errors[:3]
    if not reports:
        return m
    ttfp = [r["time_to_first_patch_s"] for r in reports]
    m["runs_patched"] = sum(1 for t in ttfp if t is not None)
    m["region_status"] = next((r["region_status"] for r in reversed(reports)
                               if r.get("region_status")), None)
    m["time_to_first_patch_s"] = _med(ttfp)
    for k in ("samples", "share_in_replacement", "share_after_first_patch",
              "patches_installed", "patches_removed", "regions_installed", "code_bytes",
              "code_bytes_installed", "prog_wall_s"):
        m[k] = _med([r.get(k) for r in reports])
    svc_cpu = _med([r.get("service_cpu_s") for r in reports])
    if svc_cpu is not None:
        m["service_cpu_s"] = svc_cpu
        m["service_cpu_source"] = next((r["service_cpu_source"] for r in reports
                                        if r.get("service_cpu_source")), "dbr run report")
    elif "extra_cpu_s" in cell:
        m["service_cpu_s"] = cell["extra_cpu_s"]
        m["service_cpu_source"] = ("rusage: CPU of the `dbr run` process tree (embedded "
                                   "service thread + agent + program) minus native's, medians")
    rss = _med([r.get("service_peak_rss_kb") or r.get("service_max_rss_kb") for r in reports])
    if rss is None and _med([r.get("service_peak_rss_bytes") for r in reports]) is not None:
        rss = _med([r.get("service_peak_rss_bytes") for r in reports]) / 1024
    if rss is not None:
        m["service_peak_rss_kb"], m["service_rss_source"] = rss, "dbr run report"
    elif "maxrss_kb" in cell:
        m["service_peak_rss_kb"] = cell["maxrss_kb"]
        m["service_rss_source"] = ("rusage ru_maxrss of the `dbr run` tree: the largest "
                                   "process, i.e. dbr run + embedded service unless the "
                                   "program is bigger")
    return m


def run_workload(w: suite.Workload, configs: list[Config], ctx: suite.Ctx, st: Settings,
                 env: dict[str, str], work: Path) -> dict:
    row: dict[str, Any] = {"name": w.name, "kind": w.kind, "what": w.what, "configs": {}}
    t_start = time.monotonic()
    try:
        prep = w.prepare(ctx)
    except suite.Skip as exc:
        warn(f"-- skipped {w.name}: {exc}")
        row.update(status="skipped", message=str(exc))
        return row
    except Exception as exc:  # noqa: BLE001 - a broken preparation is that workload's crash
        warn(f"!! {w.name}: preparation crashed: {exc!r}")
        row.update(status="crashed", message=f"preparation failed: {exc!r}",
                   traceback=traceback.format_exc()[-2000:])
        return row
    row["argv"] = prep.argv
    wenv = prep.environ(env)
    # Reference run (also the native warm-up): its exit code and output hash are
    # what every configuration must reproduce.
    ref = run_once(prep.argv, wenv, work / "run", prep.outputs, timeout=max(600, st.min_timeout))
    if ref.timed_out or ref.exit_code != 0:
        why = "timed out" if ref.timed_out else describe_exit(ref.exit_code)
        warn(f"!! {w.name}: native run crashed: {why}: {_last(ref.stderr_tail)}")
        row.update(status="crashed", message=f"native run {why}: {_last(ref.stderr_tail)}")
        return row
    row["native_reference_wall_s"] = ref.wall
    timeout = max(st.min_timeout, st.timeout_factor * ref.wall)
    cells: dict[str, Cell] = {}
    for cfg in configs:
        cell = Cell(cfg)
        if cfg.reason:
            cell.status, cell.message = "unavailable", cfg.reason
        elif (why := cfg.applies(w, prep)):
            cell.status, cell.message = "n/a", why
        cells[cfg.name] = cell
    native = cells.get("native")
    main = [c for c in cells.values() if c.live and not c.cfg.separate]
    rounds = alternate(main, prep, lambda c: prep.argv, wenv, work, st.runs, st.warmup,
                       timeout, (ref.exit_code, ref.digest), w.name)
    for cell in main:
        row["configs"][cell.cfg.name] = cell_json(cell, native, rounds)
    # Separately paired configurations (valgrind): native vs it, few runs; in quick
    # mode on the small input.
    for cell in [c for c in cells.values() if c.cfg.separate]:
        if not cell.live:
            row["configs"][cell.cfg.name] = cell_json(cell, None, [])
            continue
        argv = prep.small_argv if (st.quick and prep.small_argv) else prep.argv
        sref = ref if argv is prep.argv else run_once(argv, wenv, work / "run", prep.outputs,
                                                      timeout=600)
        pair_native = Cell(Native())
        pair_native.cfg.name = "native-pair"
        vt = max(st.min_timeout * 5, 100 * sref.wall)
        prounds = alternate([pair_native, cell], prep,
                            lambda c: argv, wenv, work, st.valgrind_runs, 0, vt,
                            (sref.exit_code, sref.digest), w.name,
                            budget_s=st.valgrind_budget_s)
        cj = cell_json(cell, pair_native, prounds)
        cj["input"] = "small" if argv is not prep.argv else "same as the others"
        cj["native_pair_wall_s"] = spread([r.wall for r in pair_native.runs]) \
            if pair_native.runs else None
        row["configs"][cell.cfg.name] = cj
    for name, cell in cells.items():
        if name not in row["configs"]:
            row["configs"][name] = cell_json(cell, None, [])
    row["pgo_share"] = pgo_share(row["configs"], st)
    bad = [n for n, c in row["configs"].items() if c["status"] in ("FAILURE", "crashed",
                                                                     "timeout")]
    if any(row["configs"][n]["status"] == "FAILURE" for n in bad):
        row["status"] = "FAILURE"
    elif bad:
        row["status"] = "crashed"
    else:
        row["status"] = "ok"
    if bad:
        row["message"] = "; ".join(f"{n}: {row['configs'][n]['status']}: "
                                   f"{row['configs'][n].get('message', '')}" for n in bad)
    row["seconds"] = time.monotonic() - t_start
    return row


def pgo_share(cfgs: dict, st: Settings) -> dict:
    """(native − dbr)/(native − pgo), when PGO gains beyond ``st.pgo_helps``."""
    pgo, dbr = cfgs.get("pgo", {}), cfgs.get("dbr", {})
    if pgo.get("status") != "ok" or "ratio" not in pgo:
        return {"value": None, "why": "no PGO build" if pgo.get("status") in (None, "n/a")
                else f"PGO {pgo.get('status')}"}
    if pgo["ratio"] > st.pgo_helps:
        return {"value": None, "why": f"PGO gain below {100 * (1 - st.pgo_helps):.0f} % "
                                      f"(pgo/native {pgo['ratio']:.3f})"}
    q3 = (pgo.get("paired_ratio") or {}).get("q3")
    if q3 is not None and q3 >= 1.0:
        return {"value": None, "why": f"PGO gain not consistent (pgo/native {pgo['ratio']:.3f}, "
                                      f"paired-ratio q3 {q3:.3f} ≥ 1)"}
    if dbr.get("status") != "ok" or "ratio" not in dbr:
        return {"value": None, "why": f"dbr {dbr.get('status', 'not run')}"}
    # ratios are over the same native median, so (1 − r_dbr)/(1 − r_pgo)
    return {"value": (1 - dbr["ratio"]) / (1 - pgo["ratio"]), "why": ""}


# ------------------------------------------------------------------ the suite

def base_env(runtime_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["DBR_RUNTIME_DIR"] = str(runtime_dir)  # private: no host service, nothing shared
    env.setdefault("LC_ALL", "C")
    return env


def run_suite(workloads: list[suite.Workload], configs: list[Config], ctx: suite.Ctx,
              st: Settings, results: Results) -> int:
    """Run everything, writing results after each workload; 0 when every row is ok or
    skipped, 1 when a workload crashed or some configuration's output differed."""
    with tempfile.TemporaryDirectory(prefix="dbr-bench-") as tmpd:
        tmp = Path(tmpd)
        rt = tmp / "rt"
        rt.mkdir()
        env = base_env(rt)
        if ctx.path is not None:
            env["PATH"] = ctx.path
        section: dict[str, Any] = {"settings": st.__dict__, "target": TARGET,
                                   "configs": {}, "workloads": [],
                                   "status": "running"}
        for cfg in configs:
            t0 = time.monotonic()
            try:
                cfg.reason = cfg.check(ctx, env, tmp)
            except Exception as exc:  # noqa: BLE001
                cfg.reason = f"unavailable: check failed: {exc!r}"
            section["configs"][cfg.name] = {"what": cfg.what, "available": cfg.reason is None,
                                            "reason": cfg.reason or "",
                                            "check_s": time.monotonic() - t0}
            log(f"   config {cfg.name:14s} {cfg.reason or 'available'}")
        results.update("compare", section)
        rc = 0
        for w in workloads:
            log(f"-- {w.name}: {w.what}")
            work = tmp / "w" / w.name
            work.mkdir(parents=True)
            try:
                row = run_workload(w, configs, ctx, st, env, work)
            except Exception as exc:  # noqa: BLE001 - keep going, record it
                warn(f"!! {w.name}: benchmark machinery crashed: {exc!r}")
                row = {"name": w.name, "kind": w.kind, "what": w.what, "status": "crashed",
                       "message": f"runner error: {exc!r}",
                       "traceback": traceback.format_exc()[-2000:], "configs": {}}
            shutil.rmtree(work, ignore_errors=True)
            if row["status"] in ("crashed", "FAILURE"):
                rc = 1
            section["workloads"].append(row)
            log("   " + one_line(row))
            results.update("compare", section)
        section["status"] = "complete"
        results.update("compare", section)
    return rc


def one_line(row: dict) -> str:
    if row["status"] == "skipped":
        return f"skipped: {row.get('message', '')}"
    parts = [row["status"]]
    for name, c in row.get("configs", {}).items():
        if "ratio" in c:
            pr = c.get("paired_ratio", {})
            parts.append(f"{name} {c['ratio']:.3f} [{pr.get('min', 0):.3f}-{pr.get('max', 0):.3f}]")
        elif name != "native":
            parts.append(f"{name} {c['status']}")
    return "  ".join(parts)


def select_configs(spec: str | None) -> list[Config]:
    cfgs = default_configs()
    if not spec:
        return cfgs
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = {c.name: c for c in cfgs}
    out: list[Config] = [known["native"]]
    for n in names:
        if n == "native":
            continue
        if n in known:
            out.append(known[n])
        elif n in EXTRA_CONFIGS:
            out.append(EXTRA_CONFIGS[n]())
        else:
            raise SystemExit(f"unknown config {n!r}: {', '.join([*known, *EXTRA_CONFIGS])}")
    return out


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller inputs, fewer runs")
    ap.add_argument("--runs", type=int, help="recorded runs per config (default 5, quick 3)")
    ap.add_argument("--configs", help="comma list (native always included); extra: "
                    + ", ".join(EXTRA_CONFIGS))
    ap.add_argument("workloads", nargs="*", help="subset of the workloads")
    args = ap.parse_args(argv)
    # SIGTERM as SIGINT: unwind, so the current run is killed, the partial results are
    # written and the host services stop (atexit), instead of dying with them orphaned
    signal.signal(signal.SIGTERM, _terminated)
    ws = suite.registry()
    if args.workloads:
        unknown = set(args.workloads) - {w.name for w in ws}
        if unknown:
            ap.error(f"unknown workload(s) {sorted(unknown)}; known: {[w.name for w in ws]}")
        ws = [w for w in ws if w.name in args.workloads]
    st = Settings.for_mode(args.quick, args.runs)
    results = Results.open(quick=args.quick, command=["python", "-m", "bench.compare",
                                                      *(argv if argv is not None else sys.argv[1:])])
    rc = 1
    try:
        rc = run_suite(ws, select_configs(args.configs), suite.Ctx(quick=args.quick), st,
                       results)
    finally:
        results.finish()
        log(f"written {results.json_path}, {results.md_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
