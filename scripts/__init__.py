"""Benchmarks and tools; a package so that tests can import them (``from scripts import bench_report``)."""
