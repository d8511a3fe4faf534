"""Serving a run on a board: the run skeleton, prefix and schema serving (PML), the strategy registry,
the one cache-entry exchange, the timing breakdown, break-even arithmetic and audits. Called by the
board runtime (``inference.board``); the control plane imports its pure parts (PML, breakdown, break-even)."""
