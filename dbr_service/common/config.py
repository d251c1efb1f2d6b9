"""Service configuration: one typed dataclass, layered defaults < file < environment < -o.

Every key is a field of :class:`Config` with its documentation in the field's
metadata.  Sources, lowest precedence first:

1. the defaults below (optionally overlaid with the ``--aggressive`` preset),
2. a TOML file (``-c FILE``; ``/etc/dbr/dbr.toml`` when present and none given),
3. the environment, ``DBR_<KEY>`` upper-case (``DBR_SNAPSHOT_INTERVAL_S=0.5``),
4. ``-o KEY=VALUE`` options, in order.

Unknown keys and bad values raise :class:`ConfigError` naming the key and the
source.  A loaded Config is immutable; :meth:`Config.replace_value` returns a new one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbr_service.common.errors import ConfigError
from dbr_service.common.paths import resolve_runtime_dir, resolve_state_dir

DEFAULT_CONFIG_FILE = "/etc/dbr/dbr.toml"
SAMPLING_SOURCES = ("auto", "perf", "agent-timer")
POLICIES = ("keep", "revert")


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


PATCH_VARIANTS = ("int3", "self-branch", "single")


@dataclass(frozen=True)
class Config:
    """All tunables of the service; see docs/operators.md for the long form."""

    snapshot_interval_s: float = field(default=1.0, metadata=_doc(
        "seconds between the starts of two sampling snapshots", min=0.01))
    snapshot_window_s: float = field(default=0.2, metadata=_doc(
        "seconds each snapshot samples for (<= snapshot_interval_s)", min=0.005))
    snapshot_backoff_max_s: float = field(default=8.0, metadata=_doc(
        "longest interval between a quiet client's snapshots: a client whose last "
        "snapshots changed nothing is sampled half as often each time, up to this "
        "(<= snapshot_interval_s: never backs off)", min=0.0))
    min_client_age_s: float = field(default=1.0, metadata=_doc(
        "seconds a client must have run before its first sampling window: a program "
        "that ends sooner could not gain from replacement code, so it pays nothing for "
        "sampling (0: from its first snapshot)", min=0.0))
    short_run_s: float = field(default=3.0, metadata=_doc(
        "a program whose last 3 runs each ended within this many seconds of their start "
        "with nothing installed gets its agent's thread only at this age in its next "
        "runs: those that end as soon pay for no thread, session or sampling (above "
        "min_client_age_s to apply; 0: never)", min=0.0, max=5.0))
    short_run_memory_s: float = field(default=600.0, metadata=_doc(
        "seconds a program stays born late (short_run_s) before the service looks at "
        "its runs again; a run that lives longer, or has a region installed, ends it "
        "at once, and after a run with a region installed the program is not born late "
        "for this long (0: never born late)", min=0.0))
    continuous_sampling: bool = field(default=False, metadata=_doc(
        "sample all the time instead of one window per interval"))
    sample_period_us: int = field(default=1000, metadata=_doc(
        "sampling period per thread, microseconds of CPU time", min=50, max=1_000_000))
    perf_max_switch_rate: float = field(default=2000.0, metadata=_doc(
        "a client thread that gives up its CPU more often than this a second gets no "
        "perf event (each switch of a sampled thread costs it ~11 us on a VM's "
        "software clock); 0: every thread is sampled", min=0.0))
    short_thread_memory_s: float = field(default=3600.0, metadata=_doc(
        "seconds the service remembers a program (executable and build id) whose "
        "threads proved too short-lived to sample: its later windows, in the same run "
        "or a later one, ask for no thread notices (0: ask in every window)", min=0.0))
    gated_thread_timer: bool = field(default=True, metadata=_doc(
        "sample the threads perf_max_switch_rate leaves without a perf event with the "
        "agent's CPU-time timer instead (no cost per switch; a signal per "
        "sample_period_us of their CPU time, which can make a blocking call it lands in "
        "return EINTR); false: leave them unsampled"))
    sampling_source: str = field(default="auto", metadata=_doc(
        "auto | perf | agent-timer (auto and perf: branch stacks where the host has them, "
        "else the perf clock; auto: agent-timer when perf is refused)",
        choices=SAMPLING_SOURCES))
    hot_threshold: float = field(default=0.01, metadata=_doc(
        "fraction of a client's samples an address needs to be a hot spot (region "
        "selection gets it as a sample count)", min=0.0, max=1.0))
    jumps_from_hot_limit: int = field(default=4, metadata=_doc(
        "conditional jumps away from a sampled block that discovery follows", min=0, max=64))
    min_loop_trip_count: int = field(default=16, metadata=_doc(
        "super-regions whose loops iterate fewer times than this are dropped", min=0))
    entry_sites: bool = field(default=False, metadata=_doc(
        "let a function's first instructions (together 5 bytes or more) be one patch "
        "site when discovery saw no branch into bytes 1-4; off by default: code "
        "discovery never decoded may branch there (glibc's __mempcpy_* jumps to "
        "__memcpy_*+3), and a thread landing there runs the middle of the jump"))
    hot_function_threshold: float = field(default=0.005, metadata=_doc(
        "fraction of a client's samples a function patched at its entry needs to be "
        "kept as a region without a hot loop (its hot blocks copied, calling other "
        "copies for real); 0: regions need a hot loop", min=0.0, max=1.0))
    hot_text: bool = field(default=False, metadata=_doc(
        "whole-program hot text: every function whose blocks hold hot_text_min_share of "
        "the client's samples is a hot function, hottest first up to hot_text_max_bytes "
        "of copied code; discovery also starts at the entries of the functions holding "
        "samples, which are patched there, as entry sites where need be (a site into "
        "whose bytes 1-4 a direct branch anywhere in its module may lead is refused), "
        "and where a call that leaves a copy returns to; "
        "selection sees the last 24 snapshots instead of 4, first jobs have no block "
        "bound"))
    hot_text_min_share: float = field(default=0.0005, metadata=_doc(
        "with hot_text: fraction of a client's samples a function needs to be copied "
        "(the lower of it and hot_function_threshold applies)", min=0.0, max=1.0))
    hot_text_max_bytes: int = field(default=262144, metadata=_doc(
        "with hot_text: most bytes of original code copied as hot functions per job, "
        "hottest functions first (regions with a hot loop do not count)",
        min=0, max=1 << 26))
    min_region_size: int = field(default=16, metadata=_doc(
        "super-regions with fewer bytes of original code are dropped", min=0))
    inline: bool = field(default=True, metadata=_doc(
        "clone hot callees into their callers' copies; false: every call stays a call "
        "(a real call under real_calls), e.g. to keep a callee's own frame for "
        "debugging or tests"))
    inline_budget: float = field(default=1.0, metadata=_doc(
        "inlining growth per super-region as a ratio of its body bytes (1.0 = double)",
        min=0.0, max=64.0))
    real_calls: bool = field(default=True, metadata=_doc(
        "keep direct calls that are not inlined as real calls in replacement code (to "
        "the original callee), and promote hot same-module targets of indirect calls "
        "to compare + direct call, with unwind information for the copies (a region "
        "whose CFI cannot be made is installed without its real calls); false: every "
        "call not inlined leaves replacement code"))
    service_cpu_budget: float = field(default=0.05, metadata=_doc(
        "most service CPU (region jobs in worker processes plus the client's session "
        "thread) spent on one client, as a fraction of that client's own CPU time over "
        "service_cpu_window_s; a client over it keeps its installed regions and its "
        "jobs wait (0: no limit)", min=0.0, max=100.0))
    service_cpu_window_s: float = field(default=60.0, metadata=_doc(
        "seconds of the sliding window service_cpu_budget is measured over", min=1.0,
        max=86400.0))
    service_cpu_startup_s: float = field(default=0.0, metadata=_doc(
        "seconds after a client connects during which service_cpu_startup_budget applies "
        "instead of service_cpu_budget (its first regions come sooner; what it spends "
        "still counts in the window after)", min=0.0, max=3600.0))
    service_cpu_startup_budget: float = field(default=1.0, metadata=_doc(
        "the budget (fraction of the client's CPU) during service_cpu_startup_s (0: "
        "no limit)", min=0.0, max=100.0))
    job_backoff_max_s: float = field(default=30.0, metadata=_doc(
        "longest wait between two region jobs of a client whose jobs keep finding "
        "nothing new: the wait doubles from snapshot_interval_s after each such job; a "
        "snapshot whose hot addresses were all (at half the threshold) hot at the last "
        "job runs no job at all", min=0.0, max=86400.0))
    max_workers: int = field(default=0, metadata=_doc(
        "worker processes (0 = from CPU count and load)", min=0, max=256))
    worker_nice: int = field(default=19, metadata=_doc(
        "niceness of the worker processes (0-19): at 19 they take CPU time clients "
        "leave idle, not the clients' own", min=0, max=19))
    allowed_uids: tuple[int, ...] | None = field(default=None, metadata=_doc(
        "uids whose agents may connect (unset: root and the service's uid); "
        "comma-separated in the environment and -o, empty means nobody"))
    max_handshakes: int = field(default=64, metadata=_doc(
        "agent connections allowed in their handshake at once; more are refused "
        "(ERROR E_LIMIT) and closed at once", min=1, max=100_000))
    max_sessions_per_uid: int = field(default=1024, metadata=_doc(
        "sessions (live and in their handshake) one uid may hold; more are refused "
        "(ERROR E_LIMIT) and closed at once", min=1, max=1_000_000))
    on_disconnect: str = field(default="keep", metadata=_doc(
        "keep | revert: what an agent does with its patches when the service goes away",
        choices=POLICIES))
    on_shutdown: str = field(default="keep", metadata=_doc(
        "keep | revert: what the service asks agents to do when it stops",
        choices=POLICIES))
    map_wait_ms: int = field(default=200, metadata=_doc(
        "bound an agent waits for the service's ACK of a map change", min=0, max=60_000))
    runtime_dir: str = field(default="", metadata=_doc(
        "socket directory (empty: $DBR_RUNTIME_DIR, /run/dbr as root, "
        "else $XDG_RUNTIME_DIR/dbr)"))
    state_dir: str = field(default="", metadata=_doc(
        "directory of the profile store, profiles.db (empty: $DBR_STATE_DIR, "
        "/var/lib/dbr as root, else $XDG_STATE_HOME/dbr or ~/.local/state/dbr)"))
    warm_start: bool = field(default=True, metadata=_doc(
        "keep each client's profile in the profile store (state_dir) and, for a program "
        "whose executable has stored hot text, have its agents connect at their start and "
        "its first region job select from the stored profile at once; false: no store"))
    profile_half_life_s: float = field(default=7 * 86400.0, metadata=_doc(
        "half-life of a module's stored sample counts: when a run is merged, the "
        "counts already stored are multiplied by 0.5^(age / this), age being the time "
        "since the module was last seen", min=60.0, max=10 * 365 * 86400.0))
    profile_expiry_s: float = field(default=30 * 86400.0, metadata=_doc(
        "a module's stored profile not seen for this long is deleted when the store "
        "is opened for writing (0: never)", min=0.0, max=10 * 365 * 86400.0))
    socket_group: str = field(default="", metadata=_doc(
        "group allowed to use the sockets (runtime dir 0750 then); empty: none"))
    agent_ring_entries: int = field(default=8192, metadata=_doc(
        "entries of the agent-timer sample ring (power of two)", min=64, max=1 << 22))
    hotspots_kept: int = field(default=256, metadata=_doc(
        "hot spots remembered per client", min=1, max=100_000))
    patching: bool = field(default=True, metadata=_doc(
        "install replacement code (false: sample and select regions only)"))
    transfer: bool = field(default=True, metadata=_doc(
        "move threads found in the original code of a newly installed region into its "
        "replacement code (agent TRANSFER), and install regions whose loops have no "
        "patch point (entered by transfer only)"))
    evict: bool = field(default=True, metadata=_doc(
        "move threads inside a region's replacement code back to its original code "
        "(agent EVICT) when a speed check takes the region out, when a check finds it "
        "slower and when the operator unpatches it; false: they finish there"))
    patch_variant: str = field(default="int3", metadata=_doc(
        "int3 | self-branch | single: the agent's cross-modifying-code protocol "
        "(docs/architecture.md, invariant 5); single is opt-in only", choices=PATCH_VARIANTS))
    speed_check: bool = field(default=True, metadata=_doc(
        "measure whether newly installed regions make the program faster: their patches "
        "are taken out and put back in alternated phases while the program's I/O bytes "
        "per CPU second are compared; regions found slower are removed for good "
        "(programs with little I/O cannot be measured and keep their regions)"))
    speed_check_phase_s: float = field(default=0.5, metadata=_doc(
        "seconds of each phase of a speed check", min=0.05, max=60.0))
    speed_check_pairs: int = field(default=6, metadata=_doc(
        "pairs of phases (with and without the regions) in a speed check", min=2, max=100))
    speed_check_margin: float = field(default=0.03, metadata=_doc(
        "a speed check calls regions slower (or faster) only when the ratio of progress "
        "rates (geometric mean over its pairs) is beyond 1 -/+ this and its 95 % "
        "interval excludes 1", min=0.0, max=0.5))
    profile: str = field(default="sample", metadata=_doc(
        "sample | count | auto: where region layouts get their counts.  sample: from "
        "the samples; count: every region first runs as a counting region (a counter "
        "per block entry and branch side) until its hottest block is promoted "
        "(count_threshold_*) or count_phase_max_s, then is replaced by a region laid "
        "out and pruned from the exact counts; auto: counting only for regions whose "
        "samples are too thin (count_thin_samples)",
        choices=("sample", "count", "auto")))
    count_threshold_direct: int = field(default=3000, metadata=_doc(
        "entries that promote a block reached by direct branches (profile=count/auto): "
        "the counting phase ends once a block of the region is promoted",
        min=1, max=1 << 40))
    count_threshold_indirect: int = field(default=5000, metadata=_doc(
        "entries that promote a block that is the target of an indirect jump or call "
        "in its region", min=1, max=1 << 40))
    count_phase_max_s: float = field(default=10.0, metadata=_doc(
        "longest counting phase of a region: then it is replaced from the counts it has",
        min=0.05, max=3600.0))
    count_poll_ms: int = field(default=50, metadata=_doc(
        "longest interval between two reads of a counting region's counters: the "
        "monitor reads a region 1 ms after its install, then when its counts so far "
        "say a block reaches its threshold (at least 1 ms apart)",
        min=1, max=10_000))
    count_thin_samples: float = field(default=4.0, metadata=_doc(
        "profile=auto: a region whose blocks hold fewer samples than this on average "
        "(its inlined clones not counted) is too thin to lay out and is counted first",
        min=0.0, max=1e9))
    perf_map: bool = field(default=True, metadata=_doc(
        "write /tmp/perf-PID.map naming replacement code (unless another writer owns it)"))
    log_level: str = field(default="info", metadata=_doc(
        "debug | info | warning | error",
        choices=("debug", "info", "warning", "error")))

    # ------------------------------------------------------------------ access
    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_of(cls, key: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == key:
                return f
        raise ConfigError(f"unknown configuration key {key!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["allowed_uids"] is not None:
            d["allowed_uids"] = list(d["allowed_uids"])
        return d

    def get(self, key: str) -> Any:
        self.field_of(key)
        return self.to_dict()[key]

    def replace_value(self, key: str, value: Any, source: str = "set") -> Config:
        """A copy with ``key`` set from a string or a typed value (validated)."""
        f = self.field_of(key)
        new = dataclasses.replace(self, **{key: _coerce(f, value, source)})
        new.validate()
        return new

    # --------------------------------------------------------------- derived
    def effective_runtime_dir(self, env: Mapping[str, str] | None = None) -> Path:
        """The runtime directory this configuration means (docs/architecture.md, "Interfaces
        users rely on": ``DBR_RUNTIME_DIR``)."""
        return resolve_runtime_dir(self.runtime_dir, env)

    def effective_state_dir(self, env: Mapping[str, str] | None = None) -> Path:
        """The profile store's directory this configuration means."""
        return resolve_state_dir(self.state_dir, env)

    def effective_allowed_uids(self) -> frozenset[int]:
        if self.allowed_uids is None:
            return frozenset({0, os.getuid()})
        return frozenset(self.allowed_uids)

    def validate(self) -> None:
        """Cross-field checks (per-field ones happen while coercing)."""
        if not self.continuous_sampling and self.snapshot_window_s > self.snapshot_interval_s:
            raise ConfigError(
                f"snapshot_window_s: {self.snapshot_window_s} is longer than "
                f"snapshot_interval_s {self.snapshot_interval_s}")
        n = self.agent_ring_entries
        if n & (n - 1):
            raise ConfigError(f"agent_ring_entries: {n} is not a power of two")


AGGRESSIVE: dict[str, Any] = {
    "snapshot_interval_s": 0.15,
    "snapshot_window_s": 0.1,
    "snapshot_backoff_max_s": 0.15,
    "min_client_age_s": 0.0,
    "sample_period_us": 500,
    "hot_threshold": 0.002,
    "min_loop_trip_count": 2,
    "min_region_size": 5,
    "jumps_from_hot_limit": 6,
    "worker_nice": 0,
    "service_cpu_startup_s": 10.0,
    "service_cpu_startup_budget": 0.0,
    "service_cpu_budget": 0.10,
    "job_backoff_max_s": 1.0,
}
"""The ``--aggressive`` preset: hot code is found (and later patched) within a second."""


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Turn a TOML value or a string into the field's type, checking its bounds."""
    key, meta = f.name, f.metadata

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{key}: {why} (from {source})")

    if key == "allowed_uids":
        return _coerce_uids(value, bad)
    typ = f.type if isinstance(f.type, type) else {"float": float, "int": int, "bool": bool,
                                                   "str": str}[f.type]
    if typ is bool:
        if isinstance(value, bool):
            out: Any = value
        elif isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            out = True
        elif isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            out = False
        else:
            raise bad(f"{value!r} is not a boolean (true/false)")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise bad(f"{value!r} is not an integer")
        try:
            out = int(value, 0) if isinstance(value, str) else value
        except ValueError:
            raise bad(f"{value!r} is not an integer") from None
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad(f"{value!r} is not a number")
        try:
            out = float(value)
        except ValueError:
            raise bad(f"{value!r} is not a number") from None
        if not math.isfinite(out):
            raise bad(f"{value!r} is not a finite number")
    else:
        if not isinstance(value, str):
            raise bad(f"{value!r} is not a string")
        out = value.strip()
    if "choices" in meta and out not in meta["choices"]:
        raise bad(f"{out!r} is not one of {', '.join(meta['choices'])}")
    if "min" in meta and out < meta["min"]:
        raise bad(f"{out!r} is below the minimum {meta['min']}")
    if "max" in meta and out > meta["max"]:
        raise bad(f"{out!r} is above the maximum {meta['max']}")
    return out


def _coerce_uids(value: Any, bad) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise bad(f"{value!r} is not a list of uids")
    uids = []
    for p in parts:
        try:
            uid = int(p) if not isinstance(p, bool) else None
        except (TypeError, ValueError):
            uid = None
        if uid is None or uid < 0:
            raise bad(f"{p!r} is not a uid")
        uids.append(uid)
    return tuple(sorted(set(uids)))


def parse_override(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (key, value); the key must exist."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"-o {text!r}: expected KEY=VALUE")
    Config.field_of(key)
    return key, value


@dataclass
class ConfigSources:
    """Where a configuration came from, so that SIGHUP can load it again."""

    file: str | None = None          # explicit -c FILE (None: the default file if present)
    overrides: tuple[str, ...] = ()  # -o KEY=VALUE, in order
    aggressive: bool = False
    env: Mapping[str, str] | None = None  # None: os.environ at load time

    def load(self) -> Config:
        return load_config(self.file, self.overrides, aggressive=self.aggressive, env=self.env)


def load_config(file: str | os.PathLike | None = None, overrides: Iterable[str] = (), *,
                aggressive: bool = False, env: Mapping[str, str] | None = None) -> Config:
    """Build a Config from every layer; raise ConfigError naming the first bad key."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(Config)}

    def put(key: str, raw: Any, source: str) -> None:
        if key not in fields:
            raise ConfigError(f"unknown configuration key {key!r} (from {source})")
        values[key] = _coerce(fields[key], raw, source)

    if aggressive:
        for k, v in AGGRESSIVE.items():
            put(k, v, "--aggressive")
    path = Path(file) if file else Path(DEFAULT_CONFIG_FILE)
    if file or path.exists():
        for k, v in _read_toml(path).items():
            put(k, v, str(path))
    # DBR_* variables that are not keys belong to other parts (the agent): skip them.
    for name, raw in env.items():
        key = name[4:].lower()
        if name.startswith("DBR_") and key in fields:
            put(key, raw, f"${name}")
    for text in overrides:
        key, raw = parse_override(text)
        put(key, raw, f"-o {key}")
    cfg = Config(**values)
    cfg.validate()
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"configuration file {path}: {exc}") from None
    # Accept either top-level keys or a [service] table.
    if set(data) == {"service"} and isinstance(data["service"], dict):
        data = data["service"]
    return data
