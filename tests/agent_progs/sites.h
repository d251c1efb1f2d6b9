/* Eight patchable functions, site_k at an address == k (mod 8).  Each computes
 * x*1000+7; its first instruction `imul eax, edi, 1000` (69 C7 E8 03 00 00) is six
 * bytes long, so a 5-byte patch covers only that instruction (docs/architecture.md,
 * "Invariants" 3).
 */
#ifndef SITES_H
#define SITES_H
#define SITE_FN(k) \
    ".p2align 4\n" ".skip " #k ", 0x90\n" ".globl site" #k "\n" ".type site" #k ",@function\n" \
    "site" #k ":\n" "imul $1000, %edi, %eax\n" "add $7, %eax\n" "ret\n"
__asm__(".text\n" SITE_FN(0) SITE_FN(1) SITE_FN(2) SITE_FN(3)
        SITE_FN(4) SITE_FN(5) SITE_FN(6) SITE_FN(7));
int site0(int), site1(int), site2(int), site3(int), site4(int), site5(int), site6(int),
    site7(int);
static int (*const sites[8])(int) = {site0, site1, site2, site3, site4, site5, site6, site7};
static inline int expected(int x) { return (int)((unsigned)x * 1000u + 7u); }
#endif
