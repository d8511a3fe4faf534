"""Text sealed at rest in the control plane's database (dashboard.security.at_rest): what the migration does to
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
    # The sealing migration (whatever its number), and the one it follows.
    after = [key for key in executor.loader.graph.nodes if key[0] == "dashboard" and key[1].endswith("_sealed_at_rest")]
    before = [next(parent for parent in executor.loader.graph.node_map[key].parents if parent.key[0] == key[0]).key for key in after]
    assert len(after) == 1, after
    executor.migrate(before)
    apps = executor.loader.project_state(before).apps
    namespace = apps.get_model("dashboard", "Namespace").objects.get_or_create(name="default")[0]
    device = apps.get_model("dashboard", "Device").objects.create(name="old", namespace=namespace)
    apps.get_model("dashboard", "InferenceRun").objects.create(device=device, title="the merger", prompt=SECRET_PROMPT, text=SECRET_ANSWER)
    apps.get_model("dashboard", "Dispatch").objects.create(request_id=uuid.uuid4(), kind="run", device=device, namespace="default", request={"segments": [SECRET_PROMPT]})
    apps.get_model("dashboard", "SavedPrompt").objects.create(name="notes", text=SECRET_SAVED)
    assert SECRET_PROMPT in _database_copy()

    executor = MigrationExecutor(connection)
    executor.migrate(after)
    copy = _database_copy()
    assert not any(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_SAVED))
    # The models as they are right after sealing (later migrations add columns the database lacks here).
    sealed = executor.loader.project_state(after).apps
    Dispatch, InferenceRun, SavedPrompt = (sealed.get_model("dashboard", name) for name in ("Dispatch", "InferenceRun", "SavedPrompt"))

    run = InferenceRun.objects.get(device__name="old")
    assert (run.title, run.prompt, run.text) == ("the merger", SECRET_PROMPT, SECRET_ANSWER)
    assert Dispatch.objects.get(device__name="old").request == {"segments": [SECRET_PROMPT]}
    assert SavedPrompt.objects.get(name="notes").text == SECRET_SAVED

    executor = MigrationExecutor(connection)
    executor.migrate(before)
    copy = _database_copy()
    assert all(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_SAVED)) and "ec1:" not in copy
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.migrations
@pytest.mark.django_db(transaction=True, serialized_rollback=True)
def test_schemas_and_cache_entries_of_a_database_made_before_they_moved_into_dashboard_are_kept():
    """A database whose schemas and cache-box mirror were made when boards' packages held those
    models (tables inference_schema, cachebox_cacheentry) keeps its rows, and a schema source an older
    release stored in clear is sealed."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from dashboard.security.at_rest import is_sealed

    move = ("dashboard", "0018_schema_and_cache_entries_move_here")
    executor = MigrationExecutor(connection)
    executor.migrate([move])
    apps = executor.loader.project_state([move]).apps
    apps.get_model("dashboard", "Schema").objects.create(name="finance", source=SECRET_MODULE, digest="0")
    apps.get_model("dashboard", "CacheEntry").objects.create(key="ec:e:1", model="m", namespace="default", start=0, end=8, bytes=64)
    # Back to before the move: the tables get their former names (where the release before reads them).
    before = next(parent.key for parent in executor.loader.graph.node_map[move].parents if parent.key[0] == "dashboard")
    MigrationExecutor(connection).migrate([before])
    tables = set(connection.introspection.table_names())
    assert {"inference_schema", "cachebox_cacheentry"} <= tables and not {"dashboard_schema", "dashboard_cacheentry"} & tables
    with connection.cursor() as cursor:  # as a release before sealing stored it
        cursor.execute("UPDATE inference_schema SET source = %s", [SECRET_MODULE])

    executor = MigrationExecutor(connection)
    executor.migrate([move])
    moved = executor.loader.project_state([move]).apps
    assert moved.get_model("dashboard", "Schema").objects.get(name="finance").source == SECRET_MODULE
    assert moved.get_model("dashboard", "CacheEntry").objects.get(key="ec:e:1").end == 8
    with connection.cursor() as cursor:
        cursor.execute("SELECT source FROM dashboard_schema")
        assert is_sealed(cursor.fetchone()[0])
    assert not {"inference_schema", "cachebox_cacheentry"} & set(connection.introspection.table_names())
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
