from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0006_api")]

    operations = [
        migrations.AddField(
            model_name="dispatch",
            name="routing",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="the prompt's prefix keys and expected work; for a run sent to any board, the router's choice and its expected saving",
            ),
        ),
    ]
