"""Running the long benchmark: host services, one run of a configuration, the server
runner, and the alternated pairs of every workload with partial results after each run."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench.configs import summarize_report
from bench.runner import HostService, run_once
from bench.long import bolt, tools
from bench.long.workloads import Ctx, Prepared

CONFIGS = ["native", "dbr-default", "dbr-aggressive", "dbr-nocalls", "dbr-aggressive-nocalls",
           "dbr-nofunctions", "dbr-aggressive-hottext", "bolt", "pgo"]
#: What runs unless --configs says otherwise; the -nocalls pair is for A/B of real calls,
#: -nofunctions for A/B of hot functions.
DEFAULT_CONFIGS = ["native", "dbr-default", "dbr-aggressive", "bolt", "pgo"]
CONFIG_WHAT = {
    "native": "the program as installed / built",
    "dbr-default": "LD_PRELOAD=libdbr_agent.so under a host `dbr service` with default "
                   "settings started by the bench (private DBR_RUNTIME_DIR): the deployed form",
    "dbr-aggressive": "the same under a host `dbr service --aggressive`",
    "dbr-nocalls": "dbr default with `-o real_calls=false` (calls leave replacement code)",
    "dbr-aggressive-nocalls": "dbr --aggressive with `-o real_calls=false`",
    "dbr-nofunctions": "dbr default with `-o hot_function_threshold=0` (regions need a hot "
                       "loop)",
    "dbr-aggressive-hottext": "dbr --aggressive with `-o hot_text=true` (every function "
                              "holding hot_text_min_share of the samples copied)",
    "bolt": "llvm-bolt-19 -reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions "
            "-split-all-cold, profile from perf record -e cpu-clock + perf2bolt -nl",
    "pgo": "gcc -fprofile-generate, training run, -fprofile-use (programs the bench builds)",
}
DBR_CONFIGS = {"dbr-default": [], "dbr-aggressive": ["--aggressive"],
               "dbr-nocalls": ["-o", "real_calls=false"],
               "dbr-aggressive-nocalls": ["--aggressive", "-o", "real_calls=false"],
               "dbr-nofunctions": ["-o", "hot_function_threshold=0"],
               "dbr-aggressive-hottext": ["--aggressive", "-o", "hot_text=true"]}


# ------------------------------------------------------------------ host services

class Service(HostService):
    """A ``dbr service [FLAGS]`` on a private DBR_RUNTIME_DIR, alive for the whole
    benchmark as on a host that runs it all the time (bench.runner.HostService), its
    log kept per configuration, unavailable unless the agent is built."""

    def __init__(self, name: str, flags: list[str], logdir: Path) -> None:
        super().__init__(flags=flags, log=logdir / f"service-{name}.log",
                         prefix=f"dbr-long-{name}-", need_agent=True)
        self.name, self.logdir = name, logdir

    def env(self, base: dict[str, str]) -> dict[str, str]:
        from dbr_service.commands.cmd_run import child_env

        return child_env(self.agent, Path(self.rt or ""), base)

    def client(self):
        from dbr_service.commands.ctlclient import ControlClient

        return ControlClient(self.rt)

    def report(self, pid: int, wall: float, exit_code: int) -> dict:
        """The dbr.run/1 numbers of one client (asked once it ended)."""
        from dbr_service.commands.cmd_run import collect_report
        from dbr_service.commands.report import run_report

        try:
            clients = collect_report(self.client(), pid)
        except Exception as exc:  # noqa: BLE001
            return {"report_error": f"no report: {exc!r}"}
        if not clients:
            return {"report_error": f"the service has no session for pid {pid}"}
        rep = run_report([], exit_code, wall, clients, service="host", runtime_dir=self.rt)
        out = summarize_report(rep)
        out["regions_went_live"] = rep["totals"].get("regions_went_live")
        out["regions_by_state"] = {}
        out["removed_why"] = {}
        for c in clients:
            for r in c.get("regions") or []:
                st = r.get("state", "?")
                out["regions_by_state"][st] = out["regions_by_state"].get(st, 0) + 1
                why = str((r.get("info") or {}).get("removed_why") or "")[:60]
                if why:
                    out["removed_why"][why] = out["removed_why"].get(why, 0) + 1
        out["speed_checks"] = [
            {"verdict": s.get("verdict"), "ratio": s.get("ratio")}
            for c in clients for s in (c.get("speed_checks") or [])][:16]
        out["hotspots"] = [
            {"fraction": round(h.get("fraction", 0), 4),
             "where": f"{(h.get('module') or '?').rsplit('/', 1)[-1]}+{h.get('offset') or 0:#x}"}
            for c in clients for h in (c.get("hotspots") or [])][:5]
        return out

    def last_seq(self) -> int:
        try:
            evs = self.client().result("events", {"since": 0}, timeout=2.0)
            return max((e.get("seq", 0) for e in evs), default=0)
        except Exception:  # noqa: BLE001
            return 0

    def events(self, since: int, pid: int) -> list[dict]:
        try:
            evs = self.client().result("events", {"since": since}, timeout=2.0)
        except Exception:  # noqa: BLE001
            return []
        keep = ("patch-installed", "patch-removed", "speed-check", "job-done")
        return [{k: e.get(k) for k in ("time", "event", "region", "sites", "code_bytes",
                                       "verdict", "ratio", "why")}
                for e in evs if e.get("pid") == pid and e.get("event") in keep]


def base_env(runtime_dir: Path) -> dict[str, str]:
    """The environment of every run: no agent preloaded (native), a private runtime dir."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.pop("PYTHONPATH", None)
    env["DBR_RUNTIME_DIR"] = str(runtime_dir)
    return env


# ------------------------------------------------------------------ batch runs

def run_batch(argv: list[str], env: dict[str, str], run_dir: Path, outputs: list[str],
              timeout: float) -> dict:
    r = run_once(argv, env, run_dir, outputs, timeout)
    return {"wall_s": r.wall, "cpu_s": r.cpu_s, "maxrss_kb": r.maxrss_kb, "exit": r.exit_code,
            "digest": r.digest, "timed_out": r.timed_out, "pid": r.pid,
            "stderr_tail": r.stderr_tail[-600:]}


# ------------------------------------------------------------------ servers (redis)

REDIS_TESTS = "set,get,incr,lpush,rpop,sadd,hset,zadd,lrange_100,mset"
REDIS_SLICE_N = 20000  # requests per test per slice (about 2-3 s a slice natively)
REDIS_CHECK = [
    ["FLUSHALL"],
    ["RPUSH", "chk:list", *[str((i * 7919) % 1000) for i in range(200)]],
    ["SORT", "chk:list", "LIMIT", "0", "10"],
    ["ZADD", "chk:z", *[x for i in range(100) for x in (str(i * 3 % 17), f"m{i}")]],
    ["ZRANGEBYSCORE", "chk:z", "3", "9", "WITHSCORES", "LIMIT", "0", "12"],
    ["HSET", "chk:h", *[x for i in range(50) for x in (f"f{i}", str(i * i))]],
    ["HGETALL", "chk:h"],
    ["INCRBYFLOAT", "chk:f", "3.25"],
    ["EVAL", "local s = 0 for i = 1, 100000 do s = (s + i * i) % 1000003 end return s", "0"],
    ["SINTERCARD", "1", "chk:none"],
    ["LRANGE", "chk:list", "50", "60"],
    ["DBSIZE"],
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_cli(port: int, args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([tools.which("redis-cli") or "redis-cli", "-h", "127.0.0.1", "-p",
                           str(port), *args], capture_output=True, timeout=timeout)


def _start_redis(binary: str, env: dict[str, str], run_dir: Path, port: int,
                 wrap: list[str] | None = None) -> tuple[subprocess.Popen, float, float]:
    """The server, its spawn time (time.time()) and perf_counter; ready once it answers."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # Debian's redis-server is a link to redis-check-rdb, which picks its role from
    # argv[0]: give it a redis-server name
    link = run_dir / "redis-server"
    if os.path.basename(binary) != "redis-server":
        os.symlink(binary, link)
        exe = str(link)
    else:
        exe = binary
    argv = [*(wrap or []), exe, "--port", str(port), "--bind", "127.0.0.1",
            "--protected-mode", "yes", "--save", "", "--appendonly", "no", "--dir",
            str(run_dir), "--daemonize", "no", "--logfile", str(run_dir / "redis.log")]
    t_wall, t0 = time.time(), time.perf_counter()
    p = subprocess.Popen(argv, env=env, cwd=run_dir, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=open(run_dir / "stderr", "wb"),
                         start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if p.poll() is not None:
            break
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if _redis_cli(port, ["PING"], timeout=5).stdout.strip() == b"PONG":
                return p, t_wall, t0
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    raise RuntimeError("redis-server did not answer PING within 30 s")


def redis_slice(port: int, n: int = REDIS_SLICE_N) -> dict:
    """One slice of load: redis-benchmark over the test list; requests and seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([tools.which("redis-benchmark") or "redis-benchmark", "-h", "127.0.0.1",
                        "-p", str(port), "-c", "50", "-n", str(n), "-r", "100000", "-t",
                        REDIS_TESTS, "--csv"], capture_output=True, text=True, timeout=300)
    t1 = time.perf_counter()
    per_test = {}
    for line in p.stdout.splitlines()[1:]:
        parts = [x.strip('"') for x in line.split(",")]
        if len(parts) >= 2:
            with contextlib.suppress(ValueError):
                per_test[parts[0]] = float(parts[1])
    ok = p.returncode == 0 and len(per_test) >= len(REDIS_TESTS.split(","))
    return {"t0": t0, "t1": t1, "requests": n * len(per_test) if ok else None,
            "per_test_rps": per_test, "ok": ok,
            "error": "" if ok else (p.stderr or p.stdout)[-300:]}


def run_server(binary: str, env: dict[str, str], run_dir: Path, duration: float,
               service: Service | None = None) -> dict:
    """redis-server under ``duration`` seconds of redis-benchmark slices, then the
    deterministic check, then SHUTDOWN NOSAVE; throughput per slice, the server's
    rusage, its exit, and dbr's patch events (seconds from the server's spawn)."""
    port = _free_port()
    seq0 = service.last_seq() if service else 0
    p, t_wall, t_perf = _start_redis(binary, env, run_dir, port)
    res: dict[str, Any] = {}

    def waiter() -> None:
        _, status, ru = os.wait4(p.pid, 0)
        res.update(t=time.perf_counter(), status=status, ru=ru)

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    slices = []
    error = ""
    try:
        while time.perf_counter() - t_perf < duration and th.is_alive():
            s = redis_slice(port)
            slices.append({"start": round(s["t0"] - t_perf, 3), "end": round(s["t1"] - t_perf, 3),
                           "requests": s["requests"], "rps": (s["requests"] / (s["t1"] - s["t0"])
                                                              if s["requests"] else None),
                           "per_test_rps": s["per_test_rps"]})
            if not s["ok"]:
                error = f"redis-benchmark failed: {s['error']}"
                break
        check = b""
        if th.is_alive():
            for cmd in REDIS_CHECK:
                c = _redis_cli(port, cmd)
                check += b"> " + " ".join(cmd[:2]).encode() + b"\n" + c.stdout
            _redis_cli(port, ["SHUTDOWN", "NOSAVE"])
        th.join(30)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        th.join(10)
        raise
    if th.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        th.join(10)
        error = error or "the server did not stop on SHUTDOWN NOSAVE"
    code = os.waitstatus_to_exitcode(res["status"]) if "status" in res else None
    p.returncode = code
    ru = res.get("ru")
    import hashlib

    out = {"wall_s": (res.get("t", time.perf_counter()) - t_perf), "cpu_s":
           (ru.ru_utime + ru.ru_stime) if ru else None, "maxrss_kb": ru.ru_maxrss if ru else None,
           "exit": code, "digest": hashlib.sha256(check).hexdigest(), "timed_out": False,
           "pid": p.pid, "slices": slices, "spawn_time": t_wall,
           "stderr_tail": ((run_dir / "stderr").read_bytes()[-600:].decode(errors="replace")
                           + error)}
    reqs = [s for s in slices if s["requests"]]
    out["rps"] = (sum(s["requests"] for s in reqs) / sum(s["end"] - s["start"] for s in reqs)
                  if reqs else None)
    if service is not None:
        evs = service.events(seq0, p.pid)
        for e in evs:
            e["t"] = round((e.pop("time") or t_wall) - t_wall, 3)
        out["events"] = evs
        patches = [e["t"] for e in evs if e["event"] == "patch-installed"]
        out["first_patch_s"] = min(patches) if patches else None
    if error:
        out["error"] = error
    return out


def train_server(binary: str, env: dict[str, str], run_dir: Path, perf_data: Path,
                 seconds: float = 10.0) -> str | None:
    """BOLT's training run of the server: perf record around redis-server under load."""
    port = _free_port()
    try:
        p, _, t0 = _start_redis(binary, env, run_dir, port,
                                wrap=bolt.perf_record_argv(perf_data, [])[:-1] + ["--"])
    except RuntimeError as exc:
        return str(exc)
    try:
        while time.perf_counter() - t0 < seconds:
            if not redis_slice(port)["ok"]:
                return "redis-benchmark failed"
        _redis_cli(port, ["SHUTDOWN", "NOSAVE"])
        p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return None if perf_data.exists() else "perf wrote no profile"


# ------------------------------------------------------------------ a workload

def classify(run: dict, ref_digest: str | None) -> str:
    """ok, crashed (signal or non-zero exit), timeout, wrong-output, error."""
    if run.get("timed_out"):
        return "timeout"
    if run.get("error"):
        return "error"
    code = run.get("exit")
    if code is None or code != 0:
        return "crashed"
    if ref_digest is not None and run.get("digest") != ref_digest:
        return "wrong-output"
    return "ok"


def prepare_bolt(prep: Prepared, ctx: Ctx, env: dict[str, str], log) -> bolt.BoltResult:
    if prep.bolt_na:
        return bolt.BoltResult(None, prep.bolt_na)
    if not prep.bolt_target:
        return bolt.BoltResult(None, "not applicable: no ELF to rewrite")
    train_key = prep.train_what + repr(prep.train_argv("X") if prep.train_argv else "")
    out_dir = ctx.cache / "bolt" / f"{prep.name}-{bolt.cache_key(prep.bolt_target, [train_key])}"
    out_name = prep.bolt_out_name or os.path.basename(prep.bolt_target)
    work = ctx.work / prep.name / "bolt-train"

    def record(perf_data: Path) -> str | None:
        if prep.kind == "server":
            return train_server(prep.binary, env, work, perf_data)
        assert prep.train_argv
        r = run_batch(bolt.perf_record_argv(perf_data, prep.train_argv(prep.binary)), env,
                      work, [], timeout=1800)
        return None if r["exit"] == 0 else f"exited {r['exit']}: {r['stderr_tail'][-200:]}"

    log(f"   BOLT: training on {prep.train_what}, perf2bolt, llvm-bolt on {prep.bolt_target}")
    res = bolt.optimise(prep.bolt_target, out_dir, record, out_name=out_name, log=log)
    if res.path and prep.kind == "batch" and prep.train_argv:
        # the rewritten program must do what the original does on the training input
        benv = bolt_env(prep, res.path, env)
        bin_ = prep.binary if prep.bolt_mode == "lib" else res.path
        a = run_batch(prep.train_argv(prep.binary), env, ctx.work / prep.name / "v-native",
                      [], timeout=1800)
        b = run_batch(prep.train_argv(bin_), benv, ctx.work / prep.name / "v-bolt", [],
                      timeout=1800)
        da = _dir_digest(ctx.work / prep.name / "v-native")
        db = _dir_digest(ctx.work / prep.name / "v-bolt")
        if b["exit"] != 0:
            last = [ln for ln in b["stderr_tail"].strip().splitlines() if ln.strip()]
            last = [ln for ln in last if "error" in ln or "fault" in ln.lower()] or last
            return bolt.BoltResult(None, f"BOLT's binary crashed on the training input "
                                   f"(exit {b['exit']}: {(last or ['no message'])[-1][:160]})",
                                   res.notes, res.seconds, res.profiled_functions)
        if a["exit"] == 0 and da != db:
            return bolt.BoltResult(None, "BOLT's binary gave wrong output on the training input",
                                   res.notes, res.seconds, res.profiled_functions)
    return res


def _dir_digest(d: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def bolt_env(prep: Prepared, path: str, env: dict[str, str]) -> dict[str, str]:
    if prep.bolt_mode != "lib":
        return env
    out = dict(env)
    d = os.path.dirname(path)
    out["LD_LIBRARY_PATH"] = d + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH")
                                  else "")
    return out


def run_workload(name: str, prep: Prepared, ctx: Ctx, wanted: list[str], pairs: int,
                 services: dict[str, Service | str], env: dict[str, str], entry: dict,
                 save: Callable[[], None], seed: int, log) -> None:
    """Prepare the configurations of one workload, then ``pairs`` alternated rounds
    (each round runs every available configuration once, in a random order), recording
    each run into ``entry`` and saving after every run."""
    entry.update(status="running", what=prep.what, binary=prep.binary, kind=prep.kind,
                 notes=list(prep.notes), configs={}, runs=[], pairs_planned=pairs)
    if prep.kind == "server":
        entry["duration_s"] = prep.duration_s
    cfgs: dict[str, dict] = entry["configs"]
    plan: dict[str, tuple[str, dict[str, str], Service | None]] = {}
    for c in wanted:
        if c == "native":
            plan[c] = (prep.binary, env, None)
            cfgs[c] = {"status": "available"}
        elif c in DBR_CONFIGS:
            svc = services.get(c)
            if isinstance(svc, Service):
                plan[c] = (prep.binary, svc.env(env), svc)
                cfgs[c] = {"status": "available"}
            else:
                cfgs[c] = {"status": "n/a", "reason": svc or "not started"}
        elif c == "pgo":
            if prep.pgo_binary:
                plan[c] = (prep.pgo_binary, env, None)
                cfgs[c] = {"status": "available", "binary": prep.pgo_binary}
            else:
                cfgs[c] = {"status": "n/a", "reason": prep.pgo_na}
        elif c == "bolt":
            t0 = time.monotonic()
            try:
                res = prepare_bolt(prep, ctx, env, log)
            except Exception as exc:  # noqa: BLE001 - a BOLT problem must not stop the rest
                res = bolt.BoltResult(None, f"failed: {exc!r}")
            cfgs[c] = {"bolt": res.to_json(), "prep_s": round(time.monotonic() - t0, 1)}
            if res.path:
                binary = prep.binary if prep.bolt_mode == "lib" else res.path
                plan[c] = (binary, bolt_env(prep, res.path, env), None)
                cfgs[c]["status"] = "available"
            else:
                cfgs[c].update(status="n/a", reason=res.reason)
            log(f"   BOLT: {res.path or res.reason} ({'; '.join(res.notes)})")
        save()
    # warm-up: one native run, the reference output and the timeout
    wdir = ctx.work / name
    log("   native warm-up run")
    if prep.kind == "server":
        # the check's replies do not depend on how long the load ran (it starts with
        # FLUSHALL): a 15 s warm-up gives the reference
        ref = run_server(prep.binary, env, wdir / "run", min(prep.duration_s, 15.0))
    else:
        ref = run_batch(prep.argv(prep.binary), env, wdir / "run", prep.outputs, timeout=3600)
    ref_status = classify(ref, None)
    entry["warmup"] = {k: ref.get(k) for k in ("wall_s", "cpu_s", "exit", "rps")}
    if ref_status != "ok":
        entry.update(status="failed", reason=f"the native warm-up run {ref_status} "
                     f"(exit {ref.get('exit')}): {ref.get('stderr_tail', '')[-300:]}")
        save()
        return
    ref_digest = ref["digest"]
    timeout = max(120.0, 4 * ref["wall_s"])
    log(f"   native: {ref['wall_s']:.1f} s" + (f", {ref['rps']:.0f} req/s" if ref.get("rps")
                                                 else ""))
    rng = random.Random(seed)
    for pair in range(pairs):
        order = [c for c in wanted if c in plan]
        rng.shuffle(order)
        for c in order:
            binary, cenv, svc = plan[c]
            cpu0 = svc.cpu_s() if svc else None
            if prep.kind == "server":
                run = run_server(binary, cenv, wdir / "run", prep.duration_s, service=svc)
            else:
                run = run_batch(prep.argv(binary), cenv, wdir / "run", prep.outputs, timeout)
            rec = {"pair": pair, "config": c, **{k: v for k, v in run.items()
                                                  if k not in ("digest",)}}
            rec["status"] = classify(run, ref_digest)
            if svc is not None:
                cpu1 = svc.cpu_s()
                rec["service_cpu_s"] = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None \
                    else None
                rec["report"] = svc.report(run["pid"], run["wall_s"], run.get("exit") or 0)
                cpu2 = svc.cpu_s()  # the report's own cost is not the program's
                if cpu2 is not None and cpu1 is not None:
                    rec["service_cpu_report_s"] = cpu2 - cpu1
            if rec["status"] == "ok":
                rec.pop("stderr_tail", None)
            entry["runs"].append(rec)
            log(f"   pair {pair + 1}/{pairs} {c:15s} {_run_line(rec)}")
            save()
        entry["pairs_done"] = pair + 1
        save()
    entry["status"] = "done"
    save()


def _run_line(rec: dict) -> str:
    s = f"{rec['wall_s']:7.2f} s  cpu {rec.get('cpu_s') or 0:6.2f} s"
    if rec.get("rps"):
        s += f"  {rec['rps']:8.0f} req/s"
    rep = rec.get("report") or {}
    if "service_cpu_s" in rec and rec["service_cpu_s"] is not None:
        s += f"  svc {rec['service_cpu_s']:5.2f} s"
    if rep.get("time_to_first_patch_s") is not None:
        s += f"  1st patch {rep['time_to_first_patch_s']:.2f} s"
    if rep.get("share_in_replacement") is not None:
        s += f"  in repl {rep['share_in_replacement'] * 100:.0f} %"
    if rep.get("regions_installed") is not None:
        s += f"  regions {rep['regions_installed']}"
    if rec["status"] != "ok":
        s += f"  ** {rec['status'].upper()} (exit {rec.get('exit')})"
    return s
