"""Tests of what a board runs: the engine, serving and tiers, the board process, the lab, its install and wheel."""
