"""jumptable.infer_targets on hand-assembled paths: the function-pointer table
indexed by a masked value (``and eax, 3; call [rdx + rax*8]``, gcc -O2 for
``table[(x >> 17) & 3](x)``), and what must not be believed."""

from __future__ import annotations

import struct

import keystone

from dbr_service.region.jumptable import PathStep, infer_targets
from dbr_service.region.memview import MappedRange, MemoryView

KS = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
CODE, TABLE = 0x401000, 0x403000
FUNCS = [CODE + 0x100 + 0x20 * k for k in range(8)]


class _View(MemoryView):
    """Code (r-x) at CODE and a pointer table at TABLE with the given permissions."""

    def __init__(self, code: bytes, table: bytes, table_perms: str = "r--") -> None:
        super().__init__()
        self.code, self.table, self.tperms = code.ljust(0x1000, b"\x90"), table, table_perms

    def ranges(self):
        return [MappedRange(CODE, CODE + len(self.code), "r-x", "t"),
                MappedRange(TABLE, TABLE + 0x1000, self.tperms, "t")]

    def _read_range(self, rng, addr, n):
        src = self.code if rng.start == CODE else self.table.ljust(0x1000, b"\0")
        return src[addr - rng.start: addr - rng.start + n]


def _path(text: str) -> tuple[bytes, list[PathStep]]:
    enc, _ = KS.asm(text, CODE)
    code = bytes(enc)
    return code, [PathStep(CODE, code)]


def _table(n: int) -> bytes:
    return b"".join(struct.pack("<Q", f) for f in FUNCS[:n])


MASKED_CALL = (f"lea rdx, [rip + {TABLE - CODE - 7:#x}]; mov rdi, rax; shr rax, 0x11; "
               "and eax, 3; call qword ptr [rdx + rax*8]")


def test_masked_index_bounds_a_call_table():
    code, path = _path(MASKED_CALL)
    res = infer_targets(path, _View(code, _table(4)))
    assert res is not None and res.how == "table-abs" and res.complete
    assert res.targets == tuple(FUNCS[:4]) and res.table == TABLE and res.entries == 4


def test_masked_jmp_table_and_wider_masks():
    code, path = _path(f"lea rcx, [rip + {TABLE - CODE - 7:#x}]; and edi, 7; "
                       "jmp qword ptr [rcx + rdi*8]")
    res = infer_targets(path, _View(code, _table(8)))
    assert res is not None and res.targets == tuple(FUNCS)


def test_mask_is_not_believed_over_writable_or_non_code_entries():
    code, path = _path(MASKED_CALL)
    assert infer_targets(path, _View(code, _table(4), "rw-")) is None     # may change
    data = struct.pack("<Q", TABLE)                                         # not code
    for bad in (data + _table(3),                   # not code first
                _table(2) + data + _table(1),       # code after data
                _table(1) + data * 3):              # code in fewer than half, or one
        assert infer_targets(path, _View(code, bad)) is None


def test_mask_wider_than_the_table():
    """Lua's computed goto: ``and eax, 0x7f`` over 83 opcodes, data after them.  The
    targets are the code prefix; the bound stays the mask's."""
    code, path = _path(MASKED_CALL)
    res = infer_targets(path, _View(code, _table(3) + struct.pack("<Q", 0x1234)))
    assert res is not None and res.targets == tuple(FUNCS[:3]) and res.entries == 4
    res = infer_targets(path, _View(code, _table(2) + struct.pack("<2Q", 7, 0)))
    assert res is not None and res.targets == tuple(FUNCS[:2]) and res.complete


def test_mask_then_clobber_or_negative_mask_gives_no_bound():
    for text in (f"lea rdx, [rip + {TABLE - CODE - 7:#x}]; and eax, 3; add rax, rbx; "
                 "call qword ptr [rdx + rax*8]",
                 f"lea rdx, [rip + {TABLE - CODE - 7:#x}]; and rax, -8; "
                 "call qword ptr [rdx + rax*8]",
                 f"lea rdx, [rip + {TABLE - CODE - 7:#x}]; and al, 3; "
                 "call qword ptr [rdx + rax*8]"):
        code, path = _path(text)
        assert infer_targets(path, _View(code, _table(8))) is None, text
