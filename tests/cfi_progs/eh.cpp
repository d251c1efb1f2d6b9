// Exceptions and backtraces through a copy of one of this program's functions.
//
// Used by tests/unit/test_codegen_cfi.py.  `eh` alone runs copyme() in place.  `eh copy`
// prints where copyme and main are and maps an area near them, then reads one line
// from stdin: "<code file> <code addr> <entry> <blob file> <blob addr> <register>"; it
// loads the code (a relocated copy of copyme) and the .eh_frame blob the translator
// made, registers the blob with __register_frame when <register> is 1, and calls the
// copy's entry:
// the callback backtraces (_Unwind_Backtrace) and throws through the copy's frame.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <sys/mman.h>
#include <unwind.h>

extern "C" void __register_frame(void *);

static _Unwind_Reason_Code trace(struct _Unwind_Context *ctx, void *) {
    int before = 0;
    uintptr_t ip = _Unwind_GetIPInfo(ctx, &before);
    printf("frame %#lx\n", (unsigned long)ip);
    return _URC_NO_REASON;
}

extern "C" __attribute__((noinline)) int thrower(int x) {
    _Unwind_Backtrace(trace, nullptr);
    fflush(stdout);
    if (x > 2) throw x;
    return x;
}

extern "C" __attribute__((noinline)) int escaper(int x) {
    if (x > 2) throw std::runtime_error("escaped");
    return x;
}

// The copied function: its calls go through its argument (no rel32 call out of it),
// it keeps values in callee-saved registers across calls (rows with saved registers),
// and it catches int (an LSDA with a typed catch).
extern "C" __attribute__((noinline)) int copyme(int (*cb)(int), int x) {
    int a = 0;
    try {
        a = cb(x) + 3;
        a *= cb(a) + x;
    } catch (int e) {
        return -e;
    }
    return a;
}

typedef int (*copy_fn)(int (*)(int), int);

int main(int argc, char **argv) {
    copy_fn f = copyme;
    if (argc > 1 && strcmp(argv[1], "copy") == 0) {
        uintptr_t want = ((uintptr_t)&copyme + (256u << 20)) & ~(uintptr_t)0xfffff;
        void *area = mmap((void *)want, 1 << 20, PROT_READ | PROT_WRITE | PROT_EXEC,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (area == MAP_FAILED) { perror("mmap"); return 2; }
        printf("copyme %p main %p area %p\n", (void *)&copyme, (void *)&main, area);
        fflush(stdout);
        char code[4096], blob[4096];
        unsigned long code_at, entry, blob_at;
        int reg;
        if (scanf("%4095s %lx %lx %4095s %lx %d", code, &code_at, &entry, blob, &blob_at,
                  &reg) != 6)
            return 2;
        for (int i = 0; i < 2; i++) {
            FILE *fp = fopen(i ? blob : code, "rb");
            if (!fp) { perror("fopen"); return 2; }
            fread((void *)(i ? blob_at : code_at), 1, 65536, fp);
            fclose(fp);
        }
        if (reg) __register_frame((void *)blob_at);
        f = (copy_fn)entry;
    }
    printf("result %d\n", f(thrower, 5));
    try {
        f(escaper, 7);
        printf("escaper returned\n");
    } catch (const std::exception &e) {
        printf("caught %s\n", e.what());
    }
    return 0;
}
