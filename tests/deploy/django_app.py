"""A one-view Django project (settings, URL and view in this module) for the deployment tests.

``GET /bump/<row_id>`` adds one to a SQLite row's counter through Django's
own database connection, in a plain ``def`` decorated with the queue's
``queue_by_key`` (see counters.py for the queue the environment chooses;
without one, it does its read-modify-write unguarded).
"""

from __future__ import annotations

import os
import time
from typing import Any

import django
from counters import MADE_IN, PAUSE, make_queue
from django.conf import settings

settings.configure(
    DEBUG=False,
    ALLOWED_HOSTS=["127.0.0.1"],
    SECRET_KEY="inturn deployment tests",
    ROOT_URLCONF=__name__,
    MIDDLEWARE=[],
    INSTALLED_APPS=[],
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ["INTURN_DEPLOY_DB"],
            # autocommit per statement (Django's default), and a writer waits for the lock
            "OPTIONS": {"timeout": 60},
        }
    },
)
django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402 - after settings.configure()
from django.db import connection  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402

from inturn import current_turn  # noqa: E402

#: Made at import: in gunicorn's master under --preload, else in each worker.
orders = make_queue()


def add_one(row_id: int) -> dict[str, Any]:
    """Add one to the row's counter: read, pause, write back, through Django's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT n FROM counters WHERE id = %s", [row_id])
        (n,) = cursor.fetchone()
        time.sleep(PAUSE)
        cursor.execute("UPDATE counters SET n = %s WHERE id = %s", [n + 1, row_id])
    turn = current_turn()
    return {
        "read": n,
        "token": None if turn is None else turn.token,
        "pid": os.getpid(),
        "made_in": MADE_IN,
    }


if orders is None:
    bump = add_one
else:

    @orders.queue_by_key(key="row-{row_id}")
    def bump(row_id: int) -> dict[str, Any]:
        return add_one(row_id)


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def bump_row(request: HttpRequest, row_id: int) -> JsonResponse:
    return JsonResponse(bump(row_id))


urlpatterns = [
    path("health", health),
    path("bump/<int:row_id>", bump_row),
]

application = get_wsgi_application()
