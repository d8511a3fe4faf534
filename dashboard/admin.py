from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.template.response import TemplateResponse

from .models import AuditEvent, Device, InferenceRun, Namespace, SavedPrompt


@admin.register(Namespace)
class NamespaceAdmin(admin.ModelAdmin):
    """Tenants: whether their boards share entries, and their signing keys (rotate: staff, confirmed, logged)."""

    list_display = ("name", "share_across_devices", "key_generation", "key_rotated_at", "device_count", "created")
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
        from .actions import save_namespace

        save_namespace(request.user, obj)

    @admin.action(description="Rotate the signing key of selected namespaces")
    def rotate_key(self, request, queryset):
        from .actions import rotate_signing_key

        if not request.user.is_staff:
            return None
        if request.POST.get("confirmed") != "yes":
            return TemplateResponse(
                request,
                "admin/dashboard/confirm_rotate.html",
                {
                    **self.admin_site.each_context(request),
                    "title": f"Rotate the signing key of {queryset.count()} namespace(s)?",
                    "namespaces": queryset,
                    "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
                    "select_across": request.POST.get("select_across", "0"),
                    "opts": self.model._meta,
                },
            )
        generations = [f"{namespace.name} → {rotate_signing_key(request.user, namespace)}" for namespace in queryset]
        self.message_user(request, "New signing keys: " + ", ".join(generations), messages.SUCCESS)


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("name", "namespace", "kind", "cpu_threads", "link_bandwidth_mbps", "link_rtt_ms", "last_seen", "revoked_at")
    list_filter = ("namespace",)
    readonly_fields = ("token_sha256", "token_hint", "token_created", "revoked_at", "last_seen", "status", "created")
    search_fields = ("name", "kind")

    def has_add_permission(self, request):
        return False  # register on the Devices page, which issues the token

    def save_model(self, request, obj, form, change):
        from .actions import update_device

        update_device(request.user, obj)


@admin.register(InferenceRun)
class InferenceRunAdmin(admin.ModelAdmin):
    list_display = ("created", "device", "title", "case", "matched_tokens", "prompt_tokens", "ttft_ms", "ttlt_ms", "error")
    list_filter = ("device", "case", "source")
    search_fields = ("title", "text", "prompt")
    readonly_fields = [field.name for field in InferenceRun._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(SavedPrompt)
class SavedPromptAdmin(admin.ModelAdmin):
    list_display = ("name", "split_on", "created_by", "created")
    search_fields = ("name", "text")

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
