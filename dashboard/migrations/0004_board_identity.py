"""Boards hold their own key pairs: tokens enroll once; requests remember where they were sent."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0003_run_counters")]

    operations = [
        migrations.RemoveField(model_name="device", name="wrap_key"),
        migrations.RemoveField(model_name="device", name="token_hint"),
        migrations.AddField(
            model_name="device", name="enroll_key", field=models.CharField(blank=True, editable=False, max_length=64)
        ),
        migrations.AddField(
            model_name="device",
            name="signing_public_key",
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name="device",
            name="box_public_key",
            field=models.CharField(blank=True, editable=False, max_length=64),
        ),
        migrations.AddField(
            model_name="device", name="enrolled_at", field=models.DateTimeField(blank=True, editable=False, null=True)
        ),
        migrations.AddField(
            model_name="device",
            name="last_message_ts",
            field=models.FloatField(
                default=0.0, editable=False, help_text="send time of the newest heartbeat accepted (replays are older)"
            ),
        ),
        migrations.CreateModel(
            name="Dispatch",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("request_id", models.UUIDField(unique=True)),
                ("kind", models.CharField(choices=[("run", "run"), ("encode", "encode")], max_length=8)),
                ("namespace", models.CharField(max_length=64)),
                ("created", models.DateTimeField(auto_now_add=True, db_index=True)),
                (
                    "device",
                    models.ForeignKey(
                        blank=True,
                        help_text="empty: any board of the namespace",
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="dispatches",
                        to="dashboard.device",
                    ),
                ),
            ],
        ),
    ]
