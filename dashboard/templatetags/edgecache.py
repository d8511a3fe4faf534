"""Template filters of the dashboard's pages: sizes as people read them (decimal units, as the charts)."""

from django import template
from django.utils.html import format_html_join

from dashboard.pages.explain import human_bytes as _human_bytes
from dashboard.pages.stats import visible_namespaces

register = template.Library()


@register.filter
def human_bytes(count) -> str:
    return _human_bytes(count)


@register.filter
def seconds(value) -> str:
    """A wait in seconds as people read it: 42 s, 3 min 5 s, 2 h 10 min."""
    try:
        total = int(round(float(value)))
    except (TypeError, ValueError):
        return "–"
    sign, total = ("-" if total < 0 else ""), abs(total)
    if total < 60:
        return f"{sign}{total} s"
    if total < 3600:
        return f"{sign}{total // 60} min {total % 60} s"
    return f"{sign}{total // 3600} h {total % 3600 // 60} min"


@register.filter
def unbroken_words(text) -> str:
    """``text`` (a command) with each word kept whole: a line may wrap at its spaces, never inside
    a word (a token has "-" in it, where browsers break lines). Its text, and so what a copy
    button copies, is ``text`` unchanged."""
    return format_html_join(" ", '<span class="word">{}</span>', ((word,) for word in str(text).split(" ")))


@register.simple_tag(takes_context=True)
def member_namespaces(context) -> list[str]:
    """The namespaces the page's user is a member of (staff: [] here; they see every one)."""

    request = context.get("request")
    namespaces = visible_namespaces(getattr(request, "user", None))
    return sorted(namespaces) if namespaces else []
