"""One service, N concurrent clients: N = 1, 8, 32, 64 (quick: 1, 8).

For each N: start ``dbr service`` (default settings) with a private DBR_RUNTIME_DIR
and wait for its READY=1 (NOTIFY_SOCKET; polling the control socket as a fallback);
start N copies of ``bench/workloads/spin.c`` (a call-heavy loop for a fixed wall
time) with LD_PRELOAD of ``dbr_agent.agent_path()`` and that runtime dir; while they
run, sample the service's RSS (service + its worker processes, psutil, every 0.1 s)
and time operator requests: ``status`` over the control socket directly (zmq REQ,
ControlClient) every 0.25 s, and a few whole ``dbr ctl --json status`` commands
(these include starting a Python interpreter).  When the clients are done, ask the
service for their report entries (time to first patch, samples, patches), shut it
down, and take its CPU time from wait4's rusage (service + reaped workers).

usage: python -m bench.scaling [--quick] [--levels 1,8] [--seconds S] [--aggressive]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Results
from bench.stats import spread
from bench.suite import SRC

DBR = str(Path(sys.executable).parent / "dbr")


def log(msg: str) -> None:
    print(msg, flush=True)


def build_spin(out_dir: Path) -> str:
    out = out_dir / "spin"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(SRC / "spin.c")], check=True)
    return str(out)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class ServiceProc:
    """A ``dbr service`` child in its own session, stopped by pid with bounded waits."""

    def __init__(self, rt: Path, tmp: Path, extra: list[str]):
        self.rt = rt
        self.notify_path = str(tmp / f"notify-{os.getpid()}-{time.monotonic_ns()}")
        self.ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ns.bind(self.notify_path)
        env = dict(os.environ, DBR_RUNTIME_DIR=str(rt), NOTIFY_SOCKET=self.notify_path)
        env.pop("LD_PRELOAD", None)
        self.log_path = tmp / "service.log"
        self.logf = open(self.log_path, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([DBR, "service", "-o", "log_level=warning", *extra],
                                     env=env, stdin=subprocess.DEVNULL, stdout=self.logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.rusage = None
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float = 60.0) -> str | None:
        from dbr_service.commands.ctlclient import ControlClient

        deadline = time.monotonic() + timeout
        self.ns.settimeout(0.2)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"dbr service exited {self.proc.returncode}: {self.tail()}"
            try:
                msg = self.ns.recv(4096).decode(errors="replace")
                if "READY=1" in msg:
                    self.ready_s = time.monotonic() - self.t0
                    return None
            except socket.timeout:
                if ControlClient(self.rt).answers(timeout=0.2):
                    self.ready_s = time.monotonic() - self.t0
                    return None
        return f"dbr service not ready within {timeout:.0f} s: {self.tail()}"

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            return lines[-1][-300:] if lines else "no output"
        except OSError:
            return "no log"

    def stop(self) -> None:
        """shutdown over the control socket, then SIGTERM, then SIGKILL; wait4 for rusage."""
        from dbr_service.commands.ctlclient import ControlClient

        if self.proc.poll() is None:
            try:
                ControlClient(self.rt).call("shutdown", timeout=2.0)
            except Exception:  # noqa: BLE001 - fall back to signals
                pass
        for sig, wait in ((None, 5.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and self.rusage is None:
                try:
                    os.killpg(self.proc.pid, sig)  # the session we created for it
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.rusage is None and time.monotonic() < deadline:
                pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
                if pid:
                    self.rusage = ru
                    self.proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(0.05)
            if self.rusage is not None:
                break
        try:  # stray workers of the session, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.logf.close()
        self.ns.close()
        try:
            os.unlink(self.notify_path)
        except OSError:
            pass


def run_level(n: int, seconds: float, spin: str, agent: str, tmp: Path,
              extra: list[str]) -> dict[str, Any]:
    import psutil

    from dbr_service.commands.ctlclient import ControlClient

    rt = tmp / f"rt{n}"
    rt.mkdir()
    lv: dict[str, Any] = {"clients": n, "client_seconds": seconds}
    svc = ServiceProc(rt, tmp, extra)
    clients: list[subprocess.Popen] = []
    try:
        err = svc.wait_ready()
        if err:
            lv.update(status=f"unavailable: {err}")
            return lv
        lv["service_ready_s"] = svc.ready_s
        ps = psutil.Process(svc.proc.pid)
        stop = threading.Event()
        peak = {"rss": 0, "procs": 0}
        lat: list[float] = []
        lat_err: list[str] = []

        def sample_mem() -> None:
            while not stop.is_set():
                try:
                    procs = [ps, *ps.children(recursive=True)]
                    rss = 0
                    for p in procs:
                        try:
                            rss += p.memory_info().rss
                        except psutil.Error:
                            pass
                    peak["rss"] = max(peak["rss"], rss)
                    peak["procs"] = max(peak["procs"], len(procs))
                except psutil.Error:
                    pass
                stop.wait(0.1)

        def probe() -> None:
            cc = ControlClient(rt)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    reply = cc.call("status", timeout=5.0)
                    if reply.get("ok"):
                        lat.append((time.perf_counter() - t0) * 1e3)
                    else:
                        lat_err.append(str(reply.get("error")))
                except Exception as exc:  # noqa: BLE001
                    lat_err.append(repr(exc))
                stop.wait(0.25)

        threads = [threading.Thread(target=sample_mem, daemon=True),
                   threading.Thread(target=probe, daemon=True)]
        for t in threads:
            t.start()
        env = dict(os.environ, DBR_RUNTIME_DIR=str(rt), LD_PRELOAD=agent)
        cpu0 = ps.cpu_times()
        t_start = time.monotonic()
        ends: dict[int, float] = {}
        starts: dict[int, float] = {}

        def reap(p: subprocess.Popen) -> None:
            try:
                p.wait(timeout=seconds * 4 + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                p.returncode = "timeout"  # type: ignore[assignment]
            ends[p.pid] = time.monotonic()

        reapers = []
        for _ in range(n):
            p = subprocess.Popen([spin, str(seconds)], env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            starts[p.pid] = time.monotonic()
            clients.append(p)
            t = threading.Thread(target=reap, args=(p,), daemon=True)
            t.start()
            reapers.append(t)
        # whole `dbr ctl --json status` commands, mid-run
        time.sleep(min(1.0, seconds / 3))
        ctl_ms = []
        for _ in range(3):
            t0 = time.perf_counter()
            r = subprocess.run([DBR, "ctl", "--json", "--timeout", "10", "status"],
                               env=dict(os.environ, DBR_RUNTIME_DIR=str(rt)),
                               capture_output=True, timeout=60)
            if r.returncode == 0:
                ctl_ms.append((time.perf_counter() - t0) * 1e3)
        for t in reapers:
            t.join(seconds * 4 + 90)
        codes = [p.returncode for p in clients]
        walls = [ends[p.pid] - starts[p.pid] for p in clients if p.pid in ends]
        elapsed = time.monotonic() - t_start
        try:
            cpu1 = ps.cpu_times()
            lv["service_cpu_during_clients_s"] = (cpu1.user + cpu1.system + cpu1.children_user
                                                  + cpu1.children_system - cpu0.user
                                                  - cpu0.system - cpu0.children_user
                                                  - cpu0.children_system)
        except psutil.Error:
            pass
        time.sleep(0.5)  # let the sessions close
        stop.set()
        for t in threads:
            t.join(10)
        try:
            entries = ControlClient(rt).result("report", {"pids": [p.pid for p in clients]},
                                               timeout=10.0)
        except Exception as exc:  # noqa: BLE001
            entries = []
            lv["report_error"] = repr(exc)
        ttfp = [e["time_to_first_patch_s"] for e in entries
                if isinstance(e.get("time_to_first_patch_s"), (int, float))]
        lv.update(
            status="ok" if all(c == 0 for c in codes) else
            f"clients failed: {sorted(set(map(str, codes)) - {'0'})}",
            elapsed_s=elapsed,
            client_wall_s=spread(walls),
            clients_seen=len(entries),
            clients_patched=len(ttfp),
            samples=spread([e.get("samples", 0) for e in entries]) if entries else None,
            patches_installed=sum(e.get("patches_installed", 0) for e in entries),
            time_to_first_patch_s=spread(ttfp) if ttfp else None,
            ctl_latency_ms=({**spread(lat), "p90": pct(lat, 0.9)} if lat else None),
            ctl_errors=lat_err[:3],
            dbr_ctl_command_ms=spread(ctl_ms) if ctl_ms else None,
            service_peak_rss_kb=peak["rss"] // 1024 or None,
            service_peak_procs=peak["procs"],
        )
        if lv.get("service_cpu_during_clients_s") is not None and elapsed > 0:
            lv["service_cpu_share"] = lv["service_cpu_during_clients_s"] / elapsed
        return lv
    finally:
        for p in clients:
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        svc.stop()
        if svc.rusage is not None:
            lv["service_cpu_s"] = svc.rusage.ru_utime + svc.rusage.ru_stime
            lv["service_maxrss_kb_rusage"] = svc.rusage.ru_maxrss
            lv["service_lifetime_s"] = time.monotonic() - svc.t0


METHOD = ("Service CPU s: user+sys of the `dbr service` process and its reaped workers over "
          "its whole life (wait4 rusage; includes start-up and shutdown); share of one core: "
          "CPU during the clients' run (psutil) / elapsed. Peak RSS: the largest sum of RSS "
          "over the service and its child processes, sampled every 0.1 s (psutil). First "
          "patch: the service's time_to_first_patch_s per client (report verb). ctl status "
          "ms: zmq REQ round trips to the control socket every 0.25 s during the run "
          "(ControlClient, no interpreter start); whole `dbr ctl --json status` commands "
          "are recorded as dbr_ctl_command_ms in the JSON.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 and 8 clients, shorter")
    ap.add_argument("--levels", help="comma list of client counts")
    ap.add_argument("--seconds", type=float, help="wall time of each client")
    ap.add_argument("--aggressive", action="store_true", help="service --aggressive preset")
    args = ap.parse_args(argv)
    levels = ([int(x) for x in args.levels.split(",")] if args.levels
              else [1, 8] if args.quick else [1, 8, 32, 64])
    seconds = args.seconds or (3.0 if args.quick else 6.0)
    extra = ["--aggressive"] if args.aggressive else []
    given = argv if argv is not None else sys.argv[1:]
    results = Results.open(quick=args.quick, command=["python", "-m", "bench.scaling", *given])
    section: dict[str, Any] = {"method": METHOD, "levels": [], "client_seconds": seconds,
                               "service_args": extra or ["(defaults)"], "status": "running"}
    rc = 0
    try:
        why = None
        if not os.path.exists(DBR):
            why = "unavailable: no dbr command in the venv"
        else:
            r = subprocess.run([DBR, "service", "--help"], capture_output=True, text=True)
            if r.returncode != 0:
                why = "unavailable: `dbr service` is not implemented yet"
        try:
            import dbr_agent

            agent = dbr_agent.agent_path()
        except Exception as exc:  # noqa: BLE001
            why = why or f"unavailable: agent not built ({exc})"
        if why:
            section["status"] = why
            print(why, file=sys.stderr)
            return 0
        with tempfile.TemporaryDirectory(prefix="dbr-scale-") as d:
            tmp = Path(d)
            spin = build_spin(tmp)
            for n in levels:
                log(f"-- {n} client(s), {seconds:.0f} s each")
                lv = run_level(n, seconds, spin, agent, tmp, extra)
                section["levels"].append(lv)
                log(f"   {lv.get('status')}: "
                    f"service CPU {lv.get('service_cpu_s', float('nan')):.2f} s, "
                    f"peak RSS {(lv.get('service_peak_rss_kb') or 0) / 1024:.0f} MB, "
                    f"patched {lv.get('clients_patched', 0)}/{lv.get('clients_seen', 0)}, "
                    "status rtt median "
                    f"{(lv.get('ctl_latency_ms') or {}).get('median', float('nan')):.1f} ms")
                if lv.get("status") != "ok":
                    rc = 1
                results.update("scaling", section)
        section["status"] = "complete"
        return rc
    finally:
        results.update("scaling", section)
        results.finish()
        log(f"written {results.json_path}")


if __name__ == "__main__":
    sys.exit(main())
