"""Prompt schemas as the control plane keeps them. Boards never read these rows: a schema
travels to a board inside its task message."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.urls import reverse

from cachebox.at_rest import SealedTextField

from .pml import PMLError, parse_schema


class Schema(models.Model):
    name = models.CharField(max_length=64, unique=True, editable=False, help_text="from <schema name=...>")
    source = SealedTextField(help_text="the PML document (sealed at rest: cachebox.at_rest)")
    digest = models.CharField(max_length=16, editable=False, help_text="changes whenever the source does")
    # The tenant whose keys, pages and boards may use it; "" is shared with every namespace (staff
    # choose to share one). A name (``dashboard.Namespace``), not a foreign key: boards' app
    # (inference) knows nothing of the control plane's models.
    namespace = models.CharField(max_length=40, blank=True, default="", help_text="the namespace that owns it; empty: shared with every namespace")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("schema-detail", args=[self.pk])

    def clean(self):
        try:
            parsed = parse_schema(self.source)
        except PMLError as exc:
            raise ValidationError({"source": str(exc)})
        try:
            from .schema_serving import layout_for  # the vocabulary loads on first use only

            layout_for(self.source, settings.EDGECACHE_MODEL, settings.EDGECACHE_N_CTX)
        except PMLError as exc:
            raise ValidationError({"source": str(exc)})
        duplicate = Schema.objects.filter(name=parsed.name).exclude(pk=self.pk)
        if duplicate.exists():
            raise ValidationError({"source": f"a schema named {parsed.name!r} exists already; rename this one or edit that one"})
        self.name, self.digest = parsed.name, parsed.digest
