"""The configurations ``bench.compare`` runs every workload under, side by side:

* ``native``       the program as is (the baseline of every ratio);
* ``dbr``          ``dbr run --embedded`` with default settings;
* ``dbr-host``     ``dbr run`` attached to a running host ``dbr service``;
* ``dbr-preload``  the program with the agent preloaded under a running host service
                   (the deployed form, timed like native; the 1 % target's subject);
* ``thread-only``  control: a preloaded library that only starts one idle thread;
* ``dbr-sampling`` ``dbr run --embedded`` with patching disabled (sampling only), when
                   the configuration has a key for that;
* ``perf``         ``perf record -F <dbr's sampling rate> -e cpu-clock`` (temp file,
                   deleted): the profiling anchor;
* ``valgrind``     ``valgrind --tool=none``: the floor cost of a DBI framework; its own
                   native/valgrind A/B pair, few runs (small inputs in quick mode);
* ``pgo``          C workloads only: the source rebuilt with -fprofile-generate, a
                   training run, -fprofile-use.

Settings of the service one at a time are compared with ``bench.service_ab``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench import suite
from bench.runner import HostService, dbr_exe, last_line

if TYPE_CHECKING:
    from bench.runner import Run


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


class Dbr(Config):
    """``dbr run --embedded --quiet --report FILE [-o ...] -- PROG``."""

    name, what = "dbr", "dbr run --embedded, default settings"

    def __init__(self, overrides: list[str] | None = None, flags: list[str] | None = None):
        super().__init__()
        self.overrides = list(overrides or [])
        self.flags = list(flags or [])

    def prefix(self, report: Path) -> list[str]:
        pre = [dbr_exe(), "run", "--embedded", "--quiet", *self.flags, "--report", str(report)]
        for o in self.overrides:
            pre += ["-o", o]
        return pre + ["--"]

    def check(self, ctx, env, tmp):
        exe = dbr_exe()
        if not os.path.exists(exe):
            return "unavailable: no dbr command in the venv"
        p = subprocess.run([exe, "run", "--help"], env=env, capture_output=True, text=True,
                           timeout=120)
        if p.returncode != 0:
            return f"unavailable: `dbr run` is not implemented yet ({last_line(p.stderr)})"
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
            return f"unavailable: `dbr run -- true` exited {p.returncode}: {last_line(p.stderr)}"
        if not report.exists():
            return "unavailable: `dbr run --report` wrote no report"
        return None

    def command(self, argv, prep, work):
        rep = work / f"report-{self.name}.json"
        rep.unlink(missing_ok=True)
        return self.prefix(rep) + argv

    def collect(self, work, run=None):
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
        "functions_copied": totals.get("functions_copied"),
        "function_entries_went_live": totals.get("function_entries_went_live"),
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


def sampling_only_override() -> tuple[str | None, str]:
    """The ``-o`` that turns patching off, from the service's configuration keys."""
    try:
        from dbr_service.common.config import Config as SvcConfig

        keys = set(SvcConfig.keys())
    except Exception as exc:  # noqa: BLE001 - any import problem makes it unavailable
        return None, f"unavailable: cannot read dbr_service.common.config ({exc!r})"
    for key, value in (("patching", "false"), ("enable_patching", "false"),
                       ("install_patches", "false"), ("patch", "false"),
                       ("sampling_only", "true"), ("dry_run", "true"), ("observe_only", "true")):
        if key in keys:
            return f"{key}={value}", ""
    return None, ("unavailable: dbr_service/common/config.py has no key that disables patching "
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
        from dbr_service.common.config import Config as SvcConfig

        period = SvcConfig().sample_period_us
        return max(1, round(1e6 / period)), f"dbr's default sample_period_us={period}"
    except Exception:  # noqa: BLE001
        return 1000, "dbr_service.common.config not importable: 1000 Hz assumed"


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
                return f"unavailable: perf record refused: {last_line(p.stderr)}"
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


class DbrHost(Dbr):
    """``dbr run`` attached to a host service that is already running (default settings),
    as on a deployed host: the embedded service's start-up is not in the figure."""

    name, what = "dbr-host", "dbr run with a running host `dbr service` (default settings)"

    def __init__(self) -> None:
        super().__init__()
        self.host = HostService()

    def prefix(self, report: Path) -> list[str]:
        return [dbr_exe(), "run", "--quiet", "--report", str(report), "--"]

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
        from dbr_service.commands.cmd_run import child_env

        return child_env(self.agent, Path(self.host.rt or ""), env)

    def collect(self, work, run=None):
        if run is None or not run.pid or not self.host.rt:
            return {}
        from dbr_service.commands.cmd_run import collect_report
        from dbr_service.commands.ctlclient import ControlClient
        from dbr_service.commands.report import run_report

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
            return f"unavailable: cannot build the control library: {last_line(p.stderr)}"
        self.lib = str(lib)
        return None

    def environ(self, env):
        from dbr_service.commands.cmd_run import preload_env

        return preload_env(env, self.lib)


def default_configs() -> list[Config]:
    return [Native(), Dbr(), DbrHost(), DbrPreload(), ThreadOnly(), DbrSampling(), Perf(),
            Valgrind(), Pgo()]


def select_configs(spec: str | None) -> list[Config]:
    """The configurations named in ``spec`` (a comma list; native always first), or all."""
    cfgs = default_configs()
    if not spec:
        return cfgs
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = {c.name: c for c in cfgs}
    out: list[Config] = [known["native"]]
    for n in names:
        if n == "native":
            continue
        if n not in known:
            raise SystemExit(f"unknown config {n!r}: {', '.join(known)}")
        out.append(known[n])
    return out
