"""A large, self-contained C file for the cc1 workload (deterministic for a given size)."""

from __future__ import annotations

import random

HEADER = """\
typedef unsigned long size_t;
typedef struct node { int key; long val; struct node *left, *right; double w[4]; } node;
typedef struct vec { double x, y, z; } vec;
static inline vec vadd(vec a, vec b) { vec r = { a.x + b.x, a.y + b.y, a.z + b.z }; return r; }
static inline double vdot(vec a, vec b) { return a.x * b.x + a.y * b.y + a.z * b.z; }
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
extern void *memcpy(void *, const void *, size_t);
extern int printf(const char *, ...);
"""


def _expr(r: random.Random, vars_: list[str], depth: int = 0) -> str:
    if depth > 2 or r.random() < 0.3:
        return r.choice(vars_ + [str(r.randint(1, 97))])
    op = r.choice(["+", "-", "*", "^", "&", "|", "<<", ">>", "%"])
    a, b = _expr(r, vars_, depth + 1), _expr(r, vars_, depth + 1)
    if op in ("<<", ">>"):
        b = str(r.randint(1, 7))
    if op == "%":
        b = f"(({b}) | 1)"
    return f"({a} {op} {b})"


def _function(r: random.Random, i: int) -> str:
    kind = i % 6
    v = ["a", "b", "c", "i", "j", "acc"]
    body = []
    if kind == 0:  # nested loops over arrays
        body.append(f"long acc = {r.randint(0, 9)}; int i, j;")
        body.append(f"for (i = 0; i < n; i++) {{ for (j = 0; j < {r.randint(3, 9)}; j++) {{")
        for _ in range(r.randint(3, 7)):
            body.append(f"  acc += {_expr(r, v)}; a = (int)(acc ^ b);")
        body.append("  if (acc > 1000000) acc -= b; } arr[i % 64] = (int)acc; }")
        body.append("return acc + arr[n % 64];")
        sig = f"long f{i}(int a, int b, int c, int n, int *arr)"
    elif kind == 1:  # switch state machine
        body.append("long acc = 0; int i, j = 0;")
        body.append("for (i = 0; i < n; i++) { switch ((a + i) %% %d) {" % (r.randint(6, 14)))
        for k in range(r.randint(6, 14)):
            body.append(f"  case {k}: acc += {_expr(r, v)}; j += {k}; break;")
        body.append("  default: acc -= j; } if (acc & 1) b ^= (int)acc; }")
        body.append("return acc + b + c;")
        sig = f"long f{i}(int a, int b, int c, int n, int *arr)"
    elif kind == 2:  # tree walk with struct fields
        body.append("long acc = 0; int i = 0, j = 0;")
        body.append("while (t && i < n) { acc += t->key * " + str(r.randint(2, 9)) + ";")
        body.append(f"  t->w[i & 3] += (double)acc / {r.randint(3, 17)}.0;")
        body.append("  if ((acc ^ a) & 1) t = t->left; else t = t->right; i++; j += t->key;")
        body.append(f"  if (i % {r.randint(3, 8)} == 0) acc = {_expr(r, v)}; }}")
        body.append("return acc + j;")
        sig = f"long f{i}(node *t, int a, int b, int c, int n)"
    elif kind == 3:  # floating point vectors
        body.append("vec s = {0, 0, 0}; double d = 0; int i;")
        body.append("for (i = 0; i < n; i++) { vec p = v[i % 32];")
        for _ in range(r.randint(2, 5)):
            body.append(f"  p.x = p.x * {r.random():.4f} + p.y; p.y -= p.z * {r.random():.4f};")
            body.append("  s = vadd(s, p); d += vdot(s, p);")
        body.append("  if (d > 1e9) d = d / 3.0; }")
        body.append("return d + s.x;")
        sig = f"double f{i}(vec *v, int n)"
    elif kind == 4:  # string-ish byte processing
        body.append("unsigned h = %du; int i, k = 0;" % r.randint(1, 1 << 30))
        body.append("for (i = 0; i < n && s[i]; i++) { unsigned char ch = s[i];")
        body.append(f"  if (ch >= 'a' && ch <= 'z') h = h * {r.choice([31, 33, 131])} + ch;")
        body.append(f"  else if (ch == '{chr(r.randint(65, 90))}') k++;")
        body.append(f"  else h ^= (h << {r.randint(1, 7)}) + (h >> {r.randint(1, 7)}) + ch;")
        body.append("  out[i & 127] = (char)(h & 0x7f); }")
        body.append("return h + k;")
        sig = f"unsigned f{i}(const char *s, char *out, int n)"
    else:  # calls into earlier functions, inlining candidates
        body.append("long acc = 0; int i;")
        body.append("for (i = 0; i < n; i++) {")
        for _ in range(r.randint(2, 5)):
            j = r.randrange(max(1, i - 50), i) if i > 0 else 0
            j -= j % 6
            body.append(f"  acc += f{j}(a + i, b, c, imin(n, 8), arr);")
        body.append(f"  a = imax(a, (int)(acc % {r.randint(100, 999)})); }}")
        body.append("return acc;")
        sig = f"long f{i}(int a, int b, int c, int n, int *arr)"
    static = "static " if i % 6 != 0 else ""
    return f"{static}{sig}\n{{\n  " + "\n  ".join(body) + "\n}\n"


def generate(nfuncs: int, seed: int = 42) -> str:
    r = random.Random(seed)
    out = [HEADER]
    for i in range(nfuncs):
        out.append(_function(r, i))
    # keep every static function used
    out.append("long use_all(int a, int *arr, node *t, vec *v, const char *s, char *o)\n{\n"
               "  long acc = 0;\n")
    for i in range(nfuncs):
        k = i % 6
        if k in (0, 1, 5):
            out.append(f"  acc += f{i}(a, {i}, 3, 4, arr);\n")
        elif k == 2:
            out.append(f"  acc += f{i}(t, a, {i}, 3, 4);\n")
        elif k == 3:
            out.append(f"  acc += (long)f{i}(v, 4);\n")
        else:
            out.append(f"  acc += f{i}(s, o, 4);\n")
    out.append("  return acc;\n}\n")
    return "".join(out)


if __name__ == "__main__":
    import sys

    sys.stdout.write(generate(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
