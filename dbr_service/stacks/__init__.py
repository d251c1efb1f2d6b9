"""Call stacks as a profiling aid: unwinding sampled stacks (CFI, frame pointers), naming,
folding, the call graph, and SVG flame graphs.
"""
