"""Starts and stops a whole local mesh as processes (make run, tests, benchmarks)."""
