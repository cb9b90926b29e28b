"""The job's process roles: one list for the launcher, the operator, the CLI, the fork server, metrics and
pod labels. A warm spare (`SPARE`) is a server process without a shard yet: it runs the server's module and
is counted as a server once it takes one over.
"""

from __future__ import annotations

ROLES = ("coordinator", "server", "worker")
SPARE = "spare"
PROCESS_ROLES = (*ROLES, SPARE)  # what a process (pod, local child) may be while it runs
