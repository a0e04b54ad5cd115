"""The benchmarks of `make bench`: the cost of pycompactor's guarantees against plain SQL."""
