from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("inference", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="schema",
            name="namespace",
            field=models.CharField(blank=True, default="", help_text="the namespace that owns it; empty: shared with every namespace", max_length=40),
        ),
    ]
