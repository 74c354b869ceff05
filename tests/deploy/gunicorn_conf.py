"""gunicorn's settings for the deployment tests (the command line adds bind, workers, threads).

A settings file, not flags: gunicorn ignores names it does not know, so
settings of newer versions cost nothing on older ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# No control socket: it would go to ~/.gunicorn, shared by every server of the machine.
control_socket_disable = True
# A stop (SIGTERM) waits this long for requests in flight; the tests have none by then.
graceful_timeout = 5
# Boots and fatal errors only: the log is shown when a test fails.
loglevel = "warning"


def post_worker_init(worker: Any) -> None:
    """Report a worker ready to serve (its app loaded): the test waits for all of them."""
    ready = os.environ.get("INTURN_DEPLOY_READY")
    if ready:
        Path(ready, str(os.getpid())).touch()
