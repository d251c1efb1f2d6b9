"""Python source kept in shape after names in it got longer (tools/restructure.py).

``relayout(old_lines, new_chunks)`` takes a file's lines and what each became, and
returns the new text with

* continuation lines that were aligned to a bracket on a changed line aligned to
  where that bracket is now;
* changed lines over ``LIMIT`` characters broken: code after a comma inside brackets
  (an import without brackets gets them), comments and docstring prose at a space, a
  trailing comment moved above its line.

Lines it cannot break are returned as notes.
"""

from __future__ import annotations

import io
import re
import tokenize

LIMIT = 100
OPEN, CLOSE = "([{", ")]}"


def _tokens(text: str) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None


def _bracket_states(toks: list[tokenize.TokenInfo]):
    """(brackets opened on each row and open at its end, stack at each row's first
    token): rows are 1-based; a bracket is (row, col)."""
    stack: list[tuple[int, int]] = []
    open_at_end: dict[int, list[tuple[int, int]]] = {}
    at_start: dict[int, list[tuple[int, int]]] = {}
    row = 0
    for t in toks:
        if t.start[0] != row:
            if row:
                open_at_end[row] = [b for b in stack if b[0] == row]
            row = t.start[0]
            at_start[row] = list(stack)
        if t.type == tokenize.OP and t.string in OPEN:
            stack.append(t.start)
        elif t.type == tokenize.OP and t.string in CLOSE and stack:
            stack.pop()
        if t.end[0] != row:         # a token spanning rows (a string)
            open_at_end[row] = [b for b in stack if b[0] == row]
            row = t.end[0]
    if row:
        open_at_end[row] = [b for b in stack if b[0] == row]
    return open_at_end, at_start


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _realign(old_lines: list[str], new_lines: list[str], changed: dict[int, int]) -> None:
    old_t, new_t = _tokens("".join(old_lines)), _tokens("".join(new_lines))
    if old_t is None or new_t is None:
        return
    old_open, _ = _bracket_states(old_t)
    new_open, new_start = _bracket_states(new_t)
    for old_row, new_row in changed.items():
        a, b = old_open.get(old_row, []), new_open.get(new_row, [])
        if len(a) != len(b):
            continue
        for (_, c_old), bracket in zip(a, b):
            c_new = bracket[1]
            if c_old == c_new:
                continue
            k = new_row + 1
            while k <= len(new_lines) and (k not in new_start or bracket in new_start[k]):
                line = new_lines[k - 1]
                if k in new_start and _indent(line) == c_old + 1 and line.strip():
                    new_lines[k - 1] = " " * (c_new + 1) + line.lstrip(" ")
                k += 1


def _break_at_space(line: str, indent: str, prefix: str = "") -> str | None:
    body_start = len(indent) + len(prefix)
    cut = line.rfind(" ", body_start + 1, LIMIT + 1)
    if cut <= body_start:
        return None
    return line[:cut].rstrip() + "\n" + indent + prefix + line[cut + 1:].lstrip()


def _fix_line(lines: list[str], row: int, toks: list[tokenize.TokenInfo]) -> int:
    """Break row (1-based) of lines in place; how many lines it replaced (0: none, it
    cannot be broken; 2: its rest joined the next line)."""
    consumed = 1
    line = lines[row - 1].rstrip("\n")
    on_row = [t for t in toks if t.start[0] <= row <= t.end[0]
              and t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                 tokenize.DEDENT, tokenize.ENDMARKER)]
    if not on_row:
        return False
    first = on_row[0]
    if first.type == tokenize.STRING and first.start[0] < row or (
            first.type == tokenize.STRING and first.end[0] > row):
        new = _break_at_space(line, " " * _indent(line))          # docstring prose
    elif first.type == tokenize.COMMENT:
        m = re.match(r"( *)(#:? )", line)
        new = _break_at_space(line, m[1], m[2]) if m else None
    else:
        new = _break_code(line, row, toks, on_row)
        # a comma break: the rest joins the next line when that continues the same group
        if new and row < len(lines) and "#" not in new:
            rest = new.rpartition("\n")[2]
            nxt = lines[row]
            if (_indent(nxt) == _indent(rest) and nxt.strip()
                    and not nxt.lstrip().startswith("#")
                    and len(rest) + 1 + len(nxt.strip()) <= LIMIT
                    and rest.rstrip().endswith(",")):
                new = new + " " + nxt.strip()
                consumed = 2
    if new is None:
        return 0
    lines[row - 1:row - 1 + consumed] = [new + "\n"]
    return consumed


def _break_code(line: str, row: int, toks, on_row) -> str | None:
    _, at_start = _bracket_states(toks)
    stack = list(at_start.get(row, []))
    best = None
    for t in on_row:
        if t.start[0] != row:
            continue
        if t.type == tokenize.OP and t.string in OPEN:
            stack.append(t.start)
        elif t.type == tokenize.OP and t.string in CLOSE and stack:
            stack.pop()
        elif t.type == tokenize.OP and t.string == "," and stack and t.end[1] <= LIMIT:
            inner = stack[-1]
            col = inner[1] + 1 if inner[0] == row else _indent(line)
            if t.end[1] < len(line.rstrip()):
                best = (t.end[1], col)
    if best:
        cut, col = best
        return line[:cut] + "\n" + " " * col + line[cut:].lstrip()
    m = re.match(r"( *from \S+ import )([^(#]+?)( *#.*)?$", line)
    if m and "," in m[2]:
        return f"{m[1]}({m[2].rstrip()}){m[3] or ''}"
    comment = [t for t in on_row if t.type == tokenize.COMMENT and t.start[0] == row]
    if comment and comment[0].start[1] > _indent(line):
        c = comment[0]
        return (" " * _indent(line) + c.string + "\n" + line[:c.start[1]].rstrip())
    return None


def relayout(old_lines: list[str], new_chunks: list[str], where: str = "") -> tuple[str, list[str]]:
    """The new text of a Python file whose line i became new_chunks[i]; notes."""
    new_lines: list[str] = []
    changed: dict[int, int] = {}            # old row -> new row, rows changed in place
    touched: set[int] = set()                # new rows that are new text
    for i, (old, chunk) in enumerate(zip(old_lines, new_chunks), 1):
        parts = chunk.splitlines(keepends=True) or [chunk]
        if chunk != old:
            if len(parts) == 1:
                changed[i] = len(new_lines) + 1
            touched.update(range(len(new_lines) + 1, len(new_lines) + len(parts) + 1))
        new_lines.extend(parts)
    if not touched:
        return "".join(new_lines), []
    _realign(old_lines, new_lines, changed)
    notes = []
    for _ in range(200):                        # each pass breaks one line
        toks = _tokens("".join(new_lines))
        if toks is None:
            notes.append(f"{where}: not tokenized, line lengths not checked")
            break
        long = [r for r in sorted(touched) if len(new_lines[r - 1].rstrip("\n")) > LIMIT
                and "noqa" not in new_lines[r - 1]]
        if not long:
            break
        row = long[0]
        consumed = _fix_line(new_lines, row, toks)
        if not consumed:
            notes.append(f"{where}:{row}: over {LIMIT} characters, not broken")
            touched.discard(row)
            continue
        # the broken line is now two (or two lines are): renumber what follows
        parts = new_lines[row - 1].splitlines(keepends=True)
        new_lines[row - 1:row] = parts
        grow = len(parts) - consumed
        touched = {r if r < row else r + grow for r in touched if not
                   row <= r < row + consumed} | set(range(row, row + len(parts)))
    return "".join(new_lines), notes
