"""CPU-bound Python workload of the dbr benchmark suite: pure-Python interpreter
work (dicts, string ops, small-integer arithmetic, a tiny n-body step loop) over the
generated text input.  usage: python3 pywork.py FILE SCALE"""

import sys


def nbody(steps):
    bodies = [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 39.47],
              [4.84, -1.16, -0.10, 0.606, 2.81, -0.02, 0.037],
              [8.34, 4.12, -0.40, -1.01, 1.82, 0.008, 0.011],
              [12.89, -15.11, -0.22, 1.08, 0.868, -0.01, 0.0017],
              [15.37, -25.91, 0.179, 0.979, 0.594, -0.034, 0.002]]
    dt = 0.01
    for _ in range(steps):
        for i in range(5):
            bi = bodies[i]
            for j in range(i + 1, 5):
                bj = bodies[j]
                dx, dy, dz = bi[0] - bj[0], bi[1] - bj[1], bi[2] - bj[2]
                d2 = dx * dx + dy * dy + dz * dz
                mag = dt / (d2 * d2 ** 0.5)
                bi[3] -= dx * bj[6] * mag
                bi[4] -= dy * bj[6] * mag
                bi[5] -= dz * bj[6] * mag
                bj[3] += dx * bi[6] * mag
                bj[4] += dy * bi[6] * mag
                bj[5] += dz * bi[6] * mag
        for b in bodies:
            b[0] += dt * b[3]
            b[1] += dt * b[4]
            b[2] += dt * b[5]
    return sum(b[0] + b[1] + b[2] for b in bodies)


def textstats(data, rounds):
    counts = {}
    checksum = 0
    lines = data.splitlines()
    for r in range(rounds):
        for line in lines:
            if "," in line:
                parts = line.split(",")
                if len(parts) == 4:
                    checksum = (checksum * 31 + int(parts[2]) + r) & 0xFFFFFFFF
                    continue
            for w in line.lower().replace(".", " ").split():
                counts[w] = counts.get(w, 0) + 1
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:15]
    return checksum, len(counts), top


def main():
    path, scale = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with open(path, encoding="ascii", errors="replace") as f:
        data = f.read()
    checksum, nwords, top = textstats(data, scale)
    energy = nbody(20000 * scale)
    print(f"checksum {checksum} words {nwords} nbody {energy:.9f}")
    for w, c in top:
        print(w, c)


if __name__ == "__main__":
    main()
