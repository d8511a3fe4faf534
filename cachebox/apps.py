from django.apps import AppConfig


class CacheboxConfig(AppConfig):
    name = "cachebox"
    verbose_name = "Cache box"
    default_auto_field = "django.db.models.BigAutoField"
