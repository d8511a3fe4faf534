"""Date formats: one on every page (``Y-m-d H:i``, as the status badges and the live script write
them), instead of Django's English "Nov. 24, 2026, 7:39 p.m." beside them."""
