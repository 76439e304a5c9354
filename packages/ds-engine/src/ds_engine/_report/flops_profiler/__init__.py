"""The flops profiler: counts each op's flops and prints the per-module report."""
