"""A Flask app whose views add one to a SQLite row's counter, keyed per row (see counters.py).

``GET /bump/<how>/<row_id>`` takes the row's turn in one of the ways a
WSGI app can, all on the same lines:

- ``decorated``: a plain ``def`` decorated with ``queue_by_key``;
- ``keyed``: the sync context manager, ``with orders.keyed(key) as turn``;
- ``run_sync``: ``orders.run_sync(key, fn, ...)``;
- ``async``: ``asyncio.run(orders.run(key, async_fn, ...))``, an event loop per
  request (in a gthread worker, several at once).

``GET /hold/<row_id>`` takes the row's turn and keeps it: a stuck worker,
for gunicorn's timeout to abort.

Without a queue (``INTURN_DEPLOY_BACKEND=none``), each does its
read-modify-write unguarded.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from counters import add_one, add_one_async, make_queue
from flask import Flask, abort, jsonify
from flask.typing import ResponseReturnValue

app = Flask(__name__)

#: Made at import: in gunicorn's master under --preload, else in each worker.
orders = make_queue()

if orders is None:
    bump = add_one
else:

    @orders.queue_by_key(key="row-{row_id}")
    def bump(row_id: int) -> dict[str, Any]:
        return add_one(row_id)


@app.get("/hold/<int:row_id>")
def hold(row_id: int) -> ResponseReturnValue:
    """Take the row's turn, touch INTURN_DEPLOY_HELD, and keep the turn for a minute (stuck)."""
    assert orders is not None
    with orders.keyed(f"row-{row_id}"):
        Path(os.environ["INTURN_DEPLOY_HELD"]).touch()
        time.sleep(60)  # until gunicorn's worker timeout aborts this worker
    return "held"


@app.get("/health")
def health() -> ResponseReturnValue:
    return "ok"


@app.get("/bump/<how>/<int:row_id>")
def bump_row(how: str, row_id: int) -> ResponseReturnValue:
    key = f"row-{row_id}"
    if how == "decorated":
        answer = bump(row_id)
    elif orders is None:
        answer = asyncio.run(add_one_async(row_id)) if how == "async" else add_one(row_id)
    elif how == "keyed":
        with orders.keyed(key) as turn:
            answer = add_one(row_id)
        answer["token"] = turn.token
    elif how == "run_sync":
        answer = orders.run_sync(key, add_one, row_id)
    elif how == "async":
        answer = asyncio.run(orders.run(key, add_one_async, row_id))
    else:
        abort(404)
    return jsonify(answer)
