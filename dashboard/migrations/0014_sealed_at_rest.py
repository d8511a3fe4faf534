# Prompts, titles (which start with them), answers, saved prompts and requests under way sealed at rest (dashboard.security.at_rest); the rows written before are sealed here.

from django.db import migrations

import dashboard.security.at_rest

COLUMNS = [
    ("dispatch", "request", True),
    ("inferencerun", "title", False),
    ("inferencerun", "prompt", False),
    ("inferencerun", "text", False),
    ("savedprompt", "text", False),
]


def seal(apps, schema_editor):
    for model, column, is_json in COLUMNS:
        dashboard.security.at_rest.seal_column(
            schema_editor, apps.get_model("dashboard", model)._meta.db_table, column, is_json=is_json
        )


def unseal(apps, schema_editor):
    for model, column, is_json in COLUMNS:
        dashboard.security.at_rest.open_column(
            schema_editor, apps.get_model("dashboard", model)._meta.db_table, column, is_json=is_json
        )


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0013_namespace_members_manage_api_keys"),
    ]

    operations = [
        migrations.AlterField(
            model_name="dispatch",
            name="request",
            field=dashboard.security.at_rest.SealedJSONField(
                blank=True,
                default=dict,
                help_text="the request while it is under way (for a re-send); emptied when it ends; sealed at rest",
            ),
        ),
        migrations.AlterField(
            model_name="inferencerun",
            name="title",
            field=dashboard.security.at_rest.SealedTextField(blank=True),
        ),
        migrations.AlterField(
            model_name="inferencerun",
            name="prompt",
            field=dashboard.security.at_rest.SealedTextField(blank=True),
        ),
        migrations.AlterField(
            model_name="inferencerun",
            name="text",
            field=dashboard.security.at_rest.SealedTextField(blank=True),
        ),
        migrations.AlterField(
            model_name="savedprompt",
            name="text",
            field=dashboard.security.at_rest.SealedTextField(),
        ),
        migrations.RunPython(seal, unseal),
    ]
