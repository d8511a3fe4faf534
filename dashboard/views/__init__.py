"""Pages of the control plane, one module per domain (as ``dashboard/actions/``). Login everywhere;
staff for credentials and cache actions.

- ``home``: the dashboard (every board, live charts), favicon and plotly.js
- ``devices``: list, detail with the break-even chart, register, rotate, revoke
- ``runs``: the Run page and cancel, the Runs list, exports, one run
- ``queue``: the runs under way per board and namespace, the unanswered ones, Revoke
- ``cache``: the Cache page and flush
- ``api_keys``: API keys per namespace: list with last use, create (shown once), revoke
- ``schemas``: list, edit, detail with cache status, encode, delete
- ``benchmarks``: saved benchmark reports and the Lab page
- ``metrics``: /metrics for Prometheus
- ``health``: /health and /ready for load balancers (no login)
- ``auth``: login and staff checks that count refusals; the login lockout page (django-axes)
- ``broker``: the 503 every page answers when the message broker is down

``dashboard/urls.py`` names the views through this package.
"""

from .api_keys import api_key_created, api_key_list, api_key_revoke
from .auth import login_locked_out
from .benchmarks import benchmark_list, benchmark_report, lab_page
from .cache import cache_flush, cache_page
from .devices import (
    device_breakeven,
    device_detail,
    device_list,
    device_register,
    device_revoke,
    device_rotate,
    device_token,
    device_trust,
)
from .health import health_view, ready_view
from .home import favicon, home, home_charts_json, plotly_js
from .metrics import metrics_view
from .queue import queue_page, queue_revoke
from .runs import run_cancel, run_detail, run_export, run_list, run_page
from .schemas import (
    schema_delete,
    schema_detail,
    schema_edit,
    schema_encode,
    schema_list,
)

__all__ = [
    "api_key_created",
    "api_key_list",
    "api_key_revoke",
    "benchmark_list",
    "benchmark_report",
    "cache_flush",
    "cache_page",
    "device_breakeven",
    "device_detail",
    "device_list",
    "device_register",
    "device_revoke",
    "device_trust",
    "device_rotate",
    "device_token",
    "favicon",
    "home",
    "home_charts_json",
    "lab_page",
    "login_locked_out",
    "health_view",
    "metrics_view",
    "plotly_js",
    "ready_view",
    "queue_page",
    "queue_revoke",
    "run_cancel",
    "run_detail",
    "run_export",
    "run_list",
    "run_page",
    "schema_delete",
    "schema_detail",
    "schema_edit",
    "schema_encode",
    "schema_list",
]
