/* Calls lib_work through the PLT in a hot loop, then waits for stdin to close
   so a test can look at the live process. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
long lib_work(int n);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    long s = 0;
    for (int i = 0; i < n; i++) s += lib_work(i & 63);
    printf("%ld\n", s);
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {}
    return (int)(s & 1);
}
