# Prompt schemas and the cache box's mirror move into the control plane's app: the packages a board
# installs (inference, cachebox) carry no Django model any more. A database made before keeps its
# rows: the tables of the apps that held them (inference_schema, cachebox_cacheentry) are renamed,
# a column an older release lacked is added, and schema sources still stored in clear are sealed
# (dashboard.security.at_rest). A new database gets the tables made here.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

import dashboard.security.at_rest

FORMER = {"Schema": ("inference", "inference_schema"), "CacheEntry": ("cachebox", "cachebox_cacheentry")}


def adopt_or_create(apps, schema_editor):
    connection = schema_editor.connection
    tables = set(connection.introspection.table_names())
    for name, (former_app, former_table) in FORMER.items():
        model = apps.get_model("dashboard", name)
        if former_table not in tables:
            schema_editor.create_model(model)
            continue
        schema_editor.alter_db_table(model, former_table, model._meta.db_table)
        with connection.cursor() as cursor:
            columns = {
                column.name for column in connection.introspection.get_table_description(cursor, model._meta.db_table)
            }
        for field in model._meta.local_fields:
            if field.column not in columns:
                schema_editor.add_field(model, field)
        ContentType = apps.get_model("contenttypes", "ContentType")
        if not ContentType.objects.filter(app_label="dashboard", model=name.lower()).exists():
            ContentType.objects.filter(app_label=former_app, model=name.lower()).update(app_label="dashboard")
    dashboard.security.at_rest.seal_column(
        schema_editor, apps.get_model("dashboard", "Schema")._meta.db_table, "source"
    )


def give_back(apps, schema_editor):
    """Back to the tables' former names (the release before this one reads them there)."""
    for name, (_, former_table) in FORMER.items():
        model = apps.get_model("dashboard", name)
        schema_editor.alter_db_table(model, model._meta.db_table, former_table)


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0017_entry_audits"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="CacheEntry",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("key", models.CharField(help_text="Redis key of the entry", max_length=200, unique=True)),
                        ("model", models.CharField(db_index=True, help_text="model fingerprint", max_length=32)),
                        ("namespace", models.CharField(db_index=True, max_length=64)),
                        ("start", models.PositiveIntegerField(help_text="first token position of the range")),
                        ("end", models.PositiveIntegerField(help_text="one past the last token position")),
                        ("bytes", models.PositiveBigIntegerField()),
                        ("hits", models.PositiveIntegerField(default=0)),
                        ("last_hit", models.DateTimeField(blank=True, null=True)),
                        ("creator_device", models.CharField(blank=True, max_length=64)),
                        ("pinned", models.BooleanField(default=False)),
                        ("created", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "verbose_name_plural": "cache entries",
                        "ordering": ["-created"],
                    },
                ),
                migrations.CreateModel(
                    name="Schema",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "name",
                            models.CharField(
                                editable=False, help_text="from <schema name=...>", max_length=64, unique=True
                            ),
                        ),
                        (
                            "source",
                            dashboard.security.at_rest.SealedTextField(
                                help_text="the PML document (sealed at rest: dashboard.security.at_rest)"
                            ),
                        ),
                        (
                            "digest",
                            models.CharField(
                                editable=False, help_text="changes whenever the source does", max_length=16
                            ),
                        ),
                        (
                            "namespace",
                            models.CharField(
                                blank=True,
                                default="",
                                help_text="the namespace that owns it; empty: shared with every namespace",
                                max_length=40,
                            ),
                        ),
                        ("created", models.DateTimeField(auto_now_add=True)),
                        ("updated", models.DateTimeField(auto_now=True)),
                        (
                            "created_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "ordering": ["name"],
                    },
                ),
            ]
        ),
        migrations.RunPython(adopt_or_create, give_back),
    ]
