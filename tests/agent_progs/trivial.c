/* Start-up cost probe: does nothing. */
int main(void) { return 0; }
