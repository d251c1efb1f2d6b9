/* stream.c — a filter that streams: reads FILE ROUNDS times in 64 KiB blocks,
 * scrambles each block in a hot loop and writes it to OUT; prints a checksum.
 * Its I/O grows with its progress, so a speed check can measure it
 * (tests/live/test_speedcheck_live.py).  usage: stream FILE ROUNDS OUT */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static unsigned char buf[65536];

static unsigned scramble(unsigned char *p, long n, unsigned h)
{
    long i;

    for (i = 0; i < n; i++) {
        h = h * 2654435761u + p[i];
        p[i] = (unsigned char)(p[i] ^ (h >> 7));
    }
    return h;
}

int main(int argc, char **argv)
{
    unsigned long long sum = 0;
    int rounds, r, out;

    if (argc != 4) {
        fprintf(stderr, "usage: stream FILE ROUNDS OUT\n");
        return 2;
    }
    rounds = atoi(argv[2]);
    out = open(argv[3], O_WRONLY);
    if (out < 0) {
        perror(argv[3]);
        return 1;
    }
    for (r = 0; r < rounds; r++) {
        int fd = open(argv[1], O_RDONLY);
        unsigned h = (unsigned)r;
        long n;

        if (fd < 0) {
            perror(argv[1]);
            return 1;
        }
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            h = scramble(buf, n, h);
            sum = sum * 1099511628211ull + h;
            if (write(out, buf, (size_t)n) != n) {
                perror("write");
                return 1;
            }
        }
        close(fd);
    }
    printf("%d rounds, checksum %016llx\n", rounds, sum);
    return 0;
}
