from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.template.response import TemplateResponse

from dashboard.models import CacheEntry
from dashboard.pages.entry_preview import previews
from dashboard.pages.explain import human_bytes

from .models import ApiKey, AuditEvent, Device, InferenceRun, Membership, Namespace, SavedPrompt

SHOWN = 50  # items listed on a confirmation page


def confirmation(
    modeladmin, request, queryset, *, title: str, verb: str, explanation: str, describe, destructive: bool = True
):
    """None once the staff member has confirmed this action; otherwise the page that asks (``describe`` lists each object)."""
    if request.POST.get("confirmed") == "yes":
        return None
    count = queryset.count()
    return TemplateResponse(
        request,
        "admin/confirm_action.html",
        {
            **modeladmin.admin_site.each_context(request),
            "title": title,
            "verb": verb,
            "explanation": explanation,
            "destructive": destructive,
            "items": [describe(obj) for obj in queryset[:SHOWN]],
            "more": max(0, count - SHOWN),
            "action": request.POST.get("action"),
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "opts": modeladmin.model._meta,
        },
    )


@admin.register(Namespace)
class NamespaceAdmin(admin.ModelAdmin):
    """Tenants: whether their boards share entries, and their signing keys (rotate: staff, confirmed, logged)."""

    list_display = (
        "name",
        "share_across_devices",
        "share_across_kernel_classes",
        "members_manage_api_keys",
        "key_generation",
        "key_rotated_at",
        "device_count",
        "created",
    )
    readonly_fields = ("key_generation", "key_rotated_at", "created")
    actions = ["rotate_key"]

    @admin.display(description="devices")
    def device_count(self, obj):
        return obj.devices.count()

    def get_readonly_fields(self, request, obj=None):
        # A namespace's name is in every key of its entries: fixed once created.
        return self.readonly_fields + (("name",) if obj else ())

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser and (obj is None or not obj.devices.exists())

    def save_model(self, request, obj, form, change):
        from .actions import save_namespace  # lazy: admin loads at every django.setup(); the actions only when used

        save_namespace(request.user, obj)

    @admin.action(description="Rotate the signing key of selected namespaces")
    def rotate_key(self, request, queryset):
        from .actions import rotate_signing_key  # lazy: admin loads at every django.setup(); the actions only when used

        if not request.user.is_staff:
            return None
        page = confirmation(
            self,
            request,
            queryset,
            title=f"Rotate the signing key of {queryset.count()} namespace(s)?",
            verb="rotate",
            explanation="Boards of these namespaces receive the new key at their next heartbeat and sign with it from then on. "
            "Entries signed with the key before it stay valid; entries signed with older keys are refused and evicted when met.",
            describe=lambda ns: (
                f"{ns.name}: generation {ns.key_generation} → {ns.key_generation + 1}, {ns.devices.count()} device(s)"
            ),
        )
        if page:
            return page
        generations = [f"{namespace.name} → {rotate_signing_key(request.user, namespace)}" for namespace in queryset]
        self.message_user(request, "New signing keys: " + ", ".join(generations), messages.SUCCESS)


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "namespace",
        "kind",
        "cpu_threads",
        "link_bandwidth_mbps",
        "link_rtt_ms",
        "last_seen",
        "revoked_at",
    )
    list_filter = ("namespace",)
    readonly_fields = (
        "token_created",
        "enrolled_at",
        "signing_public_key",
        "box_public_key",
        "revoked_at",
        "last_seen",
        "status",
        "created",
    )
    search_fields = ("name", "kind")

    def has_add_permission(self, request):
        return False  # register on the Devices page, which issues the token

    def save_model(self, request, obj, form, change):
        from .actions import update_device  # lazy: admin loads at every django.setup(); the actions only when used

        update_device(request.user, obj)


@admin.register(InferenceRun)
class InferenceRunAdmin(admin.ModelAdmin):
    list_display = (
        "created",
        "device",
        "title",
        "case",
        "matched_tokens",
        "prompt_tokens",
        "ttft_ms",
        "ttlt_ms",
        "error",
    )
    list_filter = ("device", "case", "source")
    # no search_fields: titles, prompts and answers are sealed at rest, SQL cannot search them (the Runs page can)
    readonly_fields = [field.name for field in InferenceRun._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(SavedPrompt)
class SavedPromptAdmin(admin.ModelAdmin):
    list_display = ("name", "split_on", "created_by", "created")
    search_fields = ("name",)  # the text is sealed at rest

    def save_model(self, request, obj, form, change):
        if not obj.created_by_id:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created", "user", "action", "target", "detail")
    list_filter = ("action",)
    readonly_fields = ("created", "user", "action", "target", "detail")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


# The control plane's mirror of the cache box's entries (CacheEntry) and its admin pages:
# cachebox is a plain library and knows no Django.
_ENTRY_CONSEQUENCES = {
    "evict": "Evicting deletes them from the cache box: this cannot be undone from here. Boards that meet these prompts "
    "again prefill them and upload new entries.",
    "pin": "Pinned entries never expire: they stay in the cache box until unpinned or evicted.",
    "unpin": "Unpinning deletes nothing: the entries stay in the cache box and are served as before, and now expire "
    "after their time to live like any other entry. You can pin them again at any time.",
}


def entry_line(entry: CacheEntry, holds: str = "") -> str:
    """One entry as a person reads it: what it holds, where, how big."""
    what = f"“{holds}” " if holds else ""
    return f"{what}{entry.namespace}, tokens {entry.start}–{entry.end} ({entry.tokens} tokens), {human_bytes(entry.bytes)}, {entry.hits} hit{'s' if entry.hits != 1 else ''}"


def _confirm_entries(modeladmin, request, queryset, verb: str):
    """None after the staff member confirmed; otherwise the page that asks, in the words of the action."""
    holds = previews(queryset[:SHOWN])
    return confirmation(
        modeladmin,
        request,
        queryset,
        title=f"{verb.capitalize()} {queryset.count()} cache entries?",
        verb=verb,
        explanation=_ENTRY_CONSEQUENCES[verb],
        describe=lambda e: entry_line(e, holds.get(e.key, "")),
        destructive=verb == "evict",
    )


@admin.register(CacheEntry)
class CacheEntryAdmin(admin.ModelAdmin):
    """Filter, sort, evict, pin and unpin cache entries (staff only, confirmed, logged)."""

    list_display = (
        "holds",
        "namespace",
        "start",
        "end",
        "tokens",
        "size",
        "hits",
        "last_hit",
        "creator_device",
        "pinned",
        "created",
        "key",
        "model",
    )
    list_filter = ("namespace", "model", "pinned", "creator_device")
    search_fields = ("key", "namespace", "model", "creator_device")
    ordering = ("-created",)
    readonly_fields = [field.name for field in CacheEntry._meta.fields]
    actions = ["evict", "pin", "unpin"]

    def has_add_permission(self, request):
        return False  # entries come from boards, never typed in

    @admin.display(description="holds")
    def holds(self, obj):
        """The first words of the entry's range (or its schema and module), from the run that stored it."""
        return previews([obj]).get(obj.key) or "–"

    @admin.display(description="size", ordering="bytes")
    def size(self, obj):
        return human_bytes(obj.bytes)

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
        from .actions import evict_entries  # lazy: admin loads at every django.setup(); the actions only when used

        page = _confirm_entries(self, request, queryset, "evict")
        if page:
            return page
        count = evict_entries(request.user, queryset)
        self.message_user(request, f"Evicted {count} entries.", messages.SUCCESS)

    @admin.action(description="Pin selected entries (never expire)")
    def pin(self, request, queryset):
        from .actions import pin_entries  # lazy: admin loads at every django.setup(); the actions only when used

        count = pin_entries(request.user, queryset, True)
        self.message_user(request, f"Pinned {count} entries.", messages.SUCCESS)

    @admin.action(description="Unpin selected entries")
    def unpin(self, request, queryset):
        from .actions import pin_entries  # lazy: admin loads at every django.setup(); the actions only when used

        page = _confirm_entries(self, request, queryset, "unpin")
        if page:
            return page
        count = pin_entries(request.user, queryset, False)
        self.message_user(request, f"Unpinned {count} entries.", messages.SUCCESS)


# -- who sees which tenant: memberships (staff see every namespace; others only their own) ----------
class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    fields = ("namespace", "created")
    readonly_fields = ("created",)
    verbose_name = "namespace this user sees"
    verbose_name_plural = "namespaces this user sees (staff see every namespace)"


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "namespace", "created")
    list_filter = ("namespace",)
    search_fields = ("user__username", "namespace__name")
    readonly_fields = ("created",)


_User = get_user_model()
if admin.site.is_registered(_User):
    admin.site.unregister(_User)


@admin.register(_User)
class EdgeCacheUserAdmin(UserAdmin):
    """Django's user page, plus the namespaces the user sees (editable in place)."""

    inlines = [*UserAdmin.inlines, MembershipInline]


# -- keys of the OpenAI-compatible API (/v1/): shown once, stored hashed, revocable ------------------
@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """API keys: one namespace each; the key is shown once when created, then only its first characters."""

    list_display = (
        "key_prefix",
        "name",
        "namespace",
        "rate_per_minute",
        "created_by",
        "created",
        "last_used",
        "revoked_at",
    )
    list_filter = ("namespace", "revoked_at")
    search_fields = ("name", "key_prefix")
    fields = ("name", "namespace", "rate_per_minute", "key_prefix", "created_by", "created", "last_used", "revoked_at")
    readonly_fields = ("key_prefix", "created_by", "created", "last_used", "revoked_at")
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        # A key's namespace is what it reaches: fixed once created (make another key instead).
        return self.readonly_fields + (("namespace",) if obj else ())

    def save_model(self, request, obj, form, change):
        # lazy: admin loads at every django.setup(); the actions only when used
        from .actions.api_keys import create_key

        if change:
            super().save_model(request, obj, form, change)
            return
        row, key = create_key(request.user, obj.namespace, name=obj.name, rate_per_minute=obj.rate_per_minute)
        obj.pk, obj.key_prefix = row.pk, row.key_prefix
        request._edgecache_api_key = key  # shown once, by response_add

    def response_add(self, request, obj, post_url_continue=None):
        """The key, once, on the dashboard's own page (the one the API keys page shows)."""
        from django.shortcuts import redirect

        # lazy: admin loads at every django.setup(); the views (API, benchmarks) only here
        from .views.api_keys import KEY_SESSION_KEY

        key = getattr(request, "_edgecache_api_key", None)
        if key is None:
            return super().response_add(request, obj, post_url_continue)
        request.session[KEY_SESSION_KEY] = {"id": obj.pk, "key": key}
        return redirect("api-key-created")

    @admin.action(description="Revoke the selected API keys")
    def revoke(self, request, queryset):
        # lazy: admin loads at every django.setup(); the actions only when used
        from .actions.api_keys import revoke_key

        queryset = queryset.filter(revoked_at__isnull=True)
        page = confirmation(
            self,
            request,
            queryset,
            title="Revoke API keys",
            verb="Revoke",
            explanation="Requests with these keys are refused (401) from now on. This cannot be undone: make a new key instead.",
            describe=str,
        )
        if page:
            return page
        count = 0
        for row in queryset:
            revoke_key(request.user, row)
            count += 1
        self.message_user(request, f"Revoked {count} API keys.", messages.SUCCESS)
