"""Template context every page gets."""

from inference.breakdown import STACK


def chart_stack(request) -> dict:
    """The breakdown's stack order and labels, for ``live.js`` (one source: inference.breakdown.STACK)."""
    return {"chart_stack": [list(pair) for pair in STACK]}
