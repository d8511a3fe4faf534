"""Tests of the control plane: pages, the API, routing, commands, benchmarks, docs (most need a database)."""
