"""Admin for the cache-box mirror: filter, sort, evict, pin and unpin (staff only, confirmed, logged)."""

from django.contrib import admin, messages
from django.template.defaultfilters import filesizeformat

from .models import CacheEntry


def _confirmed(modeladmin, request, queryset, verb: str):
    """None after the staff member confirmed; otherwise the page that asks."""
    from dashboard.admin import confirmation

    return confirmation(
        modeladmin,
        request,
        queryset,
        title=f"{verb.capitalize()} {queryset.count()} cache entries?",
        verb=verb,
        explanation="This cannot be undone from here; boards recompute and upload what they need again.",
        describe=lambda e: f"{e.key} ({e.namespace}, [{e.start}, {e.end}), {filesizeformat(e.bytes)})",
    )


@admin.register(CacheEntry)
class CacheEntryAdmin(admin.ModelAdmin):
    list_display = ("key", "model", "namespace", "start", "end", "tokens", "bytes", "hits", "last_hit", "creator_device", "pinned", "created")
    list_filter = ("namespace", "model", "pinned", "creator_device")
    search_fields = ("key", "namespace", "model", "creator_device")
    ordering = ("-created",)
    readonly_fields = [field.name for field in CacheEntry._meta.fields]
    actions = ["evict", "pin", "unpin"]

    def has_add_permission(self, request):
        return False  # entries come from boards, never typed in

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # "evict" removes from the cache box too; a bare delete would not

    def get_actions(self, request):
        actions = super().get_actions(request)
        if not request.user.is_staff:
            return {}
        return actions

    @admin.action(description="Evict selected entries from the cache box")
    def evict(self, request, queryset):
        from dashboard import actions  # the admin is a control-plane page

        page = _confirmed(self, request, queryset, "evict")
        if page:
            return page
        count = actions.evict_entries(request.user, queryset)
        self.message_user(request, f"Evicted {count} entries.", messages.SUCCESS)

    @admin.action(description="Pin selected entries (never evicted)")
    def pin(self, request, queryset):
        from dashboard import actions

        count = actions.pin_entries(request.user, queryset, True)
        self.message_user(request, f"Pinned {count} entries.", messages.SUCCESS)

    @admin.action(description="Unpin selected entries")
    def unpin(self, request, queryset):
        from dashboard import actions

        page = _confirmed(self, request, queryset, "unpin")
        if page:
            return page
        count = actions.pin_entries(request.user, queryset, False)
        self.message_user(request, f"Unpinned {count} entries.", messages.SUCCESS)
