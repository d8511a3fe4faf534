from django.contrib import admin

from .models import AuditEvent, Device, InferenceRun, SavedPrompt


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "cpu_threads", "link_bandwidth_mbps", "link_rtt_ms", "last_seen", "revoked_at")
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
