"""The host service (cycle steps 2-4): sockets and sessions, sampling snapshots, the
scheduler and worker pool, job results, the runtime directory, systemd notification,
programs whose runs end too soon.
"""
