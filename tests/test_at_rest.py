"""Text sealed at rest in the control plane's database (cachebox.at_rest): what the migration does to
rows stored before it."""

from __future__ import annotations

import uuid

import pytest

from .test_attacks import SECRET_ANSWER, SECRET_MODULE, SECRET_PROMPT, SECRET_SAVED, _database_copy


@pytest.mark.migrations
@pytest.mark.django_db(transaction=True, serialized_rollback=True)  # as the suite's other transactional tests
def test_the_migration_seals_what_was_stored_in_clear_and_going_back_opens_it():
    """Rows written before sealing existed stay readable: the migration seals them, and unapplying it
    stores them in clear again."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    # The sealing migration of each app (whatever its number), and the one it follows in that app.
    after = [key for key in executor.loader.graph.nodes if key[0] in ("dashboard", "inference") and key[1].endswith("_sealed_at_rest")]
    before = [next(parent for parent in executor.loader.graph.node_map[key].parents if parent.key[0] == key[0]).key for key in after]
    assert len(after) == 2, after
    executor.migrate(before)
    apps = executor.loader.project_state(before).apps
    namespace = apps.get_model("dashboard", "Namespace").objects.get_or_create(name="default")[0]
    device = apps.get_model("dashboard", "Device").objects.create(name="old", namespace=namespace)
    apps.get_model("dashboard", "InferenceRun").objects.create(device=device, title="the merger", prompt=SECRET_PROMPT, text=SECRET_ANSWER)
    apps.get_model("dashboard", "Dispatch").objects.create(request_id=uuid.uuid4(), kind="run", device=device, namespace="default", request={"segments": [SECRET_PROMPT]})
    apps.get_model("dashboard", "SavedPrompt").objects.create(name="notes", text=SECRET_SAVED)
    apps.get_model("inference", "Schema").objects.create(name="finance", source=SECRET_MODULE, digest="0")
    assert SECRET_PROMPT in _database_copy()

    executor = MigrationExecutor(connection)
    executor.migrate(after)
    copy = _database_copy()
    assert not any(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_MODULE, SECRET_SAVED))
    # The models as they are right after sealing (later migrations add columns the database lacks here).
    sealed = executor.loader.project_state(after).apps
    Dispatch, InferenceRun, SavedPrompt = (sealed.get_model("dashboard", name) for name in ("Dispatch", "InferenceRun", "SavedPrompt"))
    Schema = sealed.get_model("inference", "Schema")

    run = InferenceRun.objects.get(device__name="old")
    assert (run.title, run.prompt, run.text) == ("the merger", SECRET_PROMPT, SECRET_ANSWER)
    assert Dispatch.objects.get(device__name="old").request == {"segments": [SECRET_PROMPT]}
    assert SavedPrompt.objects.get(name="notes").text == SECRET_SAVED and Schema.objects.get(name="finance").source == SECRET_MODULE

    executor = MigrationExecutor(connection)
    executor.migrate(before)
    copy = _database_copy()
    assert all(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_MODULE, SECRET_SAVED)) and "ec1:" not in copy
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
