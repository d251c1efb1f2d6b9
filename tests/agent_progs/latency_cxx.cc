/* A C++ program for the latency probe's refusal: "go N" calls risky(i) N times, which
 * throws for odd i through the function; prints "done CAUGHT" then "ready". */
#include <cstdio>
#include <cstring>
#include <stdexcept>

volatile long sink;

__attribute__((noinline)) long risky(long i)
{
    sink += i;
    if (i & 1)
        throw std::runtime_error("odd");
    return i;
}

int main()
{
    char line[64];
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::printf("ready\n");
    while (std::fgets(line, sizeof line, stdin)) {
        long n = 0, caught = 0;
        if (std::sscanf(line, "go %ld", &n) == 1) {
            for (long i = 0; i < n; i++) {
                try {
                    risky(i);
                } catch (const std::exception &) {
                    caught++;
                }
            }
        } else if (std::strncmp(line, "exit", 4) == 0) {
            return 0;
        }
        std::printf("done %ld\n", caught);
        std::printf("ready\n");
    }
    return 0;
}
