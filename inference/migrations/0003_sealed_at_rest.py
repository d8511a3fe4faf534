# Schema sources sealed at rest (cachebox.at_rest); the rows written before are sealed here.

import cachebox.at_rest
from django.db import migrations


def seal(apps, schema_editor):
    cachebox.at_rest.seal_column(schema_editor, apps.get_model("inference", "schema")._meta.db_table, "source")


def unseal(apps, schema_editor):
    cachebox.at_rest.open_column(schema_editor, apps.get_model("inference", "schema")._meta.db_table, "source")


class Migration(migrations.Migration):

    dependencies = [
        ('inference', '0002_schema_namespace'),
    ]

    operations = [
        migrations.AlterField(
            model_name='schema',
            name='source',
            field=cachebox.at_rest.SealedTextField(help_text='the PML document (sealed at rest: cachebox.at_rest)'),
        ),
        migrations.RunPython(seal, unseal),
    ]
