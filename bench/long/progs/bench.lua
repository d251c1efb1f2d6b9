-- A Lua benchmark set for the long benchmark: usage  lua bench.lua SCALE [NAME...]
-- Each benchmark prints one deterministic checksum line.

local scale = tonumber(arg[1] or "1")
local only = {}
for i = 2, #arg do only[arg[i]] = true end

local function fib(n) if n < 2 then return n end return fib(n - 1) + fib(n - 2) end

local function bench_fib(n)
  local s = 0
  for i = 1, n do s = s + fib(20 + i % 3) end
  return s
end

local function bottom_up(d)
  if d == 0 then return {} end
  d = d - 1
  return {bottom_up(d), bottom_up(d)}
end

local function check(t)
  if t[1] then return 1 + check(t[1]) + check(t[2]) end
  return 1
end

local function bench_binary_trees(n)
  local s = 0
  for i = 1, n do s = s + check(bottom_up(12 + i % 3)) end
  return s
end

local function bench_nbody(n)
  local PI, SOLAR = math.pi, 4 * math.pi * math.pi
  local DAYS = 365.24
  local B = {
    {0, 0, 0, 0, 0, 0, SOLAR},
    {4.84143144246472090e+00, -1.16032004402742839e+00, -1.03622044471123109e-01,
     1.66007664274403694e-03 * DAYS, 7.69901118419740425e-03 * DAYS,
     -6.90460016972063023e-05 * DAYS, 9.54791938424326609e-04 * SOLAR},
    {8.34336671824457987e+00, 4.12479856412430479e+00, -4.03523417114321381e-01,
     -2.76742510726862411e-03 * DAYS, 4.99852801234917238e-03 * DAYS,
     2.30417297573763929e-05 * DAYS, 2.85885980666130812e-04 * SOLAR},
    {1.28943695621391310e+01, -1.51111514016986312e+01, -2.23307578892655734e-01,
     2.96460137564761618e-03 * DAYS, 2.37847173959480950e-03 * DAYS,
     -2.96589568540237556e-05 * DAYS, 4.36624404335156298e-05 * SOLAR},
    {1.53796971148509165e+01, -2.59193146099879641e+01, 1.79258772950371181e-01,
     2.68067772490389322e-03 * DAYS, 1.62824170038242295e-03 * DAYS,
     -9.51592254519715870e-05 * DAYS, 5.15138902046611451e-05 * SOLAR},
  }
  local nb, dt = #B, 0.01
  for _ = 1, n do
    for i = 1, nb do
      local bi = B[i]
      local bix, biy, biz, bim = bi[1], bi[2], bi[3], bi[7]
      local bivx, bivy, bivz = bi[4], bi[5], bi[6]
      for j = i + 1, nb do
        local bj = B[j]
        local dx, dy, dz = bix - bj[1], biy - bj[2], biz - bj[3]
        local d2 = dx * dx + dy * dy + dz * dz
        local mag = dt / (d2 * math.sqrt(d2))
        local bm = bj[7] * mag
        bivx = bivx - dx * bm; bivy = bivy - dy * bm; bivz = bivz - dz * bm
        bm = bim * mag
        bj[4] = bj[4] + dx * bm; bj[5] = bj[5] + dy * bm; bj[6] = bj[6] + dz * bm
      end
      bi[4], bi[5], bi[6] = bivx, bivy, bivz
      bi[1] = bix + dt * bivx; bi[2] = biy + dt * bivy; bi[3] = biz + dt * bivz
    end
  end
  local e = 0
  for i = 1, nb do
    local b = B[i]
    e = e + 0.5 * b[7] * (b[4] * b[4] + b[5] * b[5] + b[6] * b[6])
    for j = i + 1, nb do
      local c = B[j]
      local dx, dy, dz = b[1] - c[1], b[2] - c[2], b[3] - c[3]
      e = e - b[7] * c[7] / math.sqrt(dx * dx + dy * dy + dz * dz)
    end
  end
  return string.format("%.9f", e)
end

local function A(i, j) local ij = i + j - 1; return 1.0 / (ij * (ij - 1) * 0.5 + i) end
local function Av(x, y, N)
  for i = 1, N do
    local a = 0
    for j = 1, N do a = a + x[j] * A(i, j) end
    y[i] = a
  end
end
local function Atv(x, y, N)
  for i = 1, N do
    local a = 0
    for j = 1, N do a = a + x[j] * A(j, i) end
    y[i] = a
  end
end

local function bench_spectral(n)
  local N = 100
  local s = 0
  for _ = 1, n do
    local u, v, t = {}, {}, {}
    for i = 1, N do u[i] = 1 end
    for _ = 1, 10 do
      Av(u, t, N); Atv(t, v, N); Av(v, t, N); Atv(t, u, N)
    end
    local vBv, vv = 0, 0
    for i = 1, N do vBv = vBv + u[i] * v[i]; vv = vv + v[i] * v[i] end
    s = s + math.sqrt(vBv / vv)
  end
  return string.format("%.9f", s)
end

local function bench_strings(n)
  local h = 0
  for r = 1, n do
    local parts = {}
    for i = 1, 300 do
      parts[#parts + 1] = string.format("%d:%s", i * r, string.rep(string.char(97 + i % 26), i % 7 + 1))
    end
    local s = table.concat(parts, ",")
    for w in s:gmatch("(%d+):") do h = (h * 31 + #w) % 1000000007 end
    s = s:gsub("a+", string.upper)
    h = (h + #s + select(2, s:gsub("A", "A"))) % 1000000007
    h = (h + (s:find("zzz", 1, true) or 0)) % 1000000007
  end
  return h
end

local function bench_tables(n)
  local h = 0
  for r = 1, n do
    local t = {}
    for i = 1, 2000 do t["k" .. (i * 7919 % 2003)] = i + r end
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys)
    for i = 1, #keys, 5 do h = (h + t[keys[i]] * i) % 1000000007 end
    local arr = {}
    for i = 1, 2000 do arr[i] = (i * 48271 + r) % 2147483647 end
    table.sort(arr, function(a, b) return a > b end)
    h = (h + arr[1] + arr[1000]) % 1000000007
    for i = #arr, 1, -3 do table.remove(arr, i) end
    h = (h + #arr) % 1000000007
  end
  return h
end

local function bench_closures(n)
  local s = 0
  for r = 1, n do
    local fs = {}
    for i = 1, 100 do
      local c = i + r
      fs[i] = function(x) c = c + x; return c end
    end
    for k = 1, 50 do
      for i = 1, 100 do s = (s + fs[i](k)) % 1000000007 end
    end
    local co = coroutine.wrap(function()
      for i = 1, 500 do coroutine.yield(i * r) end
    end)
    for _ = 1, 500 do s = (s + co()) % 1000000007 end
  end
  return s
end

local benches = {
  {"fib", bench_fib, 150},
  {"binary_trees", bench_binary_trees, 35},
  {"nbody", bench_nbody, 85000},
  {"spectral_norm", bench_spectral, 8},
  {"strings", bench_strings, 600},
  {"tables", bench_tables, 25},
  {"closures", bench_closures, 400},
}

for _, b in ipairs(benches) do
  local name, fn, base = b[1], b[2], b[3]
  if next(only) == nil or only[name] then
    local n = math.max(1, math.floor(base * scale))
    print(name .. " " .. tostring(fn(n)))
  end
end
