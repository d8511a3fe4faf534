"""python manage.py edge --name NAME --token TOKEN: run this machine as an edge board."""

from __future__ import annotations

import os
import signal

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from cachebox.errors import CacheBoxUnavailable
from cachebox.link import LinkProfile
from cachebox.store import CacheBox
from inference import edge
from inference.board import cachebox_url, get_board
from inference.devices import DeviceRefused


class Command(BaseCommand):
    help = (
        "Start an edge board: checks its token, loads the model once, then serves its own queue "
        "(device.NAME) and the shared one as a Celery worker, sending heartbeats."
    )

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True, help="the device name registered on the dashboard")
        parser.add_argument("--token", default=None, help="the device token (or set EDGECACHE_DEVICE_TOKEN)")
        parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats (default 5)")
        parser.add_argument("--loglevel", default="warning")

    def handle(self, *args, name, token, heartbeat, loglevel, **options):
        token = token or os.environ.get("EDGECACHE_DEVICE_TOKEN", "")
        if not token:
            raise CommandError("give the device token with --token or EDGECACHE_DEVICE_TOKEN (it was shown when the device was registered)")
        try:
            store = CacheBox(cachebox_url())
            me = edge.become(name, token, store)
        except DeviceRefused as exc:
            raise CommandError(f"refused: {exc}")
        except CacheBoxUnavailable as exc:
            raise CommandError(f"cannot reach the cache box to check the token: {exc}")
        link = None
        if me.record.link_bandwidth_mbps:
            link = LinkProfile(me.record.link_bandwidth_mbps, me.record.link_rtt_ms or 0.0)
        board = get_board(device=name, namespace=me.record.cache_namespace, threads=me.record.threads, link=link, keys=me.keychain())
        def stop_worker(reason):
            self.stderr.write(f"refused: {reason}; stopping the board")
            os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown

        beat = edge.Heartbeat(board.status, heartbeat, on_refused=stop_worker)
        beat.start()
        self.stdout.write(
            f"board {name} ready ({board.engine.model_file.path.name}, {board.engine.config.threads()} threads, "
            f"{board.store.link_label} to the cache box, namespace {me.record.cache_namespace}, "
            f"signing keys {'generation ' + str(me.ring.current) if me.ring else 'missing: cache off'}); "
            f"serving queues device.{name} and {edge.SHARED_QUEUE}"
        )
        try:
            # The project's Celery app (configured by Django settings); boards never import the control plane.
            current_app._get_current_object().worker_main(
                [
                    "worker",
                    "--queues", f"device.{name},{edge.SHARED_QUEUE}",
                    "--pool", "solo",  # one process, one model
                    "--hostname", f"{name}@%h",
                    "--loglevel", loglevel,
                    "--without-gossip",
                    "--without-mingle",
                ]
            )
        finally:
            beat.stop()
            board.close()
