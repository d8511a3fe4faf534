"""``edgecache-board --name NAME --token TOKEN`` (or ``python manage.py edge ...``): run this machine as an edge board.

Starts without the control plane: no Django settings, no database, no signing secret.
It reads its ``BoardConfig`` from the environment, enrolls its own key pair with the device
token the first time (``inference.board.identity``), checks the device registry in the cache box
names its keys, loads the model once (its buffers sized to the device's registered memory,
``inference.engine.memory_plan``), then serves its own queue (``device.NAME``) and the shared one as a
Celery worker, sending heartbeats. It imports none of the control plane's packages (Django,
Channels, Daphne, Plotly, psycopg) nor PyTorch: ``pip install .`` installs all it needs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from cachebox.acl import board_transport_options, board_user, enroll_user, has_credentials, with_credentials
from cachebox.errors import CacheBoxRefused, CacheBoxUnavailable
from cachebox.events import LOGGER_NAME, JsonLineFormatter
from cachebox.link import LinkProfile
from cachebox.store import CacheBox
from inference import board as edge
from inference.board import replay
from inference.board.app import board_app
from inference.board.config import BoardConfig, ConfigError
from inference.board.devices import DeviceRefused
from inference.board.identity import BoardKeys, enrollment_redis_password
from inference.board.runtime import Board, broker_url, cachebox_url, set_board
from inference.contract.messages import Queue
from inference.engine.memory_plan import MemoryRefused
from inference.engine.model_file import ModelNotFound
from inference.engine.proc_memory import tune_malloc

log = logging.getLogger("inference.board")
ENROLL_TIMEOUT = float(
    os.environ.get("EDGECACHE_ENROLL_TIMEOUT", "120")
)  # seconds a board waits for its enrollment to be confirmed


def _logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("cachebox", "inference"):
        logging.getLogger(name).setLevel(os.environ.get("EDGECACHE_LOG_LEVEL", "WARNING"))
    security = logging.getLogger(LOGGER_NAME)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLineFormatter())
    security.addHandler(handler)
    security.setLevel(logging.INFO)
    security.propagate = False


def _as_board(config: BoardConfig, name: str, keys: BoardKeys) -> BoardConfig:
    """The configuration whose URLs reach Redis as this board's own user (``cachebox.acl``)."""
    if not config.board_acl:
        return config
    broker = with_credentials(broker_url(config), board_user(name), keys.redis_password)
    return config.with_(
        redis_url=broker,
        cachebox_url=with_credentials(config.cachebox_url, board_user(name), keys.redis_password)
        if config.cachebox_url
        else "",
    )


def _as_enrolling(config: BoardConfig, name: str, token: str) -> BoardConfig:
    """The configuration of a board not enrolled yet: Redis as the device's enrollment user, which
    may read its record and send its enrollment, nothing else."""
    if not config.board_acl:
        return config
    password = enrollment_redis_password(token)
    broker = with_credentials(broker_url(config), enroll_user(name), password)
    return config.with_(
        redis_url=broker,
        cachebox_url=with_credentials(config.cachebox_url, enroll_user(name), password) if config.cachebox_url else "",
    )


def _enrolled(name: str, config: BoardConfig, keys: BoardKeys, token: str, key_file) -> edge.EdgeIdentity:
    """This process as the board ``name``: as its own Redis user when it enrolled before, else (with
    the token) enrolled through its enrollment user first."""
    if config.board_acl and (has_credentials(config.redis_url) or has_credentials(config.cachebox_url)):
        log.warning(
            "REDIS_URL / EDGECACHE_CACHEBOX_URL carry credentials: a board uses its own Redis user, not those (remove them from its environment)"
        )

    def store_of(cfg: BoardConfig) -> CacheBox:
        return CacheBox(cachebox_url(cfg), connect_timeout=cfg.connect_timeout, timeout=cfg.io_timeout)

    if keys.control_plane_key:  # enrolled before (or at least pinned): try its own user first
        own = _as_board(config, name, keys)
        try:
            board_app(broker_url(own))
            return edge.become(
                name, keys, store_of(own), token=None, save=lambda pinned: pinned.save(key_file), timeout=ENROLL_TIMEOUT
            )
        except (CacheBoxRefused, DeviceRefused) as exc:  # no such user yet, or not enrolled: enroll with the token
            if not token:
                raise DeviceRefused(
                    f"{exc}; start it once with the device's token (--token or EDGECACHE_DEVICE_TOKEN)"
                ) from None
    elif not token:
        raise DeviceRefused(
            f"this board is not enrolled as {name!r}: start it once with the device's token (--token or EDGECACHE_DEVICE_TOKEN)"
        )
    enrolling = _as_enrolling(config, name, token)
    board_app(broker_url(enrolling))  # the enrollment goes through the broker, as the enrollment user
    holder = {"keys": keys}

    def save(pinned: BoardKeys) -> None:
        holder["keys"] = pinned
        pinned.save(key_file)

    try:
        return edge.become(
            name,
            keys,
            store_of(enrolling),
            token=token,
            save=save,
            then_as=lambda: store_of(_as_board(config, name, holder["keys"])),
            timeout=ENROLL_TIMEOUT,
        )
    except CacheBoxRefused as exc:
        raise DeviceRefused(
            f"the cache box refused this board's enrollment user ({exc}): the token is wrong, expired or spent, "
            "or the control plane is not running; rotate the token on the device's page"
        ) from None


def main(argv: list[str], prog: str = "manage.py edge") -> int:
    tune_malloc()  # before the first state is allocated (see inference.engine.proc_memory)
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start an edge board: checks its token, loads the model once, then serves its own queue "
        "(device.NAME) and the shared one as a Celery worker, sending heartbeats.",
    )
    parser.add_argument("--name", required=True, help="the device name registered on the dashboard")
    parser.add_argument(
        "--token",
        default=None,
        help="the device token, needed once to enroll this board (or set EDGECACHE_DEVICE_TOKEN)",
    )
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats (default 5)")
    parser.add_argument("--loglevel", default="warning")
    args = parser.parse_args(argv)
    _logging(args.loglevel)

    def fail(message: str) -> int:
        print(f"CommandError: {message}", file=sys.stderr)
        return 1

    token = args.token or os.environ.get("EDGECACHE_DEVICE_TOKEN", "")
    try:
        config = BoardConfig.from_env(device=args.name)
        key_file = config.key_file(args.name)
        keys = BoardKeys.load_or_create(key_file)
        me = _enrolled(args.name, config, keys, token, key_file)
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    except DeviceRefused as exc:
        return fail(f"refused: {exc}")
    except CacheBoxUnavailable as exc:
        return fail(f"cannot reach the cache box to check this board's enrollment: {exc}")
    link = None
    if me.record.link_bandwidth_mbps:
        link = LinkProfile(me.record.link_bandwidth_mbps, me.record.link_rtt_ms or 0.0)
    config = _as_board(config, args.name, me.keys).with_(
        namespace=me.record.cache_namespace,
        threads=me.record.threads or None,
        link=link,
        memory_mb=me.record.memory_mb or None,
    )
    me.store = CacheBox(
        cachebox_url(config), connect_timeout=config.connect_timeout, timeout=config.io_timeout
    )  # as its own user from now on
    queues = [Queue.device(args.name), Queue.shared(me.record.cache_namespace)]
    app = board_app(
        broker_url(config),
        queues=queues,
        transport_options=board_transport_options(args.name, me.record.cache_namespace),
    )
    try:
        replay.keep_in(config.state_folder() / "spent-requests")
    except OSError as exc:
        return fail(
            f"cannot keep the requests this board answers in {config.state_folder()}: {exc} (set EDGECACHE_BOARD_STATE_DIR)"
        )
    try:
        board = set_board(Board.start(config, keys=me.keychain()))
    except ModelNotFound as exc:
        return fail(str(exc))
    except MemoryRefused as exc:
        return fail(f"refused: {exc}")

    def stop_worker(reason):
        print(f"refused: {reason}; stopping the board", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown

    beat = edge.HeartbeatThread(board.status, args.heartbeat, on_refused=stop_worker)
    beat.start()
    queues = ",".join(queues)
    print(
        f"board {args.name} ready ({board.engine.model_file.path.name}, {board.engine.config.threads()} threads, "
        f"{board.store.link_label} to the cache box, namespace {me.record.cache_namespace}, "
        f"{('compute paced to ' + board.engine.pacer.profile.emulated_label + ', ') if board.engine.pacer is not None else ''}"
        f"{_memory_line(board)}"
        f"{_rates_line(board)}"
        f"signing keys {'generation ' + str(me.ring.current) if me.ring else 'missing: cache off'}); "
        f"serving queues {queues}",
        flush=True,
    )
    try:
        app.worker_main(
            [
                "worker",
                "--queues",
                queues,
                "--pool",
                "solo",
                "--hostname",
                f"{args.name}@%h",
                "--loglevel",
                args.loglevel,
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        beat.stop()
        board.close()
    return 0


def _memory_line(board: Board) -> str:
    plan = board.memory_plan
    if plan is None or not plan.memory_mb:
        return "memory not registered: default buffers, "
    over = "" if plan.within_budget else f", over its {plan.budget_mb:.0f} MB budget"
    return f"{plan.memory_mb} MB registered: context {plan.n_ctx}, RAM tier {plan.ram_tier_bytes // 2**20} MB, about {plan.estimate_mb:.0f} MB{over}, "


def _rates_line(board: Board) -> str:
    rates = board.rates
    if rates is None:
        return ""
    return (
        f"measured prefill {rates.prefill_ms_per_token:.2f} ms/token, decode {rates.decode_ms_per_token:.2f} ms/token, "
    )


def run() -> None:
    """The ``edgecache-board`` console script."""
    sys.exit(main(sys.argv[1:], prog="edgecache-board"))
