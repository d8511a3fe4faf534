"""Boards as hosts: network namespaces, kernel-shaped links, cgroups (root; marker ``hosts``, from this folder)."""
