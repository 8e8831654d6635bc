"""freescale-bench: the benchmarks users run to see what freescale_comm buys them."""
