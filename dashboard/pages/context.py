"""Template context every page gets."""

from dashboard.pages.charts import COMPONENTS


def chart_stack(request) -> dict:
    """The labels of a run's stacked parts (table 3's groups, then "other"), in order, for ``live.js``
    (one source: ``dashboard.pages.charts.COMPONENTS``, from ``inference.serving.breakdown.TIME_GROUPS``)."""
    return {"chart_stack": list(COMPONENTS)}
