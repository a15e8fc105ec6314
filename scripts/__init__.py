"""Benchmarks and tools, one entry module each, run from the repository root as
``python -m scripts.<name>`` (``.venv/bin/python -m scripts.bench_report --quick``); tests import them as
``from scripts import bench_report``. They use the library and the programs through public modules only
(tests/test_imports.py)."""
