"""Boards as hosts on this machine (root: network namespaces, veth links shaped by tc, cgroups): the
plan (pure) and the network that runs it. Called by `manage.py run` with EDGECACHE_BOARD_HOSTS=1 and benchmarks."""
