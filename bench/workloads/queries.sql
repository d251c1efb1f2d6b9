-- CPU-bound queries of the dbr benchmark suite (run read-only by the sqlite3 shell
-- over the generated database; every result is ordered so output is deterministic).
-- Integer results only: sqlite formats REALs through long double, which valgrind
-- (one of the configurations) computes at lower precision, so its output differed.
SELECT c.region, count(*), sum(o.qty * CAST(round(p.price * 100) AS INTEGER)),
       sum(o.qty) * 1000 / count(*)
  FROM orders o JOIN customers c ON c.id = o.customer JOIN products p ON p.id = o.product
  GROUP BY c.region ORDER BY c.region;
SELECT p.category, o.day / 30 AS month, sum(o.qty) AS q
  FROM orders o JOIN products p ON p.id = o.product
  GROUP BY p.category, month ORDER BY q DESC, p.category, month LIMIT 15;
SELECT customer, count(*) AS n, max(qty) FROM orders
  WHERE note LIKE '%ab%c%' GROUP BY customer ORDER BY n DESC, customer LIMIT 10;
SELECT count(DISTINCT customer || '-' || product) FROM orders WHERE qty > 5;
SELECT day, total, sum(total) OVER (ORDER BY day ROWS BETWEEN 6 PRECEDING AND CURRENT ROW)
  FROM (SELECT day, sum(qty) AS total FROM orders GROUP BY day) ORDER BY day LIMIT 5 OFFSET 300;
SELECT substr(note, 1, 3) AS k, count(*) FROM orders GROUP BY k ORDER BY count(*) DESC, k LIMIT 5;
