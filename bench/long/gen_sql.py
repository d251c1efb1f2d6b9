"""The sqlite3 workload's database and analytic query mix (deterministic)."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

ROWS = 200_000  # orders; the database is the same for --quick and full runs


def make_db(path: Path, rows: int = ROWS, seed: int = 7) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    r = random.Random(seed)
    con = sqlite3.connect(tmp)
    con.executescript("""
        CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT, region TEXT, since INT);
        CREATE TABLE products(id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
        CREATE TABLE orders(id INTEGER PRIMARY KEY, customer INT, product INT, qty INT,
                            day INT, note TEXT);
    """)
    regions = ["north", "south", "east", "west", "centre"]
    cats = ["tools", "food", "books", "toys", "garden", "music", "sport", "home"]
    con.executemany("INSERT INTO customers VALUES(?,?,?,?)",
                    [(i, f"cust{i:05d}", r.choice(regions), 2000 + r.randrange(25))
                     for i in range(5000)])
    con.executemany("INSERT INTO products VALUES(?,?,?,?)",
                    [(i, f"prod-{i:04d}-{r.choice(cats)}", r.choice(cats),
                      round(r.uniform(1, 500), 2)) for i in range(2000)])
    words = ["fast", "gift", "late", "bulk", "repeat", "fragile", "promo", ""]
    con.executemany("INSERT INTO orders VALUES(?,?,?,?,?,?)",
                    [(i, r.randrange(5000), r.randrange(2000), r.randint(1, 20),
                      r.randrange(3650), " ".join(r.sample(words, 2)))
                     for i in range(rows)])
    con.execute("CREATE INDEX orders_customer ON orders(customer)")
    con.commit()
    con.close()
    tmp.replace(path)


QUERIES = [
    # aggregate per category and region (joins + group by)
    """SELECT p.category, c.region, count(*), sum(o.qty * p.price), avg(o.qty)
       FROM orders o JOIN products p ON p.id = o.product JOIN customers c ON c.id = o.customer
       WHERE o.day % {m} = {k} GROUP BY 1, 2 ORDER BY 4 DESC LIMIT 12;""",
    # window functions: running totals per customer
    """SELECT customer, max(running) FROM (
         SELECT customer, sum(qty) OVER (PARTITION BY customer ORDER BY day
                                         ROWS BETWEEN 3 PRECEDING AND CURRENT ROW) AS running
         FROM orders WHERE customer % {m} = {k})
       GROUP BY customer ORDER BY 2 DESC, 1 LIMIT 10;""",
    # string functions and LIKE
    """SELECT substr(p.name, 6, 4), count(*), group_concat(DISTINCT p.category)
       FROM orders o JOIN products p ON p.id = o.product
       WHERE o.note LIKE '%{w}%' AND o.id % {m} = {k}
       GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 8;""",
    # recursive CTE
    """WITH RECURSIVE seq(n, acc) AS (SELECT 1, {k} UNION ALL
         SELECT n + 1, (acc * 1103515245 + 12345) % 2147483648 FROM seq WHERE n < 20000)
       SELECT count(*), sum(acc % 1000), max(acc) FROM seq;""",
    # correlated subquery + sort
    """SELECT c.id, c.name, (SELECT count(*) FROM orders o WHERE o.customer = c.id) AS n
       FROM customers c WHERE c.id % {m} = {k} ORDER BY n DESC, c.id LIMIT 10;""",
    # distinct counts and having
    """SELECT o.product, count(DISTINCT o.customer) AS u, sum(o.qty)
       FROM orders o WHERE o.day BETWEEN {k} * 10 AND {k} * 10 + 900
       GROUP BY o.product HAVING u > 3 ORDER BY u DESC, 1 LIMIT 10;""",
]


def make_queries(rounds: int, seed: int = 11) -> str:
    r = random.Random(seed)
    words = ["fast", "gift", "late", "bulk", "repeat", "fragile", "promo"]
    out = []
    for i in range(rounds):
        for q in QUERIES:
            m = r.choice([3, 5, 7, 11])
            out.append(q.format(m=m, k=r.randrange(m), w=r.choice(words)))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    make_db(Path(sys.argv[1]))
    Path(sys.argv[2]).write_text(make_queries(int(sys.argv[3])))
