# Every call frame instruction, for the CFI parser tests (tests/unit/test_codegen_cfi.py).
# Linked with gcc -nostdlib -static -no-pie; never run.  Unusual instructions are
# written with .cfi_escape (DWARF 4 6.4.2 opcodes, operands in LEB128); the .skip
# runs make gas emit DW_CFA_advance_loc1/2/4.
        .text
        .globl  _start
_start:
        .cfi_startproc
        .cfi_undefined rip
        ret
        .cfi_endproc

        .globl  everything
        .type   everything, @function
everything:
        .cfi_startproc
        nop
        .cfi_def_cfa_offset 16
        .cfi_offset rbx, -16
        nop
        .cfi_remember_state
        .cfi_escape 0x14, 0x06, 0x03            # val_offset rbp, 3 (factored: -24)
        .cfi_def_cfa_offset 48
        nop
        .cfi_restore_state
        .cfi_register rbx, r12
        nop
        .cfi_undefined r13
        .cfi_same_value r14
        .cfi_escape 0x16, 0x0f, 0x02, 0x77, 0x08 # val_expression r15: DW_OP_breg7 +8
        .cfi_escape 0x10, 0x0c, 0x02, 0x76, 0x10 # expression r12: DW_OP_breg6 +16
        nop
        .cfi_escape 0x2e, 0x10                  # GNU_args_size 16
        .cfi_escape 0x12, 0x06, 0x7e            # def_cfa_sf rbp, -2 (factored: +16)
        .skip   100, 0x90
        .cfi_escape 0x13, 0x7d                  # def_cfa_offset_sf -3 (factored: +24)
        .cfi_escape 0x11, 0x03, 0x7c            # offset_extended_sf rbx, -4 (+32)
        .cfi_escape 0x2f, 0x0d, 0x02            # GNU_negative_offset_extended r13, 2 (+16)
        .cfi_escape 0x05, 0x0e, 0x03            # offset_extended r14, 3 (-24)
        .cfi_escape 0x15, 0x0f, 0x7f            # val_offset_sf r15, -1 (+8)
        .skip   300, 0x90
        .cfi_restore rbx
        .cfi_escape 0x06, 0x0e                  # restore_extended r14
        .cfi_escape 0x2e, 0x00                  # GNU_args_size 0
        .cfi_escape 0x0f, 0x03, 0x77, 0x08, 0x06 # def_cfa_expression breg7 +8; deref
        .skip   70000, 0x90
        .cfi_def_cfa rsp, 8
        .cfi_def_cfa_register rbp
        .cfi_escape 0x0c, 0x07, 0x08            # def_cfa rsp, 8
        .cfi_restore r12
        nop
        ret
        .cfi_endproc
        .size   everything, .-everything

        .globl  sigframe
        .type   sigframe, @function
sigframe:
        .cfi_startproc
        .cfi_signal_frame
        .cfi_escape 0x0f, 0x03, 0x77, 0xa0, 0x01 # def_cfa_expression breg7 +160
        nop
        .cfi_endproc
        .size   sigframe, .-sigframe

        .globl  with_personality
        .type   with_personality, @function
with_personality:
        .cfi_startproc
        .cfi_personality 0x03, my_personality
        push    %rbp
        .cfi_def_cfa_offset 16
        .cfi_offset rbp, -16
        pop     %rbp
        .cfi_def_cfa_offset 8
        ret
        .cfi_endproc
        .size   with_personality, .-with_personality

        .globl  my_personality
        .type   my_personality, @function
my_personality:
        ret
        .size   my_personality, .-my_personality
