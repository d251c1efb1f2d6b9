/* Character-at-a-time stdio, as many Unix filters are written: per round, putc
 * generated text into a 4 MiB temporary file, then getc it back counting lines,
 * words and a checksum.  glibc skips stdio's locks while it believes the process
 * has one thread, so this is where an in-process agent's thread would cost most
 * if glibc knew of it.  usage: stdio ROUNDS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define SIZE (4u << 20)

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 10;
    uint64_t x = 88172645463325252ull, sum = 0, lines = 0, words = 0;

    for (long r = 0; r < rounds; r++) {
        FILE *f = tmpfile();
        int c, inword = 0;

        if (!f)
            return 1;
        for (unsigned i = 0; i < SIZE; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            unsigned k = (unsigned)(x % 64);
            putc(k < 50 ? 'a' + (int)(k % 26) : k < 60 ? ' ' : k < 63 ? ',' : '\n', f);
        }
        rewind(f);
        while ((c = getc(f)) != EOF) {
            sum = sum * 31 + (unsigned)c;
            lines += c == '\n';
            if (c == ' ' || c == '\n' || c == ',')
                inword = 0;
            else if (!inword)
                inword = 1, words++;
        }
        fclose(f);
    }
    printf("lines %llu words %llu sum %016llx\n", (unsigned long long)lines,
           (unsigned long long)words, (unsigned long long)sum);
    return 0;
}
