"""Installed command-line tools: codec benchmark, zipccl-perf, network lab."""
