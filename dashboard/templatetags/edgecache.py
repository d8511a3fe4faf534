"""Template filters of the dashboard's pages: sizes as people read them (decimal units, as the charts)."""

from django import template

from ..explain import human_bytes as _human_bytes

register = template.Library()


@register.filter
def human_bytes(count) -> str:
    return _human_bytes(count)
