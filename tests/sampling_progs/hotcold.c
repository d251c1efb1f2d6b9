/* hotcold: one thread, hot() does 4x the work of cold(): ~80% / ~20% of CPU time.
 * Both run the same loop body so the ratio is the iteration ratio.
 * Runs until killed (alarm() is a safety net). */
#include <unistd.h>

volatile unsigned long sink;

#define WORK(n) do { unsigned long a = sink; \
    for (unsigned long i = 0; i < (n); i++) a = a * 6364136223846793005ul + i; \
    sink = a; } while (0)

__attribute__((noinline)) void hot(void) { WORK(400000); }
__attribute__((noinline)) void cold(void) { WORK(100000); }

int main(void)
{
    alarm(30);
    for (;;) {
        hot();
        cold();
    }
}
