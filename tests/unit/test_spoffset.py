"""codegen/spoffset.py: rsp inside a translation, replayed from its start.

The dispatch shape below is the one the emitter makes for ``jmp [rip+GOT]`` with an
inlined target (red-zone step, two saved registers, a compare, both ways out); the
check against the CPU over emitted regions is in tests/unit/test_codegen_emit.py."""

from __future__ import annotations

from codegen_util import asm

from dbr_service.codegen.spoffset import sp_offset

AT = 0x7000_0000

DISPATCH = """
    lea rsp, [rsp - 0x80]
    push rcx
    push rax
    mov rax, qword ptr [rip + 0x1000]
    movabs rcx, 0xffff8078390bf9b0
    lea rcx, [rcx + rax]
    jrcxz hit
    pop rax
    pop rcx
    lea rsp, [rsp + 0x80]
    jmp qword ptr [rip + 0x1000]
hit:
    pop rax
    pop rcx
    lea rsp, [rsp + 0x80]
    nop
"""


def _offsets(src: str) -> list[tuple[str, int | None]]:
    import capstone
    code = asm(src, AT)
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return [(f"{i.mnemonic} {i.op_str}", sp_offset(code, AT, AT, AT + len(code), i.address))
            for i in md.disasm(code, AT)]


def test_dispatch_offsets_on_both_ways_out():
    got = [off for _text, off in _offsets(DISPATCH)]
    assert got == [0, -0x80, -0x88, -0x90, -0x90, -0x90, -0x90,    # up to jrcxz
                   -0x90, -0x88, -0x80, 0,                           # miss
                   -0x90, -0x88, -0x80, 0]                           # hit


def test_flags_and_sub_add():
    got = [off for _t, off in _offsets("pushfq\nsub rsp, 0x20\nadd rsp, 0x18\npopfq\nnop")]
    assert got == [0, -8, -0x28, -0x10, -8]


def test_unknown_writes_of_rsp_give_none():
    got = _offsets("push rax\nand rsp, -16\nnop")
    assert [o for _t, o in got] == [0, -8, None]
    got = _offsets("mov rsp, rbp\nnop")
    assert [o for _t, o in got] == [0, None]
    got = _offsets("pop rsp\nnop")
    assert [o for _t, o in got] == [0, None]


def test_paths_that_meet_with_different_offsets_give_none():
    got = _offsets("test eax, eax\nje out\npush rax\nout: nop")
    assert got[-1][1] is None


def test_outside_the_translation_or_not_a_boundary():
    code = asm(DISPATCH, AT)
    assert sp_offset(code, AT, AT, AT + len(code), AT + 1) is None     # inside the lea
    assert sp_offset(code, AT, AT, AT + 5, AT + 6) is None
    assert sp_offset(code, AT, AT + 5, AT + len(code), AT) is None
