import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


def create_default(apps, schema_editor):
    apps.get_model("dashboard", "Namespace").objects.get_or_create(name="default")


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="Namespace",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "name",
                    models.CharField(
                        max_length=40,
                        unique=True,
                        validators=[
                            django.core.validators.RegexValidator(
                                "^[A-Za-z0-9_-]{1,40}$", "Use 1-40 letters, digits, '-' or '_'."
                            )
                        ],
                    ),
                ),
                (
                    "share_across_devices",
                    models.BooleanField(
                        default=True,
                        help_text="off for sensitive prompts: each board then caches for itself only, so no board can learn from a fast answer that another one saw the same prompt (timing side channel)",
                    ),
                ),
                ("key_generation", models.PositiveIntegerField(default=1, editable=False)),
                ("key_rotated_at", models.DateTimeField(blank=True, editable=False, null=True)),
                ("created", models.DateTimeField(auto_now_add=True)),
            ],
            options={"ordering": ["name"]},
        ),
        migrations.RunPython(create_default, migrations.RunPython.noop),
        migrations.AddField(
            model_name="device",
            name="namespace",
            field=models.ForeignKey(
                db_column="namespace",
                default="default",
                help_text="the tenant whose cache entries this board may read and write",
                on_delete=django.db.models.deletion.PROTECT,
                related_name="devices",
                to="dashboard.namespace",
                to_field="name",
            ),
        ),
        migrations.AddField(
            model_name="device",
            name="wrap_key",
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
    ]
