"""Benchmarks and compile-time tools of kivi-jax: run each as `python -m bench.<tool>` from the
repository root (bench/README.md lists them)."""
