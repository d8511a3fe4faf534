"""What an edge board runs, and nothing else (what `pip install .` gives a board, with ``cachebox``):

- ``board``: the board process: its command, Celery app and tasks, enrollment, heartbeats, outbox;
- ``engine``: llama.cpp in one process, its kernels, model file and memory;
- ``serving``: a run served from cached state (prefix, schema), the strategy registry, the exchange;
- ``tiers``: where a run's state may come from: context, RAM, flash, the cache box;
- ``contract``: the messages between boards and the control plane, and their envelopes;
- ``lab``: the approximate strategies the registry names (their extras: the lab's);
- ``placement``: which board should answer (pure; the control plane's router calls it).
"""
