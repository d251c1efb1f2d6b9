"""`dbr attach` on a real server under load: redis-server started without the agent,
loaded with redis-benchmark; throughput before the attach, while patched, and after
`dbr detach`, with replies checked in each phase and the text compared with its files
after the detach.

    python -m bench.attach_redis [--requests N] [--reps R] [--clients C] [--json FILE]
                                 [--service-opt OPT]...

The service runs with --aggressive unless --service-opt is given (redis's main thread
gives up its CPU at every request, so the default cadence takes minutes to gather the
samples a first region needs).

Needs redis-server and redis-benchmark (`make bench-setup`).  Every process it starts
(a service on a private runtime dir, redis-server, the load) runs on loopback and is
ended by pid.  Exit status: 0 measured with every check passing, 1 a check failed,
2 a tool is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resp(sock: socket.socket, *args: str) -> bytes:
    """One command over RESP; the reply's first line (or bulk value)."""
    out = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    sock.sendall(out.encode())
    buf = b""
    while b"\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n")
    if head.startswith(b"$") and head != b"$-1":
        n = int(head[1:])
        while len(rest) < n + 2:
            rest += sock.recv(65536)
        return rest[:n]
    return head


def _value(i: int) -> str:
    return f"v{i * 2654435761 % 1000003}-{i}"


def check_replies(port: int, write: bool = False) -> int:
    """Keys whose value is not the one written (SET first when ``write``)."""
    bad = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for i in range(KEYS):
            if write:
                _resp(s, "SET", f"attach:{i}", _value(i))
            if _resp(s, "GET", f"attach:{i}") != _value(i).encode():
                bad += 1
    return bad


def load(port: int, requests: int, clients: int) -> dict[str, float]:
    """One redis-benchmark run of SET and GET: requests per second of each."""
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c",
                          str(clients), "-n", str(requests), "-t", "set,get", "-r", "100000",
                          "--csv", "-q"], capture_output=True, text=True, timeout=300).stdout
    rps = {}
    for line in out.splitlines():
        parts = [p.strip('"') for p in line.split(",")]
        if len(parts) >= 2 and parts[0] in ("SET", "GET"):
            rps[parts[0]] = float(parts[1])
    return rps


def phase(port: int, reps: int, requests: int, clients: int) -> dict:
    runs = [load(port, requests, clients) for _ in range(reps)]
    return {op: {"median": statistics.median(r[op] for r in runs if op in r),
                 "runs": [r.get(op) for r in runs]} for op in ("SET", "GET")
            if all(op in r for r in runs)} | {"bad_replies": check_replies(port)}


def dbr(*args: str, rdir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dbr_service.commands.cli", *args], cwd=ROOT,
                          env=dict(os.environ, DBR_RUNTIME_DIR=rdir), capture_output=True,
                          text=True, timeout=120)


def _stop(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGTERM)
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        p.wait(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attach_redis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000, help="per redis-benchmark run")
    ap.add_argument("--reps", type=int, default=3, help="runs per phase (median reported)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--patch-wait", type=float, default=90.0,
                    help="most seconds of load to wait for a patch")
    ap.add_argument("--service-opt", action="append", metavar="OPT",
                    help="an option of `dbr service` (default: --aggressive)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    service_opts = args.service_opt or ["--aggressive"]
    missing = [t for t in ("redis-server", "redis-benchmark") if shutil.which(t) is None]
    if missing:
        print(f"attach_redis: {', '.join(missing)} not found (make bench-setup)",
              file=sys.stderr)
        return 2
    from dbr_service.commands.ctlclient import ControlClient

    rdir = tempfile.mkdtemp(prefix="dbr-attach-bench-")
    os.chmod(rdir, 0o755)
    port = _free_port()
    svc = redis = None
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBR_") and k != "LD_PRELOAD"}
    result: dict = {"schema": "dbr.bench.attach_redis/1", "requests": args.requests,
                    "reps": args.reps, "clients": args.clients}
    try:
        result["service_opts"] = service_opts
        svc = subprocess.Popen([sys.executable, "-m", "dbr_service.commands.cli", "service",
                                *service_opts], cwd=ROOT,
                               env=dict(os.environ, DBR_RUNTIME_DIR=rdir),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctl = ControlClient(rdir, timeout=2.0)
        deadline = time.monotonic() + 20
        while not ctl.answers(0.5):
            if time.monotonic() > deadline or svc.poll() is not None:
                raise RuntimeError("the service did not start")
            time.sleep(0.1)
        redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if check_replies(port, write=True) == 0:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer")
            time.sleep(0.1)
        result["before"] = phase(port, args.reps, args.requests, args.clients)

        t0 = time.monotonic()
        r = dbr("attach", str(redis.pid), rdir=rdir)
        result["attach"] = {"rc": r.returncode, "out": (r.stdout + r.stderr).strip(),
                            "s": round(time.monotonic() - t0, 3)}
        if r.returncode:
            raise RuntimeError(f"dbr attach failed: {r.stderr.strip()}")
        row: dict = {}
        deadline = time.monotonic() + args.patch_wait
        while time.monotonic() < deadline:
            load(port, args.requests // 4, args.clients)    # the load the service samples
            row = next((c for c in ctl.result("clients") if c["pid"] == redis.pid
                        and c["state"] == "connected"), {})
            if row.get("patches_installed"):
                break
        result["patched_after_s"] = round(time.monotonic() - t0, 1)
        result["during"] = phase(port, args.reps, args.requests, args.clients)
        row = next((c for c in ctl.result("clients") if c["pid"] == redis.pid), row)
        regions = ctl.result("regions", {"pid": redis.pid}).get("regions", [])
        result["client"] = {k: row.get(k) for k in ("attached", "patches_installed",
                                                    "regions_went_live", "samples",
                                                    "agent_thread", "thread_notices")}
        result["regions_installed"] = sum(1 for g in regions if g.get("state") == "installed")
        r = dbr("detach", str(redis.pid), "--json", rdir=rdir)
        result["detach"] = {"rc": r.returncode}
        with contextlib.suppress(ValueError):
            result["detach"] |= json.loads(r.stdout)
        result["after"] = phase(port, args.reps, args.requests, args.clients)
        result["redis_alive"] = redis.poll() is None
    finally:
        _stop(redis)
        _stop(svc)
        shutil.rmtree(rdir, ignore_errors=True)
    text = result.get("detach", {}).get("text", {})
    ok = (result["redis_alive"] and result["detach"]["rc"] == 0 and not text.get("differences")
          and bool(result["client"]["patches_installed"])
          and all(result[p]["bad_replies"] == 0 for p in ("before", "during", "after")))
    result["ok"] = ok
    for p in ("before", "during", "after"):
        print(f"{p:7s} SET {result[p]['SET']['median']:>10.0f}/s  GET "
              f"{result[p]['GET']['median']:>10.0f}/s  bad replies {result[p]['bad_replies']}")
    print(f"patched {result['patched_after_s']} s after the attach: "
          f"{result['client']['patches_installed']} patches, "
          f"{result['regions_installed']} regions installed at the end of 'during'; "
          f"detach: {text.get('mappings')} mappings compared, "
          f"{len(text.get('differences', []))} differ")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
