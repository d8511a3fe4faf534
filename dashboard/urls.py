from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from . import views
from .api import views as api
from .forms import LoginForm

urlpatterns = [
    path("", views.home, name="home"),
    path("charts.json", views.home_charts_json, name="home-charts"),
    path("devices/", views.device_list, name="devices"),
    path("devices/register/", views.device_register, name="device-register"),
    path("devices/<slug:name>/", views.device_detail, name="device-detail"),
    path("devices/<slug:name>/breakeven.json", views.device_breakeven, name="device-breakeven"),
    path("devices/<slug:name>/rotate/", views.device_rotate, name="device-rotate"),
    path("devices/<slug:name>/token/", views.device_token, name="device-token"),
    path("devices/<slug:name>/revoke/", views.device_revoke, name="device-revoke"),
    path("devices/<slug:name>/trust/", views.device_trust, name="device-trust"),
    path("run/", views.run_page, name="run"),
    path("run/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/", views.run_list, name="runs"),
    path("queue/", views.queue_page, name="queue"),
    path("queue/revoke/", views.queue_revoke, name="queue-revoke"),
    path("runs/export.csv", views.run_export, {"fmt": "csv"}, name="runs-export-csv"),
    path("runs/export.json", views.run_export, {"fmt": "json"}, name="runs-export-json"),
    path("runs/<int:pk>/", views.run_detail, name="run-detail"),
    path("favicon.ico", views.favicon, name="favicon"),
    path("schemas/", views.schema_list, name="schemas"),
    path("schemas/new/", views.schema_edit, name="schema-new"),
    path("schemas/<int:pk>/", views.schema_detail, name="schema-detail"),
    path("schemas/<int:pk>/edit/", views.schema_edit, name="schema-edit"),
    path("schemas/<int:pk>/encode/", views.schema_encode, name="schema-encode"),
    path("schemas/<int:pk>/delete/", views.schema_delete, name="schema-delete"),
    path("keys/", views.api_key_list, name="api-keys"),
    path("keys/created/", views.api_key_created, name="api-key-created"),
    path("keys/<int:pk>/revoke/", views.api_key_revoke, name="api-key-revoke"),
    path("cache/", views.cache_page, name="cache"),
    path("benchmarks/", views.benchmark_list, name="benchmarks"),
    path("benchmarks/<slug:name>/", views.benchmark_report, name="benchmark-report"),
    path("lab/", views.lab_page, name="lab"),
    path("cache/flush/", views.cache_flush, name="cache-flush"),
    path("vendor/plotly.min.js", views.plotly_js, name="plotly-js"),
    path("metrics", views.metrics_view, name="metrics"),
    path("health", views.health_view, name="health"),
    path("ready", views.ready_view, name="ready"),
    path("accounts/login/", auth_views.LoginView.as_view(authentication_form=LoginForm), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    # The OpenAI-compatible API (API keys, not logins; dashboard.api).
    path("v1/models", api.models, name="api-models"),
    path("v1/models/<str:model>", api.model_detail, name="api-model"),
    path("v1/chat/completions", api.chat_completions, name="api-chat"),
    path("v1/completions", api.completions, name="api-completions"),
]
