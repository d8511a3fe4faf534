"""The OpenAI-compatible API: its keys (one namespace each, stored hashed) and runs marked "api"."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0005_memberships"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name="inferencerun",
            name="source",
            field=models.CharField(
                choices=[("text", "free text"), ("mmlu", "MMLU question"), ("saved", "saved prompt"), ("api", "API")],
                default="text",
                max_length=10,
            ),
        ),
        migrations.CreateModel(
            name="ApiKey",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "name",
                    models.CharField(
                        blank=True, help_text="what it is for (shown in lists and run titles)", max_length=100
                    ),
                ),
                ("key_sha256", models.CharField(editable=False, max_length=64, unique=True)),
                (
                    "key_prefix",
                    models.CharField(
                        editable=False, help_text="the key's first characters, to recognize it", max_length=16
                    ),
                ),
                (
                    "rate_per_minute",
                    models.PositiveIntegerField(
                        blank=True,
                        help_text="requests per minute; empty: EDGECACHE_API_RATE (60); 0: no limit",
                        null=True,
                    ),
                ),
                ("created", models.DateTimeField(auto_now_add=True)),
                ("last_used", models.DateTimeField(blank=True, editable=False, null=True)),
                ("revoked_at", models.DateTimeField(blank=True, editable=False, null=True)),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "namespace",
                    models.ForeignKey(
                        db_column="namespace",
                        help_text="the tenant whose boards (and so cache entries) the key reaches",
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="api_keys",
                        to="dashboard.namespace",
                        to_field="name",
                    ),
                ),
            ],
            options={"verbose_name": "API key", "ordering": ["namespace", "name", "pk"]},
        ),
    ]
