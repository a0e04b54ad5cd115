"""Benchmarks of issue 6: pycompactor's guarantees as ratios against plain SQL (`make bench`)."""
