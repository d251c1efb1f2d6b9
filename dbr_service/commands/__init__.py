"""The `dbr` commands and the operator's side: the command table, one module per command,
the control socket's verbs and client, run reports and comparisons, attach and detach.
"""
