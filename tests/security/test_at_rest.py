"""Text sealed at rest in the control plane's database (dashboard.security.at_rest): what the migration does to
rows stored before it."""

from __future__ import annotations

import pytest

from tests.security.test_attacks import SECRET_MODULE

# Run by `manage.py shell` on a database file of its own (a migration test on the suite's shared test
# database clashed with the content types other tests had made, under serialized rollback).
SEALING = """
import uuid

from tests.security.test_attacks import SECRET_ANSWER, SECRET_PROMPT, SECRET_SAVED, _database_copy

from django.db import connection
from django.db.migrations.executor import MigrationExecutor

executor = MigrationExecutor(connection)
# The sealing migration (whatever its number), and the one it follows.
after = [key for key in executor.loader.graph.nodes if key[0] == "dashboard" and key[1].endswith("_sealed_at_rest")]
before = [
    next(parent for parent in executor.loader.graph.node_map[key].parents if parent.key[0] == key[0]).key
    for key in after
]
assert len(after) == 1, after
executor.migrate(before)
apps = executor.loader.project_state(before).apps
namespace = apps.get_model("dashboard", "Namespace").objects.get_or_create(name="default")[0]
device = apps.get_model("dashboard", "Device").objects.create(name="old", namespace=namespace)
apps.get_model("dashboard", "InferenceRun").objects.create(
    device=device, title="the merger", prompt=SECRET_PROMPT, text=SECRET_ANSWER
)
apps.get_model("dashboard", "Dispatch").objects.create(
    request_id=uuid.uuid4(), kind="run", device=device, namespace="default", request={"segments": [SECRET_PROMPT]}
)
apps.get_model("dashboard", "SavedPrompt").objects.create(name="notes", text=SECRET_SAVED)
assert SECRET_PROMPT in _database_copy()

executor = MigrationExecutor(connection)
executor.migrate(after)
copy = _database_copy()
assert not any(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_SAVED))
# The models as they are right after sealing (later migrations add columns the database lacks here).
sealed = executor.loader.project_state(after).apps
Dispatch, InferenceRun, SavedPrompt = (
    sealed.get_model("dashboard", name) for name in ("Dispatch", "InferenceRun", "SavedPrompt")
)

run = InferenceRun.objects.get(device__name="old")
assert (run.title, run.prompt, run.text) == ("the merger", SECRET_PROMPT, SECRET_ANSWER)
assert Dispatch.objects.get(device__name="old").request == {"segments": [SECRET_PROMPT]}
assert SavedPrompt.objects.get(name="notes").text == SECRET_SAVED

executor = MigrationExecutor(connection)
executor.migrate(before)
copy = _database_copy()
assert all(secret in copy for secret in (SECRET_PROMPT, SECRET_ANSWER, SECRET_SAVED)) and "ec1:" not in copy
print("sealed, then opened again")
"""


@pytest.mark.processes
def test_the_migration_seals_what_was_stored_in_clear_and_going_back_opens_it(tmp_path):
    """Rows written before sealing existed stay readable: the migration seals them, and unapplying it
    stores them in clear again."""
    from tests.conftest import run_manage

    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "EDGECACHE_HOME": str(tmp_path / "home")}
    for args in (("migrate", "-v", "0"), ("shell", "-c", SEALING)):
        done = run_manage(*args, env=env, unset=("DATABASE_URL",))
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode().strip().endswith("sealed, then opened again")


@pytest.mark.processes
def test_schemas_and_cache_entries_of_a_database_made_before_they_moved_into_dashboard_are_kept(tmp_path):
    """A database whose schemas and cache-box mirror were made when boards' packages held those
    models (tables inference_schema, cachebox_cacheentry) keeps its rows, and a schema source an older
    release stored in clear is sealed. On a database file of its own, migrated by `manage.py migrate`
    as an operator upgrading would."""
    from tests.conftest import run_manage

    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "EDGECACHE_HOME": str(tmp_path / "home")}

    def manage(*args: str) -> str:
        done = run_manage(*args, env=env, unset=("DATABASE_URL",))
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        return done.stdout.decode()

    def sql(statement: str, *params) -> list:
        import sqlite3

        with sqlite3.connect(tmp_path / "db.sqlite3") as connection:
            return connection.execute(statement, params).fetchall()

    manage("migrate", "-v", "0")
    manage(
        "shell",
        "-c",
        (
            "from dashboard.models import Schema, CacheEntry; "
            f"Schema.objects.create(name='finance', source={SECRET_MODULE!r}, digest='0'); "
            "CacheEntry.objects.create(key='ec:e:1', model='m', namespace='default', start=0, end=8, bytes=64)"
        ),
    )
    # Back to before the move: the tables get their former names (where the release before reads them).
    manage("migrate", "dashboard", "0017", "-v", "0")
    tables = {row[0] for row in sql("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"inference_schema", "cachebox_cacheentry"} <= tables and not {
        "dashboard_schema",
        "dashboard_cacheentry",
    } & tables
    sql("UPDATE inference_schema SET source = ?", SECRET_MODULE)  # as a release before sealing stored it

    manage("migrate", "-v", "0")
    shown = manage(
        "shell",
        "-c",
        (
            "from dashboard.models import Schema, CacheEntry; "
            "print(repr(Schema.objects.get(name='finance').source)); print(CacheEntry.objects.get(key='ec:e:1').end)"
        ),
    ).splitlines()
    assert shown[-2:] == [repr(SECRET_MODULE), "8"]
    ((stored,),) = sql("SELECT source FROM dashboard_schema")
    assert stored.startswith("ec1:") and SECRET_MODULE not in stored  # sealed (dashboard.security.at_rest)
    tables = {row[0] for row in sql("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"dashboard_schema", "dashboard_cacheentry"} <= tables and not {
        "inference_schema",
        "cachebox_cacheentry",
    } & tables
