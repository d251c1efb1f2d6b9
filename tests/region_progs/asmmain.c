#include <stdio.h>
#include <stdlib.h>
int ovl(int), junk(int), tiny(int), part(int);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    printf("%d\n", ovl(n) + junk(n) + tiny(n) + part(n));
    return 0;
}
