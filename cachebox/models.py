"""The control plane's mirror of what the cache box holds (for the admin).

The store (Redis/Valkey) is the truth; rows are written when boards report uploads
and hits, and ``python manage.py reconcile`` rebuilds them from the store.
"""

from django.db import models


class CacheEntry(models.Model):
    key = models.CharField(max_length=200, unique=True, help_text="Redis key of the entry")
    model = models.CharField(max_length=32, db_index=True, help_text="model fingerprint")
    namespace = models.CharField(max_length=64, db_index=True)
    start = models.PositiveIntegerField(help_text="first token position of the range")
    end = models.PositiveIntegerField(help_text="one past the last token position")
    bytes = models.PositiveBigIntegerField()
    hits = models.PositiveIntegerField(default=0)
    last_hit = models.DateTimeField(null=True, blank=True)
    creator_device = models.CharField(max_length=64, blank=True)
    pinned = models.BooleanField(default=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created"]
        verbose_name_plural = "cache entries"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.model} [{self.start}, {self.end})"

    @property
    def tokens(self) -> int:
        return self.end - self.start
