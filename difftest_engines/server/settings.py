"""The server engine's settings (difftest.base.settings): `server[url=...,kind=...,timeout=...,model=...]`."""

from difftest_engines.server import client as server_client
from difftest.api import Schema, Setting, settings_record

SCHEMA = Schema(
    "server",
    (
        Setting("url", "str", "the running server, http://HOST:PORT (required)"),
        Setting(
            "kind",
            "choice",
            "sglang | vllm (default: detected from the endpoints the server answers)",
            choices=("sglang", "vllm"),
        ),
        Setting(
            "timeout",
            "float",
            "seconds per HTTP request: a server that does not answer fails, never hangs",
            default=float(server_client.DEFAULT_TIMEOUT),
            min=0.001,
        ),
        Setting("model", "str", "the served model's expected name (default: the case's target path)"),
    ),
)

# what the adapter reads them as (Engine.settings_for): one attribute per setting
Settings = settings_record(SCHEMA)
