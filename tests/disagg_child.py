"""A prefill server child for the disaggregation tests (run as a script).

    python tests/disagg_child.py STORE_PORT NAME CONFIG_JSON SETTINGS_JSON

It serves `serve_prefill` with HTTP on a free port and publishes
``ready/NAME`` = {"pid", "bootstrap", "http"} in the test's TCPStore. Test
points and faults are store keys, so a test never sleeps to hit a moment:

    job/<rid>                     set when the job reaches the server
    computing/<rid>               if hold-compute/<rid> exists: set when a prefill step of
                                  <rid> starts, which then waits for go/<rid>
    sending/<rid>/<i>             set before chunk i is sent; waits for go/<rid>
                                  if hold-send/<rid>/<i> exists
    fail/<rid>                    if it exists, the prefill's transfer of <rid> fails
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading

import anyio
import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.config import EngineConfig  # noqa: E402
from engine.serve.prefill_http import serve_prefill  # noqa: E402
from engine.disagg.link.settings import PrefillServerConfig  # noqa: E402
from engine.testing import FaultInjector  # noqa: E402

WAIT = datetime.timedelta(seconds=120)


def decode_rid(worker_request_id: str) -> str:
    """'prefill:<rid>@decode#<pair>.<tag>' -> '<rid>'."""
    return worker_request_id.removeprefix("prefill:").rsplit("@", 1)[0]


def main() -> int:
    store_port, name, config_json, settings_json = sys.argv[1:5]
    local = threading.local()

    def store() -> dist.TCPStore:
        """This thread's client of the test's store (a client serializes its calls: a hold in one thread
        must not block the test points of another)."""
        if not hasattr(local, "store"):
            local.store = dist.TCPStore("127.0.0.1", int(store_port), None, False, WAIT)
        return local.store

    def hold(key: str, rid: str, point: str, *, always: bool) -> None:
        held = store().check([key])
        if held or always:
            store().set(point, "1")
        if held:
            store().wait([f"go/{rid}"], WAIT)

    def stall_step(request_ids) -> None:
        for wid in request_ids:
            rid = decode_rid(wid)
            hold(f"hold-compute/{rid}", rid, f"computing/{rid}", always=False)

    def test_points(point: str, rid: str, index: int) -> None:
        if point == "job":
            store().set(f"job/{rid}", "1")
        elif point == "sending":
            hold(f"hold-send/{rid}/{index}", rid, f"sending/{rid}/{index}", always=True)

    faults = FaultInjector(stall_step=stall_step, fail_transfer=lambda rid: store().check([f"fail/{rid}"]))

    def on_ready(server, http_port: int) -> None:
        store().set(f"ready/{name}", json.dumps({"pid": os.getpid(), "bootstrap": server.bootstrap_port,
                                               "http": http_port}))

    config = EngineConfig(**json.loads(config_json))
    settings = PrefillServerConfig(**json.loads(settings_json))
    return anyio.run(lambda: serve_prefill(config, settings, "127.0.0.1", 0, log_json=True, log_level="warning",
                                           faults=faults, test_points=test_points, on_ready=on_ready))


if __name__ == "__main__":
    sys.exit(main())
