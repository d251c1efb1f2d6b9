// Exceptions and backtraces through replacement code (tests/agent/test_agent_frames.py).
//
// The test copies copyme() into a code buffer, patches copyme's entry with a jump to
// the copy and names the copy's CFI with FRAMES_ADD.  caller() calls copyme(thrower,
// x); thrower backtraces with _Unwind_Backtrace and throws, through copyme's frame (so
// the copy's), to caller's catch.  Commands on stdin: "call X" (here), "fork X" (in a
// fork child: an unwinder that cannot go through the copy aborts there, not here).
#include <cstdint>
#include <cstdio>
#include <sys/wait.h>
#include <unistd.h>
#include <unwind.h>

static _Unwind_Reason_Code trace(struct _Unwind_Context *ctx, void *) {
    printf("frame %#lx\n", (unsigned long)_Unwind_GetIP(ctx));
    return _URC_NO_REASON;
}

extern "C" __attribute__((noinline)) int thrower(int x) {
    _Unwind_Backtrace(trace, nullptr);
    fflush(stdout);     // a fork child may abort next
    if (x > 2) throw x;
    return x;
}

// Calls through its argument (no rel32 call to re-aim) and keeps values in callee-saved
// registers across them: rows with saved registers.
extern "C" __attribute__((noinline)) int copyme(int (*cb)(int), int x) {
    int a = cb(x) + 3;
    a *= cb(a) + x;
    return a;
}

extern "C" __attribute__((noinline)) int caller(int x) {
    try {
        return copyme(thrower, x);
    } catch (int e) {
        return -e;
    }
}

int main() {
    printf("copyme %p\n", (void *)&copyme);
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        int x;
        if (sscanf(line, "call %d", &x) == 1) {
            printf("result %d\n", caller(x));
        } else if (sscanf(line, "fork %d", &x) == 1) {
            pid_t p = fork();
            if (p == 0) {
                printf("result %d\n", caller(x));
                fflush(stdout);
                _exit(0);
            }
            int st = 0;
            waitpid(p, &st, 0);
            printf("child %d\n", WIFSIGNALED(st) ? -WTERMSIG(st) : WEXITSTATUS(st));
        }
        fflush(stdout);
    }
    return 0;
}
