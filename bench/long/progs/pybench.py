"""A pyperformance-like set of pure-Python benchmarks for the long benchmark.

usage: python3.11 pybench.py SCALE
Each benchmark runs a fixed amount of work times SCALE and prints one checksum line;
the output is deterministic (no time, no hash randomisation of the checksums)."""

import json
import math
import re
import sys
import zlib


# ------------------------------------------------------------------ richards (short)
class Task:
    def __init__(self, ident, prio, queue, fn):
        self.ident, self.prio, self.queue, self.fn = ident, prio, queue, fn
        self.hold = False
        self.wait = False
        self.count = 0


def richards(n):
    """A small scheduler in the spirit of Richards: tasks with priorities exchanging
    packets; the result is the count of packets handled by each task."""
    total = 0
    for rep in range(n):
        queues = [[] for _ in range(6)]
        tasks = []
        for i in range(6):
            tasks.append(Task(i, (i * 7 + rep) % 10, queues[i], None))
        for p in range(40):
            queues[p % 6].append([p, 0, [0] * 4])
        steps = 0
        while steps < 2000:
            tasks.sort(key=lambda t: (-t.prio, t.ident))
            ran = False
            for t in tasks:
                if t.queue and not t.hold:
                    pkt = t.queue.pop(0)
                    pkt[1] += 1
                    for k in range(4):
                        pkt[2][k] = (pkt[2][k] + t.ident + k) & 0xFF
                    t.count += 1
                    dest = (t.ident + pkt[0] + pkt[1]) % 6
                    queues[dest].append(pkt)
                    t.prio = (t.prio + pkt[1]) % 10
                    t.hold = (pkt[1] % 5 == 0)
                    ran = True
                    break
                t.hold = False
            if not ran:
                for t in tasks:
                    t.hold = False
            steps += 1
        total += sum(t.count * (t.ident + 1) for t in tasks)
    return total


# ------------------------------------------------------------------ nbody
SOLAR_MASS = 4 * math.pi * math.pi
DAYS = 365.24


def _bodies():
    return [
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], SOLAR_MASS],
        [[4.84143144246472090e+00, -1.16032004402742839e+00, -1.03622044471123109e-01],
         [1.66007664274403694e-03 * DAYS, 7.69901118419740425e-03 * DAYS,
          -6.90460016972063023e-05 * DAYS], 9.54791938424326609e-04 * SOLAR_MASS],
        [[8.34336671824457987e+00, 4.12479856412430479e+00, -4.03523417114321381e-01],
         [-2.76742510726862411e-03 * DAYS, 4.99852801234917238e-03 * DAYS,
          2.30417297573763929e-05 * DAYS], 2.85885980666130812e-04 * SOLAR_MASS],
        [[1.28943695621391310e+01, -1.51111514016986312e+01, -2.23307578892655734e-01],
         [2.96460137564761618e-03 * DAYS, 2.37847173959480950e-03 * DAYS,
          -2.96589568540237556e-05 * DAYS], 4.36624404335156298e-05 * SOLAR_MASS],
        [[1.53796971148509165e+01, -2.59193146099879641e+01, 1.79258772950371181e-01],
         [2.68067772490389322e-03 * DAYS, 1.62824170038242295e-03 * DAYS,
          -9.51592254519715870e-05 * DAYS], 5.15138902046611451e-05 * SOLAR_MASS],
    ]


def nbody(n):
    bodies = _bodies()
    pairs = [(bodies[i], bodies[j]) for i in range(5) for j in range(i + 1, 5)]
    dt = 0.01
    for _ in range(n):
        for ([x1, y1, z1], v1, m1), ([x2, y2, z2], v2, m2) in pairs:
            dx, dy, dz = x1 - x2, y1 - y2, z1 - z2
            mag = dt * ((dx * dx + dy * dy + dz * dz) ** -1.5)
            b1m, b2m = m1 * mag, m2 * mag
            v1[0] -= dx * b2m
            v1[1] -= dy * b2m
            v1[2] -= dz * b2m
            v2[0] += dx * b1m
            v2[1] += dy * b1m
            v2[2] += dz * b1m
        for r, [vx, vy, vz], m in bodies:
            r[0] += dt * vx
            r[1] += dt * vy
            r[2] += dt * vz
    e = 0.0
    for i, (r, v, m) in enumerate(bodies):
        e += 0.5 * m * (v[0] ** 2 + v[1] ** 2 + v[2] ** 2)
        for r2, v2, m2 in bodies[i + 1:]:
            e -= m * m2 / math.sqrt(sum((a - b) ** 2 for a, b in zip(r, r2)))
    return f"{e:.9f}"


# ------------------------------------------------------------------ float
class Point:
    __slots__ = ("x", "y", "z")

    def __init__(self, i):
        self.x = x = math.sin(i)
        self.y = math.cos(i) * 3
        self.z = (x * x) / 2

    def normalize(self):
        norm = math.sqrt(self.x * self.x + self.y * self.y + self.z * self.z)
        self.x /= norm
        self.y /= norm
        self.z /= norm

    def maximize(self, other):
        self.x = self.x if self.x > other.x else other.x
        self.y = self.y if self.y > other.y else other.y
        self.z = self.z if self.z > other.z else other.z
        return self


def float_bench(n):
    acc = 0.0
    for rep in range(n):
        pts = [Point(i + rep) for i in range(2000)]
        for p in pts:
            p.normalize()
        m = pts[0]
        for p in pts[1:]:
            m = m.maximize(p)
        acc += m.x + m.y + m.z
    return f"{acc:.9f}"


# ------------------------------------------------------------------ json
def json_bench(n):
    doc = {"key%d" % i: [i, str(i) * 3, {"f": i / 7.0, "t": i % 2 == 0, "n": None,
                                          "s": "caf\u00e9 %d" % i}] for i in range(300)}
    crc = 0
    for i in range(n):
        doc["iter"] = i
        s = json.dumps(doc, sort_keys=True)
        back = json.loads(s)
        crc = zlib.crc32(s.encode(), crc)
        crc ^= len(back)
    return crc


# ------------------------------------------------------------------ regex
TEXT = " ".join("user%d@host%d.example.org 2024-%02d-%02d value=%d.%d GET /p/%d?q=%x"
                % (i, i % 17, i % 12 + 1, i % 28 + 1, i * 7, i % 10, i, i * 31)
                for i in range(400))
PATTERNS = [re.compile(p) for p in (
    r"[\w.]+@[\w.]+\.org", r"\d{4}-\d{2}-\d{2}", r"value=(\d+)\.(\d)",
    r"GET (/\S+)", r"q=([0-9a-f]+)", r"(?i)HOST1[0-6]", r"(\w+)=(\w+)")]


def regex_bench(n):
    total = 0
    for i in range(n):
        for p in PATTERNS:
            total += len(p.findall(TEXT))
        total += len(re.sub(r"\d+", lambda m: str(len(m.group())), TEXT[: 2000 + i % 100]))
        total += len(TEXT.split("value="))
    return total


# ------------------------------------------------------------------ deltablue-like
class Var:
    def __init__(self, name, value):
        self.name, self.value = name, value
        self.constraints = []
        self.determined_by = None
        self.stay = True


class EqPlus:
    """out = a + b, or a = out - b, whichever direction the planner picks."""

    def __init__(self, a, b, out, strength):
        self.a, self.b, self.out, self.strength = a, b, out, strength
        for v in (a, b, out):
            v.constraints.append(self)

    def execute(self, forward):
        if forward:
            self.out.value = self.a.value + self.b.value
        else:
            self.a.value = self.out.value - self.b.value


def deltablue(n):
    chk = 0
    for rep in range(n):
        vs = [Var("v%d" % i, i) for i in range(120)]
        cs = [EqPlus(vs[i], vs[i + 1], vs[i + 2], (i + rep) % 4) for i in range(118)]
        for step in range(20):
            vs[0].value = step + rep
            plan = sorted(cs, key=lambda c: (c.strength, id(c) if False else 0))
            for c in plan:
                c.execute(forward=(c.strength + step) % 3 != 0)
            chk = (chk * 31 + sum(v.value for v in vs[::7])) % 1000000007
    return chk


# ------------------------------------------------------------------ chaos-like
class Spline:
    def __init__(self, points, degree):
        self.points, self.degree = points, degree
        k = len(points) + degree + 1
        self.knots = [0] * (degree + 1) + list(range(1, k - 2 * (degree + 1) + 1)) + \
            [k - 2 * (degree + 1) + 1] * (degree + 1)

    def __call__(self, u):
        d = self.degree
        i = d
        while i < len(self.knots) - d - 2 and self.knots[i + 1] <= u:
            i += 1
        pts = [list(p) for p in self.points[i - d:i + 1]]
        for r in range(1, d + 1):
            for j in range(d, r - 1, -1):
                lo, hi = self.knots[i - d + j], self.knots[i + 1 + j - r]
                a = 0.0 if hi == lo else (u - lo) / (hi - lo)
                pts[j] = [(1 - a) * pts[j - 1][t] + a * pts[j][t] for t in range(2)]
        return pts[d]


def chaos(n):
    pts = [(math.cos(i) * (i % 5 + 1), math.sin(i * 1.3) * (i % 3 + 1)) for i in range(12)]
    sp = Spline(pts, 3)
    top = sp.knots[-1]
    x, y = 0.5, 0.5
    seed = 12345
    grid = {}
    for _ in range(n):
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        u = (seed % 10007) / 10007.0 * top * 0.999
        px, py = sp(u)
        x, y = (x + px) / 2, (y + py) / 2
        cell = (int(x * 50), int(y * 50))
        grid[cell] = grid.get(cell, 0) + 1
    return sum(k[0] * 31 + k[1] * v for k, v in sorted(grid.items())) & 0xFFFFFFFF


# ------------------------------------------------------------------ generators
def _gen_tree(depth, base):
    if depth == 0:
        yield base
        return
    yield from _gen_tree(depth - 1, base * 2)
    yield from _gen_tree(depth - 1, base * 2 + 1)


def generators(n):
    total = 0
    for i in range(n):
        total += sum(x for x in _gen_tree(10, i) if x & 3)
        total += sum(a * b for a, b in zip(range(500), (j * j for j in range(500))))
    return total


# ------------------------------------------------------------------ unpack_sequence
def unpack_sequence(n):
    t = tuple(range(10))
    lst = list(range(10))
    s = 0
    for _ in range(n):
        for _ in range(100):
            a, b, c, d, e, f, g, h, i, j = t
            s += a + j
            a, b, c, d, e, f, g, h, i, j = lst
            s += b + i
            (a, b), (c, d) = (c, d), (a, b)
            s += a - d
    return s


BENCHES = [
    ("richards", richards, 25),
    ("nbody", nbody, 33000),
    ("float", float_bench, 100),
    ("json", json_bench, 170),
    ("regex", regex_bench, 50),
    ("deltablue", deltablue, 200),
    ("chaos", chaos, 20000),
    ("generators", generators, 200),
    ("unpack_sequence", unpack_sequence, 7000),
]


def main():
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    only = sys.argv[2:]
    for name, fn, base in BENCHES:
        if only and name not in only:
            continue
        print(f"{name} {fn(max(1, int(base * scale)))}", flush=True)


if __name__ == "__main__":
    main()
