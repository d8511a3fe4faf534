"""What the control plane shows of a schema: its modules' token counts and positions, and
which of them the cache box holds for each model. Reads the model's vocabulary only."""

from __future__ import annotations

from django.conf import settings

from cachebox.keys import module_key, module_key_name
from inference.serving.pml_layout import SchemaLayout, all_pieces
from inference.serving.schema import layout_for


def layout_of(source: str) -> SchemaLayout:
    """Parse and lay out a schema with the configured model's tokenizer (raises PMLError, also for
    a layout the context cannot hold)."""
    return layout_for(source, settings.EDGECACHE_MODEL, settings.EDGECACHE_N_CTX)


def describe(layout: SchemaLayout) -> list[dict]:
    """One row per module and scaffold: kind, token count, positions, parameters, union."""
    rows = []
    for path, module in layout.modules.items():
        rows.append(
            {
                "piece": path,
                "kind": "schema text" if module.anonymous else "module",
                "tokens": module.token_count,
                "start": module.start,
                "end": module.end,
                "params": ", ".join(
                    f"{name} (len {length} at {start})" for name, (start, length) in module.params.items()
                ),
                "union": module.union or "",
            }
        )
    for name, members in layout.scaffolds.items():
        modules = [layout.modules[m] for m in members]
        rows.append(
            {
                "piece": f"scaffold:{name}",
                "kind": "scaffold",
                "tokens": sum(m.token_count for m in modules),
                "start": min(m.start for m in modules),
                "end": max(m.end for m in modules),
                "params": "",
                "union": " + ".join(members),
            }
        )
    return rows


def key_names(layout: SchemaLayout, fingerprint: str, namespace: str) -> dict[str, str]:
    """Cache-box key of every piece of a schema, for one model and namespace."""
    return {
        piece.key_name: module_key_name(
            namespace, fingerprint, layout.digest, module_key(namespace, fingerprint, layout.digest, piece.key_name)
        )
        for piece in all_pieces(layout)
    }
